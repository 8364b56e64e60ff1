"""The constant-predictor baseline of the loss at init, for losses that are not a C-way cross-entropy.

For regression (MSE, MAE, Huber), multi-label sigmoid BCE or a reconstruction loss, ln C is no
reference. The honest reference is the loss of the best *constant* prediction on the same batch
(for an MSE, the variance of the targets): a fresh model is uncorrelated with its targets, so its
loss should be near that constant's (Karpathy, "A Recipe for Training Neural Networks": *init
well*, e.g. the final bias at the mean target), and far above it only when its outputs are at the
wrong scale for the targets (a huge init, unnormalised targets).

``init.loss`` of such a loss is :func:`check_init_loss_vs_constant`. The constant is fitted through the user's
own loss, with no knowledge of its formula:
:func:`output_sites` finds where ``apply``'s outputs appear inside the jaxpr of ``loss`` (the
first value of the loss's forward pass equal to each output of ``apply``), and
:func:`constant_loss` evaluates that jaxpr on jaxsane's interpreter with those values replaced by
one constant per output position (broadcast over the example axis), minimised over the constant.
The fit can only miss the optimum from above, so the reference it gives is never lower than the
true best constant's and the comparison never overstates. Not jit-safe (it runs the loss from the host).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from .._core.finding import Finding
from .._core.tree import explicit_sharding
from .._jaxpr.compile_level import quick_jit
from .._jaxpr.interpret import LOOPS, Interpreter

FIT_STEPS = 300  # Adam steps on the constant, with a learning rate decaying 100x


class CannotCompare(Exception):
    """The constant predictor cannot be formed honestly for this loss and apply; the message says why."""


@dataclasses.dataclass(frozen=True)
class Baseline:
    """The loss at init and the best constant prediction's loss, with the sites the constant replaced."""

    loss: float
    constant_loss: float
    outputs: int  # float output leaves of apply replaced by a constant
    examples: int  # the example axis the constant is broadcast over


class _Walk(Interpreter):
    """Custom-derivative functions are bound whole (their rules kept: the primal body of ``logaddexp``
    has a zero derivative at a tie, so interpreting it would stall the fit at a zero constant)."""

    def enters(self, eqn, ectx):
        return not eqn.primitive.name.startswith("custom_")


class _Record(_Walk):
    """Records every value outside loops whose shape and dtype are one of ``wanted``. Jit-safe."""

    def __init__(self, wanted: set):
        super().__init__()
        self.wanted = wanted

    def after(self, eqn, invals, outs, in_tags, out_tags, ectx):
        if not any(e.primitive.name in LOOPS for e in self.path):
            for j, (v, o) in enumerate(zip(eqn.outvars, outs)):
                aval = getattr(v, "aval", None)
                if aval is not None and (tuple(aval.shape), str(aval.dtype)) in self.wanted:
                    self.emit(eqn, o, f"out{j}")
        return outs, out_tags


class _Replace(_Walk):
    """Replaces the values at ``sites`` (site -> index into ``values``) with ``values``. Jit-safe."""

    def __init__(self, sites: dict, values: list):
        super().__init__()
        self.at_sites, self.values = sites, values

    def after(self, eqn, invals, outs, in_tags, out_tags, ectx):
        if not any(e.primitive.name in LOOPS for e in self.path):
            outs = list(outs)
            for j in range(len(outs)):
                k = self.at_sites.get(self.site_of(eqn, f"out{j}"))
                if k is not None:
                    outs[j] = jnp.broadcast_to(self.values[k], outs[j].shape).astype(outs[j].dtype)
        return outs, out_tags


def _float_leaves(tree: Any) -> list:
    return [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]


