"""The loss at init against chance level: ln C for a C-way cross-entropy over integer labels (Karpathy's
"A Recipe for Training Neural Networks"), where C comes from the Experiment or from the logits' width.
Only :func:`softmax_cross_entropy` is jit-safe; the rest runs the model on the host.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.finding import Finding
from .._core.tree import copy_arrays
from .._experiment.batches import get_inputs, get_labels, get_mask
from .._experiment.contract import PureExperiment


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean cross-entropy of integer labels. Jit-safe."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels.astype(jnp.int32)[..., None], axis=-1))


def initial_loss(adapted: PureExperiment, state: Any, batch: Any) -> tuple[float | None, str]:
    """The loss of a fresh state on ``batch`` and how it was obtained: ``Experiment.loss``, else the cross-entropy of
    ``apply``'s logits, else the loss the step reports on its first call (:func:`first_call_loss`). Not jit-safe."""
    exp = adapted.experiment
    params = adapted.params(state)
    loss_fn = adapted.jitted("loss")
    if loss_fn is not None:
        return float(loss_fn(params, batch)), "Experiment.loss"
    apply_fn = adapted.jitted("apply")
    if apply_fn is not None:
        logits = apply_fn(params, get_inputs(exp, batch))
        labels = jnp.asarray(get_labels(exp, batch))
        if logits.ndim == labels.ndim + 1 and jnp.issubdtype(labels.dtype, jnp.integer):
            return float(softmax_cross_entropy(logits, labels)), "cross-entropy of Experiment.apply"
    loss = first_call_loss(adapted, state, batch)
    return (None, "no loss handle") if loss is None else (loss, FIRST_CALL)


FIRST_CALL = "the loss the step reports on its first call"


def first_call_loss(adapted: PureExperiment, state: Any, batch: Any) -> float | None:
    """The loss the step reports on its first call from ``state`` (None when its metrics hold no ``"loss"``), from
    the step as the later checks call it (:meth:`PureExperiment.host_step`: a jitted user step is the program the
    step stage compiles anyway, not compiled a second time), on a copy of the state (a donating step deletes its
    inputs). Not jit-safe."""
    _, metrics = jax.eval_shape(adapted.step, state, batch)  # traced once for every check
    if not isinstance(metrics, dict) or "loss" not in metrics:
        return None
    _, metrics = adapted.host_step()(copy_arrays(state), batch)
    return float(np.asarray(metrics["loss"]))


def infer_num_classes(adapted: PureExperiment, state: Any, batch: Any) -> int | None:
    """num_classes from the Experiment, or C when ``apply`` gives C-way logits over integer labels.

    ln C is chance level only for a C-way cross-entropy: the output's last axis is C >= 2, the labels
    are integers in [0, C) with one axis less and the same leading shape. Regression, sigmoid or
    multi-label outputs, reconstructions (a VAE's pixels) and tuple outputs give None (see
    :func:`classification_of`). Not jit-safe.
    """
    return classification_of(adapted, state, batch)[0]


def classification_of(adapted: PureExperiment, state: Any, batch: Any) -> tuple[int | None, str]:
    """``(C, "")`` when the loss is a C-way cross-entropy over integer labels, else ``(None, why not)``.

    With ``Experiment.apply`` the loss itself decides: apply's outputs must be C-way logits over labels of
    one axis less (:func:`_classifier_width`), and the loss at init must be their mean cross-entropy (over
    every position or the masked ones, :func:`_is_mean_cross_entropy`). A path likelihood (CTC), a sequence
    log-likelihood summed over time, a label-smoothed or weighted loss is none, and ln C is not its chance
    level. A batch of token ids alone (a language model whose loss shifts them) is judged against its next
    tokens: apply's output at position t against token t + 1. Without apply, ``Experiment.num_classes`` is taken
    at its word. Not jit-safe."""
    exp = adapted.experiment
    if adapted.apply_fn is None:
        if exp.num_classes is not None:
            return exp.num_classes, ""
        return None, "Experiment.num_classes is not set and there is no Experiment.apply to infer it from"
    width, why_not = _classifier_width(adapted, state, batch)
    if width is None:
        return None, why_not
    why_not = _is_mean_cross_entropy(adapted, state, batch)
    if why_not:
        return None, why_not
    return exp.num_classes if exp.num_classes is not None else width, ""


