"""doctor's grads stage: :func:`~jaxsane.check_grads` of ``Experiment.loss`` at init, then the equation-by-equation
replay of the gradient that finds latent NaNs (``nonfinite.latent``). doctor starts it in a background thread
(:func:`prepare_grads`). Not jit-safe."""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._checks.grads import check_grads
from .._checks.init import traceable
from .._core.finding import Finding
from .._core.tree import copy_arrays, leaves_with_paths, shown_path
from .._experiment.batches import slice_examples
from .._locate.locate import latent_nan_findings
from .options import GradsOptions
from .run_stage import GRADIENT_TELEMETRY


def grads_stage(ctx: Any) -> Iterable[Finding]:
    """doctor stage: :func:`check_grads` of ``Experiment.loss`` at init on the first examples (:class:`GradsOptions`),
    then the replay of the gradient for latent NaNs when the check found nothing non-finite.

    doctor starts both in its background threads (:func:`prepare_grads`), so their compiles overlap the data and
    init stages; the stage then waits for those findings, and a crash there is the stage's crash."""
    if "check" in ctx.prepared:
        findings = updated_otherwise(ctx, ctx.prepared["check"].result())
        if any(f.code.startswith("nonfinite.") for f in findings):
            ctx.prepared["replay"].cancel()  # a non-finite gradient is its own story: no latent one to look for
            return findings
        return findings + ctx.prepared["replay"].result()
    findings = updated_otherwise(ctx, _check(ctx))
    if any(f.code.startswith("nonfinite.") for f in findings):
        return findings
    return findings + _replay(ctx)


DECAY_ALIGNMENT = 0.99
"""A zero-gradient leaf's update whose cosine with ``-leaf`` is at least this is weight decay shrinking it (adamw's
decoupled decay moves a leaf cut off from the loss too), not an update of its own."""


def updated_otherwise(ctx: Any, findings: list[Finding]) -> list[Finding]:
    """``findings`` with each ``grad.missing`` error on a leaf the output reads through a ``stop_gradient`` made an
    info when the user's step moves that leaf anyway, other than by weight decay: a target network updated as an
    average of the online one (BYOL's, DINO's, MoCo's EMA, a mean teacher), left out of the gradient on purpose.
    Runs the step once on a copy of the state at init, only when there is such an error. Not jit-safe."""
    flagged = {
        f.path
        for f in findings
        if f.code == "grad.missing" and f.severity == "error" and (f.extra or {}).get("depends")
        and not (f.extra or {}).get("kink")
    }  # fmt: skip
    if not flagged:
        return findings
    try:
        adapted = ctx.pure
        state = adapted.init(ctx.key)
        before = {shown_path(p): np.asarray(x) for p, x in leaves_with_paths(adapted.params(state), "params")}
        moved = adapted.params(adapted.step(copy_arrays(state), ctx.batch)[0])
        after = {shown_path(p): np.asarray(x) for p, x in leaves_with_paths(moved, "params")}
    except Exception:  # noqa: BLE001 - the step's own problems are the step stage's to report
        return findings
    own = {p for p in flagged if p in before and p in after and _moved_by_itself(before[p], after[p])}
    return [_averaged(f) if f.path in own and f.code == "grad.missing" else f for f in findings]


def _moved_by_itself(before: np.ndarray, after: np.ndarray) -> bool:
    """Whether a leaf changed other than by weight decay (an update along ``-before``). Host-side."""
    if before.shape != after.shape or before.dtype.kind != "f":
        return False
    d, p = (after.astype(np.float64) - before).ravel(), before.astype(np.float64).ravel()
    size = float(np.linalg.norm(d))
    if size == 0 or not np.isfinite(size):
        return False
    norm = float(np.linalg.norm(p))
    return norm == 0 or -float(d @ p) / (size * norm) < DECAY_ALIGNMENT