def output_sites(loss: Callable, apply: Callable, params: Any, batch: Any, inputs: Any) -> tuple[Any, list, list]:
    """Where ``apply(params, inputs)``'s float outputs appear in the jaxpr of ``loss(params, batch)``.

    Returns ``(closed jaxpr of loss, [site per output leaf], [output leaf values])``; a site is the
    first value of the loss's forward pass (outside loops) equal to that output. Raises
    :class:`CannotCompare` when an output does not appear (the loss draws noise or dropout that
    apply does not, runs the model in another mode, or does not call apply). Not jit-safe.
    """
    outs = [np.asarray(x) for x in _float_leaves(quick_jit(apply)(params, inputs))]
    if not outs:
        raise CannotCompare("apply's outputs hold no float array to replace by a constant")
    closed = jax.make_jaxpr(loss)(params, batch)
    wanted = {(x.shape, str(x.dtype)) for x in outs}
    rec = _Record(wanted)
    order: list = []

    def run(flat):
        with rec.collecting() as records:
            rec.run(closed.jaxpr, closed.consts, flat)
        order[:] = list(records)
        return [records[s] for s in order]

    values = quick_jit(run)(jax.tree_util.tree_leaves((params, batch)))
    sites = []
    for k, out in enumerate(outs):
        tol = 1e-5 * (float(np.max(np.abs(out))) + 1e-30) if out.size else 0.0
        found = [
            s
            for s, v in zip(order, values)
            if v.shape == out.shape
            and str(v.dtype) == str(out.dtype)
            and np.allclose(np.asarray(v), out, rtol=1e-5, atol=tol, equal_nan=True)
        ]
        if not found:
            raise CannotCompare(
                f"output {k} of apply ({out.shape}) is not a value of the loss's forward pass (the loss draws "
                "noise or dropout that apply does not, runs the model in another mode, or does not call "
                "apply), so it cannot be replaced by a constant"
            )
        sites.append(found[0])
    return closed, sites, outs


def constant_loss(
    loss: Callable,
    apply: Callable,
    params: Any,
    batch: Any,
    inputs: Any,
    *,
    examples: int,
    labels: Any = None,
    min_examples: int = 8,
) -> Baseline:
    """The loss at init and the loss of the best constant prediction, through the user's own loss.

    ``apply``'s outputs inside ``loss`` (see :func:`output_sites`) are replaced by one constant per
    output position, broadcast over their leading axis, which must be the ``examples`` axis; the
    constant is fitted to the batch by Adam from the best of a few starts (zero, the outputs' mean,
    the labels' mean where they have the outputs' shape). Raises :class:`CannotCompare` with the
    reason when this cannot be formed honestly. Not jit-safe.
    """
    closed, sites, outs = output_sites(loss, apply, params, batch, inputs)
    for k, out in enumerate(outs):
        if out.ndim < 1 or out.shape[0] != examples:
            raise CannotCompare(
                f"output {k} of apply has shape {out.shape}, whose leading axis is not the batch's "
                f"{examples} examples, so a constant over examples cannot be broadcast in"
            )
    if examples < min_examples:
        raise CannotCompare(
            f"the batch has {examples} examples; a constant fitted to fewer than {min_examples} "
            "fits their labels too closely to be a reference"
        )
    at_sites = {s: k for k, s in enumerate(sites)}
    flat = jax.tree_util.tree_leaves((params, batch))
    mesh = next((sh.mesh for sh in map(explicit_sharding, flat) if sh is not None), None)

    def put(c, dtype=None):  # constants live beside the params: replicated on their Explicit-axis mesh
        c = jnp.asarray(c, dtype)
        return c if mesh is None else jax.device_put(c, NamedSharding(mesh, PartitionSpec()))

    # the params' and the batch's arrays are passed, not closed over: never constants of the program
    arrays = [i for i, x in enumerate(flat) if isinstance(x, (np.ndarray, np.generic, jax.Array))]

    def f(values, passed):
        full = list(flat)
        for i, x in zip(arrays, passed):
            full[i] = x
        it = _Replace(at_sites, values)
        return jnp.asarray(it.run(closed.jaxpr, closed.consts, full)[0][0], jnp.float32).reshape(())

    program = quick_jit(f, runs=4)
    passed = [flat[i] for i in arrays]
    loss_with = lambda values: program(values, passed)  # noqa: E731
    init_value = float(loss_with([put(o) for o in outs]))
    label_stats: dict[tuple[int, ...], tuple[np.ndarray, float]] = {}  # shape -> (mean, spread) over the examples
    for x in (
        []
        if labels is None
        else _float_leaves(labels)
        + [y for y in jax.tree_util.tree_leaves(labels) if jnp.issubdtype(jnp.asarray(y).dtype, jnp.integer)]
    ):
        x = np.asarray(x, np.float64)
        if x.ndim >= 1 and x.shape[0] == examples:
            label_stats.setdefault(x.shape, (x.mean(0), float(np.sqrt(np.mean((x - x.mean(0)) ** 2)))))
    starts = [[np.zeros(o.shape[1:], o.dtype) for o in outs], [o.mean(0) for o in outs]]
    if all(o.shape in label_stats for o in outs):
        starts.append([label_stats[o.shape][0].astype(o.dtype) for o in outs])
    scale = [
        max(float(np.sqrt(np.mean((o - o.mean(0)) ** 2))), label_stats.get(o.shape, (0, 0.0))[1], 1e-3) for o in outs
    ]
    losses = [float(loss_with([put(c) for c in s])) for s in starts]
    finite = [i for i, v in enumerate(losses) if np.isfinite(v)]
    if not finite:
        raise CannotCompare("the loss is non-finite at every constant prediction tried")
    start = starts[min(finite, key=lambda i: losses[i])]
    best = float(np.nanmin(losses))
    fitted = _fit(f, [put(c, jnp.float32) for c in start], scale, passed)
    if np.isfinite(fitted):
        best = min(best, fitted)
    return Baseline(loss=init_value, constant_loss=best, outputs=len(outs), examples=examples)


