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

from .._checks.grads import check_grads
from .._checks.init import traceable
from .._core.finding import Finding
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
        findings = ctx.prepared["check"].result()
        if any(f.code.startswith("nonfinite.") for f in findings):
            ctx.prepared["replay"].cancel()  # a non-finite gradient is its own story: no latent one to look for
            return findings
        return findings + ctx.prepared["replay"].result()
    findings = _check(ctx)
    if any(f.code.startswith("nonfinite.") for f in findings):
        return findings
    return findings + _replay(ctx)


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
                              max_leaves=opts.grads_max_leaves or None)  # fmt: skip
    findings = check(dtype=jnp.float64) if opts.grads_float64 else check(dtype=jnp.float32, gradient=_shared(ctx))
    if not opts.grads_float64 and any(f.code in ("grad.mismatch", "grad.missing") for f in findings):
        findings = check(dtype=jnp.float64)  # a float32 failure, confirmed on the same sampled leaves (same seed)
    return findings


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
