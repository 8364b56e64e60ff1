"""Per-layer activation statistics captured from the jaxpr of ``apply``: :func:`activation_stats` evaluates the
jaxpr on jaxsane's one interpreter (``_jaxpr/interpret.py``) with hooks that tag layers (a parameter matmul or
conv), activations, and normalizations (which start a new chain), so the init checks (``init.py``) read scale,
saturation and symmetry with no cooperation from the user's model. The capture runs inside one compiled
program (jit-safe); the Python around it is not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jcore

from .._core.errors import ExperimentError
from .._core.frames import user_location
from .._core.tree import PyTree, leaves_with_paths, shown_path
from .._core.validate import require_callable
from .._jaxpr.compile_level import quick_jit
from .._jaxpr.interpret import Interpreter

# ----------------------------------------------------------------------------- activation statistics

_ACTIVATION_NAMES = {
    "relu",
    "relu6",
    "gelu",
    "silu",
    "swish",
    "sigmoid",
    "tanh",
    "softplus",
    "elu",
    "selu",
    "celu",
    "leaky_relu",
    "hard_tanh",
    "hard_sigmoid",
    "hard_silu",
    "hard_swish",
    "mish",
    "log_sigmoid",
    "squareplus",
    "sparse_plus",
    "soft_sign",
}
_ACTIVATION_PRIMS = {"tanh": "tanh", "logistic": "sigmoid", "erf": "erf", "max": "relu"}
_BOUNDED = {
    "tanh": (-1.0, 1.0),
    "sigmoid": (0.0, 1.0),
    "hard_tanh": (-1.0, 1.0),
    "hard_sigmoid": (0.0, 1.0),
    "erf": (-1.0, 1.0),
    "soft_sign": (-1.0, 1.0),
}
_PASS_LAYER = {
    "add",
    "sub",
    "mul",
    "div",
    "neg",
    "broadcast_in_dim",
    "reshape",
    "convert_element_type",
    "transpose",
    "squeeze",
    "expand_dims",
    "copy",
    "copy_p",
    "reduce_precision",
    "select_n",
    "add_any",
    "integer_pow",
    "square",
    "pow",
}
_PASS_PARAM = {
    "convert_element_type",
    "reshape",
    "transpose",
    "broadcast_in_dim",
    "squeeze",
    "expand_dims",
    "copy",
    "copy_p",
    "reduce_precision",
}


@dataclasses.dataclass(frozen=True)
class LayerStats:
    """Statistics of one layer's output at init, found in the jaxpr of ``apply``.

    A layer is a ``dot_general`` or ``conv_general_dilated`` with a parameter operand; ``pre_*``
    describe its output (after the bias), ``act_*`` the nonlinearity applied to it (if any).
    ``symmetry`` is ``max |unit_j - unit_0| / max |unit|`` over the batch (0 = all units identical).
    """

    index: int
    name: str
    kind: str
    location: str | None
    shape: tuple[int, ...]
    units: int
    activation: str | None
    is_output: bool
    pre_mean: float
    pre_std: float
    pre_rms: float
    act_mean: float
    act_std: float
    act_frac_zero: float
    act_frac_saturated: float
    symmetry: float
    chain: int = 0
    """Which chain of layers this one is on, an id that the layers of one chain share: a chain starts at a layer
    that reads the model's inputs (or anything but another layer's output) and goes on through the layers that
    read its outputs. The towers of a CLIP-style model are separate chains; their scales are never compared.
    A normalization (LayerNorm, RMSNorm, BatchNorm on the batch's statistics) resets the scale: a layer fed
    through one starts a chain."""
    merged: bool = False
    """Whether this layer ends a residual branch: its output is added back into a stream that skipped it
    (``x + W2 f(W1 x)``: W2). Its scale is set on purpose (zero init, GPT-2's 1/sqrt(2 n_layers)) and is not a
    step down the chain, so :func:`check_activations` leaves it out of the chain's scale."""


def _layer_name(path: str) -> str:
    for suffix in (".value", "['kernel']", "['w']", "['weight']", "['W']", ".kernel", ".weight"):
        if path.endswith(suffix):
            path = path[: -len(suffix)]
    return path


def _unit_axes(eqn, param_side: int, ndim: int) -> tuple[int, ...]:
    if eqn.primitive.name == "conv_general_dilated":
        return (eqn.params["dimension_numbers"].out_spec[1],)
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs_nd, rhs_nd = eqn.invars[0].aval.ndim, eqn.invars[1].aval.ndim
    n_batch = len(lb)
    n_lhs_free = lhs_nd - len(lc) - len(lb)
    n_rhs_free = rhs_nd - len(rc) - len(rb)
    if param_side == 1:
        return tuple(range(n_batch + n_lhs_free, n_batch + n_lhs_free + n_rhs_free))
    return tuple(range(n_batch, n_batch + n_lhs_free))


def _stats(x, bounded) -> list:
    x = x.astype(jnp.float32)
    mean = jnp.mean(x)
    std = jnp.std(x)
    rms = jnp.sqrt(jnp.mean(x * x))
    zero = jnp.mean((x == 0).astype(jnp.float32))
    if bounded is None:
        sat = jnp.asarray(jnp.nan, jnp.float32)
    else:
        lo, hi = bounded
        margin = 0.01 * (hi - lo)
        sat = jnp.mean(((x <= lo + margin) | (x >= hi - margin)).astype(jnp.float32))
    return [mean, std, rms, zero, sat]


def _symmetry(x, axes: tuple[int, ...]):
    if not axes:
        return jnp.asarray(jnp.nan, jnp.float32)
    x = jnp.moveaxis(x.astype(jnp.float32), axes, tuple(range(x.ndim - len(axes), x.ndim)))
    units = int(np.prod([x.shape[i] for i in range(x.ndim - len(axes), x.ndim)]))
    if units < 2:
        return jnp.asarray(jnp.nan, jnp.float32)
    a = x.reshape(-1, units)
    return jnp.max(jnp.abs(a - a[:, :1])) / (jnp.max(jnp.abs(a)) + 1e-30)


_LAYERISH = ("layer", "act", "nlayer", "nact")
"""Tags of a value computed from a layer's output: ``("layer", site)``, ``("act", site, activation)``, and the
same after a normalization (``"nlayer"``, ``"nact"``): a layer fed such a value starts a chain of its own."""

_REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min"}
_ROOTS = {"sqrt", "rsqrt", "pow"}
_STAT_PASS = _PASS_LAYER | _ROOTS | {"max", "min", "abs", "stop_gradient"}


def _normed(tag: tuple) -> bool:
    return tag[0] in ("nlayer", "nact")


def _layer_tag(site: tuple, normed: bool) -> tuple:
    return ("nlayer" if normed else "layer", site)


def _act_tag(site: tuple, name: str, normed: bool) -> tuple:
    return ("nact" if normed else "act", site, name)


class _Capture(Interpreter):
    """Hooks that find the layers of ``apply`` and record their outputs and activations. Jit-safe.

    Tags: ``("param", path)`` | ``("layer", site)`` = a layer's output (+ bias, reshapes...) |
    ``("act", site, name)`` = a layer's output after a nonlinearity | ``"nlayer"``/``"nact"``: the same after a
    normalization (the value multiplied or divided by a root of its own statistics: LayerNorm, RMSNorm,
    BatchNorm on the batch's statistics, L2 normalization), which resets its scale | ``("stat", site)`` = a
    reduction of a layer's output | ``("root", site)`` = a square root (or power) of one. Sites are the
    interpreter's.
    """

    def __init__(self) -> None:
        super().__init__()
        self.meta: dict[tuple, dict] = {}  # layer site -> what the layer is, in first-seen order
        self.act_of: dict[tuple, tuple] = {}  # layer site -> (activation name, site recording its activation)
        self.merged: set[tuple] = set()  # layers that end a branch added back into a stream that skipped them

    def _ordinal(self, tag) -> int:
        return list(self.meta).index(tag[1])

    def _layer(self, eqn, invals, in_tags, ectx):
        """A ``dot_general``/``conv_general_dilated``: a layer when an operand comes from a parameter."""
        name = eqn.primitive.name
        outs = self.bind(eqn, invals, ectx)
        sides = [i for i, t in enumerate(in_tags[:2]) if t is not None and t[0] == "param"]
        if not sides:
            return outs, [None]
        side = 1 if 1 in sides else sides[0]
        feeding = in_tags[1 - side]
        from_layer = feeding is not None and feeding[0] in _LAYERISH
        if from_layer and feeding[1] not in self.act_of:
            # what enters this layer is the previous layer's activation
            where = self.emit(eqn, invals[1 - side], "input")
            self.act_of[feeding[1]] = (feeding[2] if feeding[0] in ("act", "nact") else None, where)
        site = self.emit(eqn, outs[0], "pre")
        after = from_layer and feeding[1] in self.meta and not _normed(feeding)
        self.meta.setdefault(
            site,
            {
                "head": self.meta[feeding[1]]["head"] if after else site,  # the first layer of its chain
                "fed_by": feeding[1] if from_layer else None,
                "name": _layer_name(shown_path(in_tags[side][1])),
                "kind": "conv" if name.startswith("conv") else "dense",
                "location": user_location(eqn, self.path),
                "shape": tuple(eqn.outvars[0].aval.shape),
                "axes": _unit_axes(eqn, side, eqn.outvars[0].aval.ndim),
            },
        )
        return outs, [("layer", site)]

    def _statistic(self, eqn, invals, in_tags, derived, ectx):
        """A reduction of a layer's output, or arithmetic on such reductions only (a mean, a variance, its
        root): tagged, so that multiplying a layer's output by the root marks a normalization; else None."""
        name = eqn.primitive.name
        if derived:
            if name not in _REDUCTIONS:
                return None
            top = max(derived, key=self._ordinal)
            return self.bind(eqn, invals, ectx), [("stat", top[1])]
        stats = [t for t in in_tags if t is not None and t[0] in ("stat", "root")]
        if not stats or name not in _STAT_PASS:
            return None
        outs = self.bind(eqn, invals, ectx)
        kind = "root" if name in _ROOTS or any(t[0] == "root" for t in stats) else "stat"
        return outs, [(kind, stats[0][1])] * len(outs)

    def before(self, eqn, invals, in_tags, ectx):
        name = eqn.primitive.name
        derived = [t for t in in_tags if t is not None and t[0] in _LAYERISH]
        if name in ("dot_general", "conv_general_dilated"):
            return self._layer(eqn, invals, in_tags, ectx)
        statistic = self._statistic(eqn, invals, in_tags, derived, ectx)
        if statistic is not None:
            return statistic
        if not derived:
            if name in _PASS_PARAM:
                params_in = [t for t in in_tags if t is not None and t[0] == "param"]
                if len(params_in) == 1:
                    outs = self.bind(eqn, invals, ectx)
                    return outs, [params_in[0]] * len(outs)
            return None
        top = max(derived, key=self._ordinal)
        normed = _normed(top)
        acts = [t for t in derived if t[0] in ("act", "nact") and t[1] == top[1]]
        if name in _ACTIVATION_PRIMS:
            if name == "max" and not any(getattr(v, "ndim", 0) == 0 or not hasattr(v, "aval") for v in eqn.invars):
                return None
            outs = self.bind(eqn, invals, ectx)
            return outs, [_act_tag(top[1], acts[0][2] if acts else _ACTIVATION_PRIMS[name], normed)] * len(outs)
        if name in _PASS_LAYER:
            outs = self.bind(eqn, invals, ectx)
            if name in ("mul", "div") and any(t is not None and t[0] == "root" for t in in_tags):
                normed = True  # scaled by a root of its own statistics: a normalization
            if name in ("add", "add_any"):
                self._merge(eqn, in_tags, top)
            if acts and name == "mul" and any(t[0] in ("layer", "nlayer") and t[1] == top[1] for t in derived):
                tag = _act_tag(top[1], "gated", normed)  # x * f(x): inlined gelu, swish, mish — unbounded
            elif acts:
                tag = _act_tag(top[1], acts[0][2], normed)
            else:
                tag = _layer_tag(top[1], normed)
            return outs, [tag] * len(outs)
        return None

    def _merge(self, eqn, in_tags: list, top: tuple) -> None:
        """An ``add`` of a layer's output and another value of its shape (not a bias): the layer ends a branch
        added back into a stream when what it adds to is not what it was fed (``x + W2 f(W1 x)``: W2, not the
        ``W`` of ``x + f(W x)``). A residual branch's last layer is scaled on purpose (zero init, GPT-2's
        1/sqrt(2 n_layers), LayerScale): its scale is no step down the chain."""
        shape = tuple(eqn.outvars[0].aval.shape)
        fed_by = self.meta[top[1]]["fed_by"]
        for var, tag in zip(eqn.invars, in_tags):
            if isinstance(var, jcore.Literal) or tuple(getattr(var.aval, "shape", ())) != shape or not shape:
                continue
            if tag is not None and (tag[0] not in _LAYERISH or tag[1] == top[1]):
                continue  # a parameter (a bias, a position embedding), a statistic, or the branch itself
            if (None if tag is None else tag[1]) != fed_by:
                self.merged.add(top[1])

    def after(self, eqn, invals, outs, in_tags, out_tags, ectx):
        # a jitted activation (jax.nn.relu, gelu...) applied to a layer's output
        derived = [t for t in in_tags if t is not None and t[0] in _LAYERISH]
        if derived and eqn.primitive.name in ("jit", "pjit") and eqn.params.get("name") in _ACTIVATION_NAMES:
            top = max(derived, key=self._ordinal)
            acts = [t for t in derived if t[0] in ("act", "nact") and t[1] == top[1]]
            return outs, [_act_tag(top[1], acts[0][2] if acts else eqn.params["name"], _normed(top))] * len(outs)
        return outs, out_tags


def activation_stats(apply: Callable, params: PyTree, inputs: Any) -> list[LayerStats]:
    """Per-layer activation statistics of ``apply(params, inputs)``, with no help from the model.

    The jaxpr of ``apply`` is evaluated by jaxsane's interpreter (``_jaxpr/interpret.py``,
    compiled once): every ``dot_general``/``conv_general_dilated`` with an operand computed from a
    parameter leaf is a layer, named by that leaf's path; the first nonlinearity applied to its
    output (``relu``, ``gelu``, ``tanh``, ``sigmoid``... by primitive or by jitted function name) is
    its activation. Works for Flax NNX (through :class:`PureExperiment`), linen and plain functions. Layers
    inside ``scan`` bodies (RNN cells, ``nn.scan``) are measured over all their time steps together;
    layers inside a ``while_loop`` body or a ``cond`` branch are not reported. Not jit-safe.
    """
    require_callable("activation_stats", "apply", apply, signature="(params, inputs) -> outputs")
    try:
        closed = jax.make_jaxpr(apply)(params, inputs)
    except Exception as e:
        raise ExperimentError(
            f"activation_stats: apply(params, inputs) failed to trace: {type(e).__name__}: {e}"
        ) from e
    param_paths = [p for p, _ in leaves_with_paths(params, "params")]
    n_in = len(closed.jaxpr.invars)
    tags0 = [("param", p) for p in param_paths] + [None] * (n_in - len(param_paths))
    cap = _Capture()
    kept: list[tuple] = []

    def run(flat):
        with cap.collecting() as records:
            _, out_tags = cap.run(closed.jaxpr, closed.consts, flat, None, tags0)
        output_layers = {t[1] for t in out_tags if t is not None and t[0] in ("layer", "act")}
        results = []
        kept.clear()
        for site, m in cap.meta.items():
            if site not in records:  # inside a traced while body or cond branch: not recorded
                continue
            x = records[site]
            name, where = cap.act_of.get(site, (None, None))
            a = records.get(where, x) if where is not None else x
            m["activation"] = name if where is not None and where in records else None
            m["is_output"] = site in output_layers
            shift = x.ndim - len(m["shape"])  # leading time axes of layers inside scan bodies
            pre_stats = _stats(x, None)
            act_stats = _stats(a, _BOUNDED.get(m["activation"]))
            results.append(
                jnp.stack(
                    [
                        pre_stats[0],
                        pre_stats[1],
                        pre_stats[2],
                        act_stats[0],
                        act_stats[1],
                        act_stats[3],
                        act_stats[4],
                        _symmetry(x, tuple(i + shift for i in m["axes"])),
                    ]
                )
            )
            kept.append(site)
        return results

    flat = jax.tree_util.tree_leaves((params, inputs))
    values = [np.asarray(v, np.float64) for v in quick_jit(run)(flat)]
    heads = list(cap.meta)
    layers = []
    for k, (site, v) in enumerate(zip(kept, values)):
        m = cap.meta[site]
        units = int(np.prod([m["shape"][i] for i in m["axes"]])) if m["axes"] else 1
        pre_mean, pre_std, pre_rms, act_mean, act_std, act_zero, act_saturated, symmetry = (float(x) for x in v)
        layers.append(
            LayerStats(
                k,
                m["name"],
                m["kind"],
                m["location"],
                m["shape"],
                units,
                m["activation"],
                m["is_output"],
                pre_mean,
                pre_std,
                pre_rms,
                act_mean,
                act_std,
                act_zero,
                act_saturated,
                symmetry,
                chain=heads.index(m["head"]),
                merged=site in cap.merged,
            )
        )
    return layers