def _is_mean_cross_entropy(adapted: PureExperiment, state: Any, batch: Any, rtol: float = 0.02) -> str:
    """``""`` when the loss at init is the mean softmax cross-entropy of apply's outputs against the labels
    (within ``rtol``: room for a small regulariser), over every position or over the batch's mask; else why
    not. A program whose loss cannot be read says nothing against it (``""``). Not jit-safe."""
    exp = adapted.experiment
    try:
        loss, source = initial_loss(adapted, state, batch)
        apply_fn = adapted.jitted("apply")
        assert apply_fn is not None
        logits = apply_fn(adapted.params(state), get_inputs(exp, batch))
        labels, next_token = _targets(exp, batch, logits.shape)
        mask = get_mask(exp, batch)
    except Exception:  # noqa: BLE001 - the handles fail here: the loss stage reports that, not this check
        return ""
    if loss is None or not math.isfinite(loss) or source.startswith("cross-entropy of"):
        return ""
    if next_token:  # position t predicts token t + 1 (the mask says which targets are real)
        logits, mask = logits[:, :-1], None if mask is None or np.ndim(mask) < 2 else np.asarray(mask)[:, 1:]
    candidates = mean_cross_entropies(logits, labels, mask)
    if is_one_of(loss, candidates, rtol):
        return ""
    if next_token:
        return (
            f"the batch has no labels, and the loss at init ({source}: {loss:.4g}) is not the mean cross-entropy "
            f"of apply's outputs at each position against the next input token ({candidates[0]:.4g}): it is not a "
            "next-token loss over apply's outputs (a masked-token or a sequence-level loss), so ln C is not its "
            "chance level"
        )
    return (
        f"the loss at init ({source}: {loss:.4g}) is not the mean cross-entropy of apply's outputs over their "
        f"class axis against the labels ({candidates[0]:.4g}): the loss runs the model in another mode than apply "
        "(dropout, batch statistics), or it is another loss (a path likelihood such as CTC, a log-likelihood summed "
        "over time, label smoothing or weights), whose chance level is not ln C"
    )


def _targets(exp: Any, batch: Any, out_shape: tuple) -> tuple[Any, bool]:
    """``(labels, next_token)``: the batch's labels; else, for a batch of token ids alone whose ``[B, T]`` shape
    apply's ``[B, T, C]`` outputs share (a language model whose loss shifts them), the next tokens
    ``inputs[:, 1:]`` and True. Raises what ``get_labels`` raises when neither. Not jit-safe."""
    try:
        return get_labels(exp, batch), False
    except Exception:
        tokens = get_inputs(exp, batch)
        shape, dtype = tuple(np.shape(tokens)), getattr(tokens, "dtype", None)
        if len(shape) != 2 or shape[1] < 2 or dtype is None or not np.issubdtype(dtype, np.integer):
            raise
        if shape != tuple(out_shape[:-1]):
            raise
        return np.asarray(tokens)[:, 1:], True


def mean_cross_entropies(logits: Any, labels: Any, mask: Any = None) -> list[float]:
    """The mean softmax cross-entropy of ``logits`` ``[..., C]`` against integer ``labels`` ``[...]``: over
    every position, then (when ``mask`` has the labels' shape) over the masked ones. Not jit-safe (floats)."""
    labels = jnp.asarray(labels)
    masked = mask is not None and np.shape(mask) == tuple(labels.shape)
    m = jnp.asarray(mask) if masked else jnp.ones(labels.shape, jnp.float32)
    every, over_mask = _mean_cross_entropies(logits, labels, m)  # one program, not one per eager operation
    return [float(every), float(over_mask)] if masked else [float(every)]


@jax.jit
def _mean_cross_entropies(logits: jax.Array, labels: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    per_position = -jnp.take_along_axis(
        jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1), labels.astype(jnp.int32)[..., None], axis=-1
    )[..., 0]
    m = mask.astype(jnp.float32)
    return jnp.mean(per_position), jnp.sum(per_position * m) / jnp.maximum(jnp.sum(m), 1.0)


