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


def grads_stage(ctx: Any) -> Iterable[Finding]:
    """doctor stage: :func:`check_grads` of ``Experiment.loss`` at init on the first examples (:class:`GradsOptions`).

    doctor starts it in its background thread (:func:`prepare_grads`), so its compiles overlap the data and
    init stages; the stage then waits for those findings, and a crash there is the stage's crash."""
    if "future" in ctx.prepared:
        return ctx.prepared["future"].result()
    opts: GradsOptions = ctx.options
    adapted = ctx.pure
    if adapted.loss_fn is None:
        return [
            Finding(
                "doctor.skipped",
                "gradient check skipped: it needs Experiment.loss ((params, batch) -> scalar)",
                "pass Experiment(loss=...) to check gradients",
            )
        ]
    state = adapted.init(ctx.key)
    batch = slice_examples(ctx.experiment, ctx.batch, opts.grads_batch_size, whole=True)
    loss, params = traceable(adapted, "loss"), adapted.params(state)
    assert loss is not None, "Experiment.loss is present (checked above)"
    check = functools.partial(check_grads, loss, params, batch, order=opts.grads_order, modes=opts.grads_modes,
                              max_leaves=opts.grads_max_leaves or None)  # fmt: skip
    findings = check(dtype=jnp.float64 if opts.grads_float64 else jnp.float32)
    if not opts.grads_float64 and any(f.code in ("grad.mismatch", "grad.missing") for f in findings):
        findings = check(dtype=jnp.float64)  # a float32 failure, confirmed on the same sampled leaves (same seed)
    if not any(f.code.startswith("nonfinite.") for f in findings):  # finite compiled: is the replay's gradient?
        if opts.grads_replay_examples:
            batch = slice_examples(ctx.experiment, batch, opts.grads_replay_examples, whole=True)
        findings += latent_nan_findings(jax.grad(loss), params, batch)
    return findings


def prepare_grads(ctx: Any, pool: concurrent.futures.Executor) -> dict[str, Any]:
    """Start the whole grads stage in ``pool``: ``{"future": its findings}``. Not jit-safe."""
    return {"future": pool.submit(lambda: list(grads_stage(ctx)))}
