"""Init checks: scale through depth and symmetric units from the per-layer activation statistics
(``init_capture.py``), and :func:`check_init`, which adds the loss at init against chance level
(``init_loss.py``). Not jit-safe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.finding import Finding
from .._core.frames import shown_location
from .._core.tree import PyTree
from .._core.validate import require_callable, require_float, require_int, require_same_rows
from .._experiment.contract import PureExperiment
from .._jaxpr.compile_level import quick_jit
from .._jaxpr.trace_cache import TracedOnce
from .init_capture import LayerStats, activation_stats
from .init_loss import (
    check_init_loss,
    softmax_cross_entropy,
)

__all__ = ["LayerStats", "activation_stats", "check_activations", "check_init", "traceable"]


def _file_of(location: str | None) -> str | None:
    return location.rsplit(":", 1)[0] if location and ":" in location else None


def _line_of(location: str | None) -> int | None:
    tail = location.rsplit(":", 1)[1] if location and ":" in location else ""
    return int(tail) if tail.isdigit() else None


def _where(layer: LayerStats) -> str:
    at = f", at {shown_location(_file_of(layer.location), _line_of(layer.location))}" if layer.location else ""
    return f"{layer.name} ({layer.kind} -> {layer.shape}{at})"


def _scale_findings(hidden: Sequence[LayerStats], scale_ratio: float, per_layer_factor: float) -> list[Finding]:
    """``init.scale`` from the pre-activation RMS along each chain of hidden layers (:attr:`LayerStats.chain`):
    the first chain whose scale grows or shrinks past the limits. Not jit-safe."""
    chains: dict[int, list[LayerStats]] = {}
    for lay in hidden:
        if np.isfinite(lay.pre_rms) and lay.pre_rms > 0 and not lay.merged:
            chains.setdefault(lay.chain, []).append(lay)
    for scaled in chains.values():
        if len(scaled) < 2:
            continue
        total = scaled[-1].pre_rms / scaled[0].pre_rms
        per_layer = total ** (1.0 / (len(scaled) - 1))
        grows = total > scale_ratio and per_layer > per_layer_factor
        shrinks = total < 1.0 / scale_ratio and per_layer < 1.0 / per_layer_factor
        if not (grows or shrinks):
            continue
        jumps = [scaled[i + 1].pre_rms / scaled[i].pre_rms for i in range(len(scaled) - 1)]
        worst = int(np.argmax([abs(np.log(j)) for j in jumps]))
        layer = scaled[worst + 1]
        rms = ", ".join(f"{lay.pre_rms:.3g}" for lay in scaled)
        return [
            Finding(
                "init.scale",
                f"activation scale {'grows' if grows else 'shrinks'} {total if grows else 1 / total:.3g}x through "
                f"{len(scaled)} hidden layers at init (pre-activation RMS per layer: {rms}); the largest jump "
                f"({jumps[worst]:.3g}x) is into {_where(layer)}",
                (
                    "weights are too large for the depth: use a variance-preserving init (he_normal for ReLU, "
                    "lecun_normal/glorot for tanh), i.e. std sqrt(2/fan_in) rather than 1, or add normalisation"
                )
                if grows
                else (
                    "weights are too small: the signal vanishes with depth; use he_normal (ReLU) or lecun_normal "
                    "(tanh) instead of a tiny constant std, or add normalisation"
                ),
                path=layer.name,
                file=_file_of(layer.location),
                line=_line_of(layer.location),
                extra={"rms": [lay.pre_rms for lay in scaled], "ratio": total, "per_layer": per_layer},
            )
        ]
    return []


def check_activations(
    layers: Sequence[LayerStats],
    *,
    scale_ratio: float = 10.0,
    per_layer_factor: float = 2.0,
    max_saturated: float = 0.5,
    symmetric_tol: float = 1e-6,
) -> list[Finding]:
    """``init.scale`` and ``init.symmetric`` from :func:`activation_stats`. Not jit-safe.

    Hidden layers only (a layer feeding the model's output directly, e.g. a zero-initialised
    classifier head, is exempt). Rules, each a keyword argument:

    * ``init.symmetric`` (error): a hidden layer's units are identical on the batch
      (``symmetry <= symmetric_tol``, default 1e-6) — constant or zero init never breaks symmetry.
    * ``init.scale`` (warning): the RMS of the pre-activations changes by more than ``scale_ratio``
      (default 10) from the first to the last hidden layer of a chain (layers that feed each other:
      :attr:`LayerStats.chain`; the two towers of a two-input model are two chains, a normalization starts
      one, the last layer of a residual branch is left out: :attr:`LayerStats.merged`) AND by more than
      ``per_layer_factor`` (default 2) per layer on average — variance-preserving inits keep it about constant
      (Glorot & Bengio 2010; He et al. 2015: a 0.7x/layer drift of LeCun init under ReLU is fine);
      or more than ``max_saturated`` (default 50%) of a bounded activation (tanh, sigmoid) is within
      1% of its bounds.
    """
    findings: list[Finding] = []
    hidden = [lay for lay in layers if not lay.is_output]
    for layer in hidden:
        if layer.units >= 2 and np.isfinite(layer.symmetry) and layer.symmetry <= symmetric_tol:
            findings.append(
                Finding(
                    "init.symmetric",
                    f"all {layer.units} units of {_where(layer)} compute the same value on every example at init "
                    f"(max difference {layer.symmetry:.1e} of the largest activation)",
                    "identical units get identical gradients and can never differ: initialise this layer's kernel "
                    "randomly (e.g. nn.initializers.lecun_normal / he_normal), not with a constant or zeros",
                    path=layer.name,
                    file=_file_of(layer.location),
                    line=_line_of(layer.location),
                    extra={"layer": dataclasses.asdict(layer)},
                )
            )
    findings += _scale_findings(hidden, scale_ratio, per_layer_factor)
    saturated = [
        lay for lay in hidden if np.isfinite(lay.act_frac_saturated) and lay.act_frac_saturated > max_saturated
    ]
    if saturated:
        listed = "; ".join(
            f"{lay.name}: {lay.act_frac_saturated:.0%} of {lay.activation} (pre-activation RMS {lay.pre_rms:.3g})"
            for lay in saturated
        )
        findings.append(
            Finding(
                "init.scale",
                f"bounded activations are saturated at init in {len(saturated)} hidden layer(s), first "
                f"{_where(saturated[0])}: {listed}",
                "saturated units pass almost no gradient: shrink these layers' init (lecun_normal / glorot for "
                "tanh and sigmoid, std ~ 1/sqrt(fan_in)) or normalise their inputs",
                path=saturated[0].name,
                file=_file_of(saturated[0].location),
                line=_line_of(saturated[0].location),
                extra={"frac_saturated": {lay.name: lay.act_frac_saturated for lay in saturated}},
            )
        )
    return findings


def check_init(
    apply: Callable,
    params: PyTree,
    inputs: Any,
    labels: Any = None,
    *,
    num_classes: int | None = None,
    loss: float | None = None,
    loss_rtol: float = 0.5,
    scale_ratio: float = 10.0,
    per_layer_factor: float = 2.0,
    max_saturated: float = 0.5,
    symmetric_tol: float = 1e-6,
) -> list[Finding]:
    """The init checklist on one batch: loss at init, activation scale through depth, symmetric units.

    Args:
      apply: ``(params, inputs) -> logits`` (for NNX use ``PureExperiment(exp).apply_fn`` or
        ``lambda state, x: nnx.merge(graphdef, state)(x)``).
      params: the freshly initialised parameters.
      inputs: a batch of inputs.
      labels: integer labels; with them the loss at init is the softmax cross-entropy of the logits.
      num_classes: number of classes (default: the last axis of the logits).
      loss: the initial loss, when computed elsewhere (overrides ``labels``).
      loss_rtol: ``init.loss`` tolerance around ln C (default 0.5; Karpathy's recipe).
      scale_ratio, per_layer_factor, max_saturated, symmetric_tol: see :func:`check_activations`.

    Returns:
      Findings ``init.loss``, ``init.scale``, ``init.symmetric``; empty on a healthy init.

    Not jit-safe.
    """
    require_callable("check_init", "apply", apply, signature="(params, inputs) -> logits")
    if labels is not None:
        require_same_rows("check_init", "inputs", inputs, "labels", labels)
    require_int("check_init", "num_classes", num_classes, min=2, optional=True)
    require_float("check_init", "loss", loss, optional=True)
    for _name, _v, _lo, _hi in (
        ("loss_rtol", loss_rtol, 0.0, None),
        ("scale_ratio", scale_ratio, 1.0, None),
        ("per_layer_factor", per_layer_factor, 1.0, None),
        ("max_saturated", max_saturated, 0.0, 1.0),
        ("symmetric_tol", symmetric_tol, 0.0, None),
    ):
        require_float("check_init", _name, _v, min=_lo, max=_hi)
    findings: list[Finding] = []
    if loss is None and labels is not None:
        logits = quick_jit(apply)(params, inputs)
        labels = jnp.asarray(labels)
        if getattr(logits, "ndim", 0) == labels.ndim + 1 and jnp.issubdtype(labels.dtype, jnp.integer):
            loss = float(softmax_cross_entropy(logits, labels))
            num_classes = num_classes or int(logits.shape[-1])
    if loss is not None:
        if num_classes is None:
            out = jax.eval_shape(apply, params, inputs)
            num_classes = int(out.shape[-1]) if getattr(out, "ndim", 0) >= 1 and out.shape[-1] >= 2 else None
        if num_classes is not None:
            findings += check_init_loss(float(loss), num_classes, rtol=loss_rtol)
    findings += check_activations(
        activation_stats(apply, params, inputs),
        scale_ratio=scale_ratio,
        per_layer_factor=per_layer_factor,
        max_saturated=max_saturated,
        symmetric_tol=symmetric_tol,
    )
    return findings


def traceable(adapted: PureExperiment, which: str) -> Callable | None:
    """``adapted.apply_fn`` (``which="apply"``) or ``adapted.loss_fn`` (``"loss"``), safe to trace.

    For NNX, the model's non-parameter variables are copied inside the traced function, so a model
    that updates them while being traced (BatchNorm left in train mode updating ``BatchStat``)
    does not raise flax's TraceContextError. Jit-safe.
    """
    handle = adapted.apply_fn if which == "apply" else adapted.loss_fn
    user = adapted.experiment.apply if which == "apply" else adapted.experiment.loss
    if handle is None or not adapted.nnx:
        return handle

    def call(params, arg):
        floats = [x.dtype for x in jax.tree_util.tree_leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
        if _casts_nothing(adapted._model_rest, floats):  # the handle's own function: its trace is shared
            return handle(params, arg)

        def copy(x):  # fresh values (traceable), floats in the parameters' dtype (float64 in check_grads)
            if floats and hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
                return jnp.asarray(x, floats[0])
            return jnp.asarray(x) if hasattr(x, "dtype") else x

        rest = jax.tree_util.tree_map(copy, adapted._model_rest)
        return user(adapted._model_with(params, training=which == "loss", rest=rest), arg)

    return adapted.memo("traceable:" + which, lambda: TracedOnce(call))  # traced once per input signature


def _casts_nothing(rest: PyTree, floats: list) -> bool:
    """Whether copying ``rest`` in the parameters' float dtype (``floats[0]``) changes no dtype: then the copy is
    the handle's own (``PureExperiment._model_with`` copies the other variables too), and calling the handle
    shares its trace, one per input signature, with every other program built on it (on a float32 model the
    gradient check's and the run's telemetry's). Jit-safe."""
    return all(
        not (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)) or (floats and x.dtype == floats[0])
        for x in jax.tree_util.tree_leaves(rest)
    )