def is_one_of(loss: float, candidates: list[float], rtol: float = 0.02) -> bool:
    """Whether ``loss`` is within ``rtol`` of one of the finite ``candidates``. Not jit-safe."""
    return any(abs(loss - c) <= rtol * max(abs(c), 1e-6) for c in candidates if math.isfinite(c))


def _classifier_width(adapted: PureExperiment, state: Any, batch: Any) -> tuple[int | None, str]:
    """``(C, "")`` when apply gives C-way logits over integer labels in [0, C) of one axis less, else
    ``(None, why not)``. Not jit-safe."""
    exp = adapted.experiment
    assert adapted.apply_fn is not None
    out = jax.eval_shape(adapted.apply_fn, adapted.params(state), get_inputs(exp, batch))
    if getattr(out, "ndim", 0) < 1 or out.shape[-1] < 2:
        return None, (
            f"apply's output ({_shape_text(out)}) is not one array of C >= 2 logits, so the loss is "
            "not a C-way cross-entropy"
        )
    try:
        labels, next_token = _targets(exp, batch, out.shape)
    except Exception:
        return None, (
            "the batch has no labels, nor token ids of apply's output shape to predict, so the loss is not a "
            "cross-entropy over integer labels"
        )
    shape, dtype = tuple(np.shape(labels)), getattr(labels, "dtype", np.asarray(labels).dtype)
    expected = (out.shape[0], out.shape[1] - 1, *out.shape[2:-1]) if next_token else tuple(out.shape[:-1])
    if not np.issubdtype(dtype, np.integer) or shape != expected:
        return None, (
            f"apply's output {tuple(out.shape)} against labels {shape} of dtype {dtype} is not a "
            "C-way classification over integer labels (regression, sigmoid/multi-label outputs or a "
            "reconstruction), so ln(output width) is not the loss at chance"
        )
    labels = np.asarray(labels)
    width = int(out.shape[-1])
    if labels.size and (labels.min() < 0 or labels.max() >= width):
        return None, (
            f"the integer labels span [{labels.min()}, {labels.max()}], outside the {width} outputs; "
            "set Experiment.num_classes to check the loss at init"
        )
    return width, ""


def _shape_text(out: Any) -> str:
    shapes = [tuple(x.shape) for x in jax.tree_util.tree_leaves(out)]
    return str(shapes[0]) if len(shapes) == 1 else f"{len(shapes)} arrays {shapes}"


def check_init_loss(loss: float, num_classes: int, *, rtol: float = 0.5) -> list[Finding]:
    """``init.loss`` when the initial loss is outside ``ln C * [1 - rtol, 1 + rtol]``.

    The expectation ln C is Karpathy's ("A Recipe for Training Neural Networks"); ``rtol=0.5``
    leaves room for the logit variance of standard inits. Not jit-safe.
    """
    chance = math.log(num_classes)
    if not math.isfinite(loss):
        return [
            Finding(
                "init.loss",
                f"the loss at init is {loss} (expected about ln {num_classes} = {chance:.3f})",
                "the loss is already non-finite at init: run jaxsane.locate on the loss to find where",
                severity="error",
                extra={"loss": loss, "chance": chance},
            )
        ]
    if abs(loss - chance) <= rtol * chance:
        return []
    direction = "above" if loss > chance else "below"
    hint = (
        "logits are over-confident at init: scale down the last layer's init (e.g. zero or 0.01x its "
        "kernel), check the init scale of every layer, and that the loss is softmax cross-entropy on logits"
        if loss > chance
        else "a loss below chance at init means labels leak into the inputs or the loss is not the mean "
        "cross-entropy (e.g. it is summed the wrong way, or masks drop most examples)"
    )
    return [
        Finding(
            "init.loss",
            f"loss at init {loss:.4f} is {direction} chance ln {num_classes} = {chance:.4f} (tolerance ±{rtol:.0%})",
            hint,
            extra={"loss": loss, "chance": chance, "rtol": rtol},
        )
    ]