def _averaged(f: Finding) -> Finding:
    return Finding(
        "grad.missing",
        f"{f.path} gets no gradient (the output reads it through a stop_gradient), and the step updates it by other "
        "means, not weight decay: a target network kept as an average of the online one (BYOL, DINO, MoCo, a mean "
        "teacher), out of the gradient on purpose",
        "-",
        path=f.path,
        severity="info",
        extra={**(f.extra or {}), "updated_by_step": True},
    )


def _skipped() -> list[Finding]:
    return [
        Finding(
            "doctor.skipped",
            "gradient check skipped: it needs Experiment.loss ((params, batch) -> scalar)",
            "pass Experiment(loss=...) to check gradients",
        )
    ]


def _inputs(ctx: Any) -> tuple[Any, Any, Any]:
    """``(loss, params, batch)`` of the check: the traceable loss, the parameters at init, the first examples."""
    opts: GradsOptions = ctx.options
    adapted = ctx.pure
    state = adapted.init(ctx.key)
    batch = slice_examples(ctx.experiment, ctx.batch, opts.grads_batch_size, whole=True)
    return traceable(adapted, "loss"), adapted.params(state), batch


def _check(ctx: Any) -> list[Finding]:
    """:func:`check_grads`: in float32 with a failure confirmed in float64 (a large step), else in float64; the
    ``doctor.skipped`` finding without a loss."""
    opts: GradsOptions = ctx.options
    if ctx.pure.loss_fn is None:
        return _skipped()
    loss, params, batch = _inputs(ctx)
    check = functools.partial(check_grads, loss, params, batch, order=opts.grads_order, modes=opts.grads_modes,
                              max_leaves=opts.grads_max_leaves or None,
                              trust_autodiff=opts.grads_trust_autodiff)  # fmt: skip
    findings = check(dtype=jnp.float64) if opts.grads_float64 else check(dtype=jnp.float32, gradient=_shared(ctx))
    if not opts.grads_float64 and any(_unconfirmed(f) for f in findings):
        findings = check(dtype=jnp.float64)  # a float32 failure, confirmed on the same sampled leaves (same seed)
    return findings


def _unconfirmed(f: Finding) -> bool:
    """A float32 mismatch or missing gradient that float64 must confirm: an error or a warning. An info (leaves
    whose zero gradient is exact because a later layer starts at zero, the loss bitwise unchanged when they move)
    is no failure for rounding to explain: on an MLP-Mixer with a zero-initialised head the float64 pass compiled
    the loss twice more and took 10 of its check's 18 s, for the same finding."""
    return f.code in ("grad.mismatch", "grad.missing") and f.severity != "info"


def _shared(ctx: Any) -> Any:
    """The gradient of the run stage's telemetry program (``run_stage.gradient_telemetry``) when the run has made
    it: a float32 check on the telemetry's examples then runs that program instead of compiling the loss's
    backward pass again. None otherwise (the check compiles its own). Not jit-safe."""
    program = ctx.pure.memoized(GRADIENT_TELEMETRY)
    return None if program is None else (lambda params, batch: program(params, batch)["grads"])


def _replay(ctx: Any) -> list[Finding]:
    """``nonfinite.latent``: the gradient replayed equation by equation (on the first examples only, on a large
    step) is not finite where the compiled one is."""
    opts: GradsOptions = ctx.options
    if ctx.pure.loss_fn is None:
        return []
    loss, params, batch = _inputs(ctx)
    if opts.grads_replay_examples:
        batch = slice_examples(ctx.experiment, batch, opts.grads_replay_examples, whole=True)
    return latent_nan_findings(jax.grad(loss), params, batch)


def prepare_grads(ctx: Any, pool: concurrent.futures.Executor) -> dict[str, Any]:
    """Start the gradient check and the latent-NaN replay in ``pool``, as two jobs (a thread waiting for one can
    run the other): ``{"check": its findings, "replay": its findings}``. The replay's are dropped when the check
    finds a non-finite gradient. Not jit-safe."""
    return {"check": pool.submit(lambda: _check(ctx)), "replay": pool.submit(lambda: _replay(ctx))}
