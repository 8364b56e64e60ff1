"""Init checks: the loss at init against chance level (ln C for C classes)."""

from __future__ import annotations

import math
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from ._experiment import Adapted, get_inputs, get_labels
from ._findings import Finding


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean cross-entropy of integer labels. Jit-safe."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels.astype(jnp.int32)[..., None], axis=-1))


def initial_loss(adapted: Adapted, state: Any, batch: Any) -> tuple[float | None, str]:
    """The loss of a fresh state on ``batch`` and how it was obtained. Not jit-safe."""
    exp = adapted.experiment
    params = adapted.params(state)
    if adapted.loss_fn is not None:
        return float(jax.jit(adapted.loss_fn)(params, batch)), "Experiment.loss"
    if adapted.apply_fn is not None:
        logits = jax.jit(adapted.apply_fn)(params, get_inputs(exp, batch))
        labels = jnp.asarray(get_labels(exp, batch))
        if logits.ndim == labels.ndim + 1 and jnp.issubdtype(labels.dtype, jnp.integer):
            return float(softmax_cross_entropy(logits, labels)), "cross-entropy of Experiment.apply"
    _, metrics = jax.jit(adapted.step)(state, batch)
    if "loss" in metrics:
        return float(np.asarray(metrics["loss"])), "the loss the step reports on its first call"
    return None, "no loss handle"


def infer_num_classes(adapted: Adapted, state: Any, batch: Any) -> int | None:
    """num_classes from the Experiment, or the last axis of ``apply``'s output. Not jit-safe."""
    exp = adapted.experiment
    if exp.num_classes is not None:
        return exp.num_classes
    if adapted.apply_fn is None:
        return None
    out = jax.eval_shape(adapted.apply_fn, adapted.params(state), get_inputs(exp, batch))
    return int(out.shape[-1]) if getattr(out, "ndim", 0) >= 1 and out.shape[-1] >= 2 else None


def check_init_loss(loss: float, num_classes: int, *, rtol: float = 0.5) -> list[Finding]:
    """``init.loss`` when the initial loss is outside ``ln C * [1 - rtol, 1 + rtol]``.

    The expectation ln C is Karpathy's ("A Recipe for Training Neural Networks"); ``rtol=0.5``
    leaves room for the logit variance of standard inits. Not jit-safe.
    """
    chance = math.log(num_classes)
    if not math.isfinite(loss):
        return [Finding("init.loss", f"the loss at init is {loss} (expected about ln {num_classes} = {chance:.3f})",
                        "the loss is already non-finite at init: run jaxsane.locate on the loss to find where",
                        severity="error", extra={"loss": loss, "chance": chance})]
    if abs(loss - chance) <= rtol * chance:
        return []
    direction = "above" if loss > chance else "below"
    hint = ("logits are over-confident at init: scale down the last layer's init (e.g. zero or 0.01x its "
            "kernel), check the init scale of every layer, and that the loss is softmax cross-entropy on logits"
            if loss > chance else
            "a loss below chance at init means labels leak into the inputs or the loss is not the mean "
            "cross-entropy (e.g. it is summed the wrong way, or masks drop most examples)")
    return [Finding("init.loss", f"loss at init {loss:.4f} is {direction} chance ln {num_classes} = {chance:.4f} "
                    f"(tolerance ±{rtol:.0%})", hint, extra={"loss": loss, "chance": chance, "rtol": rtol})]


def init_stage(ctx) -> Iterable[Finding]:
    """doctor stage: loss at init against ln C (options: ``init_loss_rtol``)."""
    state = ctx.adapted.init(ctx.key)
    num_classes = infer_num_classes(ctx.adapted, state, ctx.batch)
    loss, source = initial_loss(ctx.adapted, state, ctx.batch)
    ctx.diagnosis.artifacts["init_loss"] = {"loss": loss, "source": source, "num_classes": num_classes}
    if loss is None or num_classes is None:
        return [Finding("doctor.skipped", "loss at init not checked: needs num_classes (or apply) and a loss "
                        "(Experiment.loss, apply + labels, or a step reporting 'loss')", "")]
    return check_init_loss(loss, num_classes, rtol=ctx.option("init_loss_rtol", 0.5))