def _fit(f: Callable, start: list, scale: list, passed: list) -> float:
    """The lowest ``f(values, passed)`` seen in :data:`FIT_STEPS` Adam steps of ``values`` from ``start`` (per-leaf
    step size ``0.3 * scale``)."""
    tx = optax.adam(optax.exponential_decay(0.3, FIT_STEPS, 0.01))
    sizes = [jnp.asarray(s, jnp.float32) for s in scale]

    @jax.jit
    def fit(c0, passed):
        def body(carry, _):
            c, opt, low = carry
            value, g = jax.value_and_grad(f)(c, passed)
            updates, opt = tx.update(g, opt, c)
            c = [ci + si * ui for ci, si, ui in zip(c, sizes, updates)]
            return (c, opt, jnp.where(jnp.isfinite(value), jnp.minimum(low, value), low)), None

        (c, _, low), _ = jax.lax.scan(
            body, (c0, tx.init(c0), jnp.asarray(jnp.inf, jnp.float32)), None, length=FIT_STEPS
        )
        last = f(c, passed)
        return jnp.where(jnp.isfinite(last), jnp.minimum(low, last), low)

    return float(fit(start, passed))


def check_init_loss_vs_constant(loss: float, constant_loss: float, *, factor: float = 30.0) -> list[Finding]:
    """``init.loss`` for a loss that is not a C-way cross-entropy: the loss at init is more than
    ``factor`` times the loss of the best constant prediction on the same batch.

    The reference (see the docstring of ``_checks/init_baseline.py``) is the user's loss with ``apply``'s outputs
    replaced by one constant per output position fitted to the batch: for an MSE the targets'
    variance, for a sigmoid BCE the labels' entropy. A fresh model is uncorrelated with its
    targets, so its loss sits above that reference, by 1-5x for a standard init (Karpathy, "A
    Recipe for Training Neural Networks": init well, e.g. the final bias at the mean target, and
    the loss at init is about the constant's). ``factor=30`` is an MSE whose outputs spread about
    5x the targets' (or a 30x MAE): outputs at the wrong scale (a huge init, unnormalised
    targets). It leaves room for a standard init on rare labels (1% positives with a zero final
    bias are ~14x). A loss below the constant's is not reported (a residual model that starts near
    the identity legitimately beats it). Not jit-safe.
    """
    if not math.isfinite(loss):
        return [
            Finding(
                "init.loss",
                f"the loss at init is {loss} (a loss that is not a C-way cross-entropy; the "
                f"best constant prediction's loss on this batch is {constant_loss:.4g})",
                "the loss is already non-finite at init: run jaxsane.locate on the loss to find where",
                severity="error",
                extra={"loss": loss, "constant_loss": constant_loss},
            )
        ]
    if loss <= factor * constant_loss:
        return []
    return [
        Finding(
            "init.loss",
            f"loss at init {loss:.4g} is {loss / constant_loss:.3g}x the loss of the best constant "
            f"prediction on this batch ({constant_loss:.4g}: apply's outputs replaced by one value per output "
            f"fitted to the labels; tolerance {factor:g}x)",
            "the outputs are at the wrong scale for the targets at init: check the init scale of every "
            "layer and scale down the last one (e.g. 0.01x its kernel, its bias at the mean target, or at "
            "log(p/(1-p)) for labels of frequency p), and normalise the targets (or de-normalise the "
            "outputs) so that both have the same units",
            extra={"loss": loss, "constant_loss": constant_loss, "factor": factor},
        )
    ]
