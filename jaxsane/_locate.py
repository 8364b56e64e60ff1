"""locate: find where the first non-finite value that reaches a function's outputs is born.

``jaxsane.locate(fn, *args, **kwargs)`` traces ``fn`` to a jaxpr and replays it on the real
inputs, equation by equation, with its own interpreter. ``jit``, ``custom_jvp``/``custom_vjp``
and ``remat`` calls are replayed inline. The common primitives (elementwise math, reductions,
``dot_general``, shape ops, ``select_n``) run on the host with numpy, so the replay compiles
nothing; the rest run through ``bind`` (compiled once per primitive, shape and parameters, and
cached by jax). ``scan``, ``while_loop``, ``cond``/``switch`` and ``shard_map`` first run whole;
only when one of them hands a NaN/Inf towards the outputs does the interpreter descend into its
body (per loop iteration, per branch taken, per device shard under a ``vmap`` that names the
mesh axes). After the replay, a backward pass over the data flow keeps only non-finite values
that actually flow into non-finite outputs, so NaNs produced and masked away
(``jnp.where(mask, x / d, 0)``, ``-inf`` attention masks with a finite softmax) are never
reported. The origin is the first computation with finite inputs and a non-finite result (or a
NaN result from merely infinite inputs, e.g. a ``-inf`` mask giving ``-inf - -inf``) on such a
path. :mod:`jaxsane._causes` names the cause and the fix.

When the replay is finite but the compiled program is not, the report says "not reproduced
outside XLA" and the smallest compiled prefix of the program that produces the non-finite value
is found by bisection (:func:`bisect_compiled`).

Nothing here is jit-safe: locate runs on the host, off the hot path, after a failure. On an
accelerator the replay copies the values it computes to host memory.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import linecache
import os
import sys
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax._src import core as jcore

from ._causes import Cause, explain
from ._findings import Finding
from ._tree import is_inexact, leaves_with_paths

# ----------------------------------------------------------------------------- frames

_SKIP_PACKAGES = ("jax", "jaxlib", "flax", "optax", "chex", "jaxsane", "numpy")
_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_STDLIB = os.path.dirname(os.path.abspath(inspect.__file__))


def _is_library_file(path: str) -> bool:
    """True for frames inside jax, flax, optax, chex, jaxsane itself (not its examples) or the stdlib."""
    p = os.path.abspath(path)
    if p.startswith(_PKG_DIR + os.sep):
        return not p.startswith(os.path.join(_PKG_DIR, "examples") + os.sep)
    if p.startswith(_STDLIB + os.sep) and "site-packages" not in p:
        return True
    parts = p.replace("\\", "/").split("/")
    if "site-packages" in parts or "dist-packages" in parts:
        i = max(i for i, x in enumerate(parts) if x in ("site-packages", "dist-packages"))
        return i + 1 < len(parts) and parts[i + 1].split(".")[0] in _SKIP_PACKAGES
    return path.startswith("<frozen")


def _frames(eqn) -> list:
    tb = getattr(eqn.source_info, "traceback", None)
    return list(tb.frames) if tb is not None else []


def user_frame(eqn) -> tuple[str, int] | None:
    """The innermost ``(file, line)`` of ``eqn``'s traceback outside jax/flax/optax/chex/jaxsane."""
    for fr in _frames(eqn):
        if not _is_library_file(fr.file_name):
            return fr.file_name, fr.line_num
    return None


def _in_optax(eqn) -> bool:
    for fr in _frames(eqn):
        if not _is_library_file(fr.file_name):
            return False
        if f"{os.sep}optax{os.sep}" in fr.file_name:
            return True
    return False


def source_text(file: str | None, line: int | None) -> str:
    if not file or not line:
        return ""
    return linecache.getline(file, line).strip()


# ----------------------------------------------------------------------------- custom_vjp backward rules

@contextlib.contextmanager
def _recording_custom_vjp(records: list):
    """Record every custom_vjp call made while tracing: (user call site, the custom_vjp, arg shapes)."""
    from jax._src.custom_derivatives import custom_vjp as cls
    original = cls.__call__

    def call(self, *args, **kwargs):
        f = sys._getframe(1)
        while f is not None and _is_library_file(f.f_code.co_filename):
            f = f.f_back
        try:
            specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), (args, kwargs))
        except Exception:  # noqa: BLE001 - non-array arguments: no re-trace later
            specs = None
        records.append(((f.f_code.co_filename, f.f_lineno) if f is not None else None, self, specs))
        return original(self, *args, **kwargs)

    cls.__call__ = call
    try:
        yield records
    finally:
        cls.__call__ = original


def _all_eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(sub, (jcore.Jaxpr, jcore.ClosedJaxpr)):
                    yield from _all_eqns(_closed(sub)[0])


def _custom_vjp_bwd_frame(node, records: list) -> tuple[str, int] | None:
    """The line inside a custom_vjp's backward rule that made ``node`` (jax keeps only the call site)."""
    if node.eqn is None or not any("custom_vjp" in fr.function_name for fr in _frames(node.eqn)):
        return None
    shapes = [tuple(np.shape(_raw(x.value))) for x in node.ins]
    for site, obj, specs in records:
        if site != node.frame or specs is None or getattr(obj, "nondiff_argnums", ()):
            continue
        try:
            out, res = jax.eval_shape(obj.fwd, *specs[0], **specs[1])
            bwd = jax.make_jaxpr(obj.bwd)(res, out)
        except Exception:  # noqa: BLE001 - a rule we cannot re-trace: keep the call site
            continue
        best = None
        for e in _all_eqns(bwd.jaxpr):
            frame = user_frame(e)
            if e.primitive.name != node.prim or frame is None:
                continue
            if [tuple(getattr(v.aval, "shape", ())) for v in e.invars] == shapes:
                return frame
            best = best or frame
        if best is not None:
            return best
    return None


# ----------------------------------------------------------------------------- values and nodes

def _flags(x: Any) -> tuple[bool, bool]:
    """(has NaN, has Inf) of an array; (False, False) for integer/bool/key arrays."""
    if not is_inexact(x):
        return False, False
    a = np.asarray(x)
    if a.size == 0:
        return False, False
    if np.isfinite(a).all():
        return False, False
    return bool(np.isnan(a).any()), bool(np.isinf(a).any())


class _Val:
    """A runtime value of the replay, with its non-finite flags and the node that produced it."""
    __slots__ = ("value", "nan", "inf", "producer", "kind", "name", "__weakref__")

    def __init__(self, value, producer=None, kind=None, name=None):
        self.value = value
        self.nan, self.inf = _flags(value)
        self.producer = producer
        self.kind = kind    # None (computed), "input", "literal", "const"
        self.name = name

    @property
    def bad(self) -> bool:
        return self.nan or self.inf


@dataclasses.dataclass
class _Ctx:
    """Where a jaxpr is being replayed: enclosing name stack, fallback frame, phase, shard mode, tags."""
    stack: str = ""
    frame: tuple[str, int] | None = None
    phase: str | None = None
    mesh: Any = None             # (axis_names, axis_sizes) while inside a shard_map body
    tags: tuple = ()
    order: tuple = ()
    in_optax: bool = False


class _Node:
    """One equation executed by the replay (or a link that forwards values, e.g. a scan's ys)."""
    __slots__ = ("eqn", "ins", "outs", "ctx", "order", "jaxpr", "index", "inner", "link", "env", "siblings",
                 "last_grad")

    def __init__(self, eqn, ins, ctx, order, jaxpr=None, index=-1, link=False):
        self.eqn, self.ins, self.ctx, self.order = eqn, ins, ctx, order
        self.jaxpr, self.index, self.link = jaxpr, index, link
        self.outs: list[_Val] = []
        self.inner: list[list[_Val]] | None = None   # expanded: outer out i <- inner values
        self.env = None
        self.siblings: list = []
        self.last_grad = -1

    @property
    def prim(self) -> str:
        return "link" if self.link else self.eqn.primitive.name

    @property
    def stack(self) -> str:
        own = str(self.eqn.source_info.name_stack) if self.eqn is not None else ""
        return "/".join(s for s in (self.ctx.stack, own) if s)

    @property
    def frame(self) -> tuple[str, int] | None:
        return (user_frame(self.eqn) if self.eqn is not None else None) or self.ctx.frame

    @property
    def phase(self) -> str:
        stack = self.stack
        if "transpose(" in stack:
            return "backward"
        if "jvp(" in stack:
            return "forward"
        if self.ctx.phase in ("update", "backward"):
            return self.ctx.phase
        if self.eqn is not None and (self.ctx.in_optax or _in_optax(self.eqn)):
            return "update"
        if self.jaxpr is not None and self.index > self.last_grad >= 0:
            return "update"
        return self.ctx.phase or "forward"


def _last_grad_index(jaxpr) -> int:
    """Index of the last equation of ``jaxpr`` that belongs to a backward pass (-1 if none)."""
    last = -1
    for i, eqn in enumerate(jaxpr.eqns):
        if "transpose(" in str(eqn.source_info.name_stack):
            last = i
    return last


# ----------------------------------------------------------------------------- the replay

_INLINE = {"custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
           "remat2": "jaxpr", "checkpoint": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}
_EXPANDABLE = {"pjit", "jit", "scan", "while", "cond", "shard_map"} | set(_INLINE)


def _closed(j) -> tuple[Any, list]:
    """(open jaxpr, consts) of a Jaxpr or ClosedJaxpr."""
    if isinstance(j, jcore.ClosedJaxpr):
        return j.jaxpr, list(j.consts)
    return j, []


def _bind(eqn, values: list, mesh=None) -> list:
    bp = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = bp if isinstance(bp, tuple) else ((), bp)

    def call(*xs):
        out = eqn.primitive.bind(*subfuns, *xs, **params)
        return list(out) if eqn.primitive.multiple_results else [out]

    if mesh is None:
        return call(*values)
    names, _ = mesh
    stacked = [isinstance(v, _Stacked) for v in values]
    if not any(stacked):
        return call(*values)
    fn = lambda *xs: call(*xs)  # noqa: E731
    for name in reversed(names):
        fn = jax.vmap(fn, in_axes=[0 if s else None for s in stacked], axis_name=name)
    out = fn(*[v.value if s else v for v, s in zip(values, stacked)])
    return [_Stacked(o) for o in out]


# -- a host replay for the common primitives: no compilation, the values XLA's kernels give up to rounding

def _np_dot_general(x, y, *, dimension_numbers, preferred_element_type=None, **_):
    (lc, rc), (lb, rb) = dimension_numbers
    letters = iter("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    xs, ys = [None] * x.ndim, [None] * y.ndim
    for i, j in zip(lb, rb):
        xs[i] = ys[j] = next(letters)
    for i, j in zip(lc, rc):
        xs[i] = ys[j] = next(letters)
    for i in range(x.ndim):
        xs[i] = xs[i] or next(letters)
    for j in range(y.ndim):
        ys[j] = ys[j] or next(letters)
    out = ([xs[i] for i in lb] + [xs[i] for i in range(x.ndim) if i not in lb and i not in lc]
           + [ys[j] for j in range(y.ndim) if j not in rb and j not in rc])
    dt = np.dtype(preferred_element_type) if preferred_element_type is not None else np.result_type(x, y)
    if dt.kind == "f" and dt.itemsize < 4:  # XLA's CPU dots accumulate float16/bfloat16 in float32
        x, y = x.astype(np.float32), y.astype(np.float32)
    return np.einsum(f"{''.join(xs)},{''.join(ys)}->{''.join(out)}", x, y, optimize=True)


def _np_broadcast(x, *, shape, broadcast_dimensions, **_):
    expanded = [1] * len(shape)
    for i, d in enumerate(broadcast_dimensions):
        expanded[d] = x.shape[i]
    return np.broadcast_to(x.reshape(expanded), shape)


def _np_select(pred, *cases):
    if pred.dtype == np.bool_:
        return np.where(pred, cases[1], cases[0]) if len(cases) == 2 else np.choose(pred.astype(int), cases)
    return np.choose(pred.astype(int), np.broadcast_arrays(*cases))


def _np_slice(x, *, start_indices, limit_indices, strides=None, **_):
    strides = strides or (1,) * x.ndim
    return x[tuple(slice(a, b, c) for a, b, c in zip(start_indices, limit_indices, strides))]


def _reduce(fn):
    return lambda x, *, axes, **_: fn(x, axis=tuple(axes))


_NP = {
    "neg": np.negative, "sign": np.sign, "floor": np.floor, "ceil": np.ceil, "is_finite": np.isfinite,
    "exp": np.exp, "exp2": np.exp2, "log": np.log, "log1p": np.log1p, "expm1": np.expm1, "tanh": np.tanh,
    "logistic": lambda x, **_: 1 / (1 + np.exp(-x)), "sin": np.sin, "cos": np.cos, "tan": np.tan,
    "asin": np.arcsin, "acos": np.arccos, "atan": np.arctan, "sinh": np.sinh, "cosh": np.cosh,
    "asinh": np.arcsinh, "acosh": np.arccosh, "atanh": np.arctanh, "sqrt": np.sqrt,
    "rsqrt": lambda x, **_: 1 / np.sqrt(x), "cbrt": np.cbrt, "abs": np.abs, "not": np.invert,
    "square": np.square, "add": np.add, "add_any": np.add, "sub": np.subtract, "mul": np.multiply,
    "div": lambda x, y, **_: (np.trunc(x / y).astype(x.dtype) if x.dtype.kind in "iu" else np.divide(x, y)),
    "rem": np.fmod, "pow": np.power, "max": np.maximum, "min": np.minimum, "atan2": np.arctan2,
    "eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
    "ge": np.greater_equal, "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor,
    "integer_pow": lambda x, *, y, **_: x ** y if y >= 0 else 1 / (x ** -y),
    "select_n": _np_select, "convert_element_type": lambda x, *, new_dtype, **_: x.astype(new_dtype),
    "broadcast_in_dim": _np_broadcast, "reshape": lambda x, *, new_sizes, **_: x.reshape(new_sizes),
    "squeeze": lambda x, *, dimensions, **_: np.squeeze(x, axis=tuple(dimensions)),
    "expand_dims": lambda x, *, dimensions, **_: np.expand_dims(x, tuple(dimensions)),
    "transpose": lambda x, *, permutation, **_: np.transpose(x, permutation),
    "reduce_sum": _reduce(np.sum), "reduce_max": _reduce(np.max), "reduce_min": _reduce(np.min),
    "reduce_prod": _reduce(np.prod), "reduce_and": _reduce(np.all), "reduce_or": _reduce(np.any),
    "dot_general": _np_dot_general, "concatenate": lambda *xs, dimension, **_: np.concatenate(xs, dimension),
    "slice": _np_slice, "copy": lambda x, **_: x, "copy_p": lambda x, **_: x,
    "clamp": lambda lo, x, hi, **_: np.minimum(np.maximum(x, lo), hi),
    "stop_gradient": lambda x, **_: x,
}
_NP_PARAMS = {"neg", "sign", "floor", "ceil", "is_finite", "exp", "exp2", "log", "log1p", "expm1", "tanh", "sin",
              "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "sqrt", "cbrt",
              "abs", "not", "square", "add", "add_any", "sub", "mul", "rem", "pow", "max", "min", "atan2", "eq",
              "ne", "lt", "le", "gt", "ge", "and", "or", "xor", "select_n"}   # ufuncs: called without params


def _evaluate(eqn, values: list, mesh=None) -> list:
    """One equation on real values: on the host with numpy when it can, else ``bind`` (jax caches it)."""
    name = eqn.primitive.name
    fn = _NP.get(name)
    if fn is None or mesh is not None or any(_is_extended(v) for v in values):
        return _bind(eqn, values, mesh)
    arrays = [np.asarray(v) for v in values]
    try:
        with np.errstate(all="ignore"):
            out = fn(*arrays) if name in _NP_PARAMS else fn(*arrays, **eqn.params)
    except Exception:  # anything numpy reads differently: let jax do it
        return _bind(eqn, values, mesh)
    aval = eqn.outvars[0].aval
    out = np.asarray(out)
    if out.shape != tuple(aval.shape):
        return _bind(eqn, values, mesh)
    with np.errstate(all="ignore"):
        return [out.astype(aval.dtype, copy=False)]


def _is_extended(v: Any) -> bool:
    dtype = getattr(v, "dtype", None)
    try:
        return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
    except TypeError:  # pragma: no cover
        return True


class _Stacked:
    """A per-shard value inside a shard_map body: leading axes are the mesh axes."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.value, dtype=dtype)

    @property
    def dtype(self):
        return self.value.dtype

    @property
    def shape(self):
        return self.value.shape


def _raw(v: Any) -> Any:
    return v.value if isinstance(v, _Stacked) else v


class _Replay:
    """Evaluates jaxprs on real values, recording every equation as a :class:`_Node`."""

    def __init__(self):
        self.count = 0
        self.envs: dict[int, tuple] = {}   # id(inlined jaxpr) -> (jaxpr, its replayed values)

    def run(self, jaxpr, consts: Sequence, ins: Sequence[_Val], ctx: _Ctx) -> tuple[list[_Val], dict]:
        env: dict = {}
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = c if isinstance(c, _Val) else _Val(c, kind="const")
        for v, x in zip(jaxpr.invars, ins):
            env[v] = x

        def read(a):
            if isinstance(a, jcore.Literal):
                return _Val(np.asarray(a.val, dtype=a.aval.dtype), kind="literal")
            return env[a]

        last_grad = _last_grad_index(jaxpr)
        nodes: list[_Node] = []
        for i, eqn in enumerate(jaxpr.eqns):
            invals = [read(a) for a in eqn.invars]
            node = _Node(eqn, invals, ctx, ctx.order + (i,), jaxpr, i)
            node.siblings = nodes
            node.last_grad = last_grad
            nodes.append(node)
            self.count += 1
            name = eqn.primitive.name
            sub_key = "jaxpr" if name in ("pjit", "jit") else _INLINE.get(name)
            if sub_key is not None and sub_key in eqn.params and ctx.mesh is None:
                # calls are replayed inline, equation by equation
                sub, sub_consts = _closed(eqn.params[sub_key])
                outs, sub_env = self.run(sub, sub_consts, invals[len(invals) - len(sub.invars):],
                                         self._child(node))
                self.envs[id(sub)] = (sub, sub_env)
            else:
                raw = _evaluate(eqn, [x.value for x in invals], ctx.mesh)
                outs = [_Val(o, producer=node) for o in raw]
                node.outs = outs
            for v, o in zip(eqn.outvars, outs):
                if not isinstance(v, jcore.DropVar):
                    env[v] = o
        outs = [read(a) for a in jaxpr.outvars]
        return outs, env

    @staticmethod
    def _child(node: _Node, tags: tuple = (), order_extra: tuple = ()) -> _Ctx:
        phase = node.phase
        ctx = node.ctx
        return _Ctx(stack=node.stack, frame=node.frame, phase=phase if phase != "forward" else ctx.phase,
                    mesh=ctx.mesh, tags=ctx.tags + tags, order=node.order + order_extra,
                    in_optax=ctx.in_optax or (node.eqn is not None and _in_optax(node.eqn)))

    # -- lazy descent into compiled calls
    def expand(self, node: _Node) -> None:
        """Replay the body of a jit/scan/while/cond/shard_map node; sets ``node.inner``."""
        p, name = node.eqn.params, node.prim
        ins = node.ins
        if name in ("pjit", "jit"):
            sub, consts = _closed(p["jaxpr"])
            outs, env = self.run(sub, consts, ins, self._child(node))
            node.env = env
            node.inner = [[o] for o in outs]
        elif name in _INLINE and _INLINE[name] in p:
            sub, consts = _closed(p[_INLINE[name]])
            outs, _ = self.run(sub, consts, ins[len(ins) - len(sub.invars):], self._child(node))
            node.inner = [[o] for o in outs]
        elif name == "cond":
            index = int(np.asarray(_raw(ins[0].value)).reshape(-1)[0]) if node.ctx.mesh is None else None
            if index is None:
                node.inner = None
                return
            branches = p["branches"]
            index = min(max(index, 0), len(branches) - 1)
            sub, consts = _closed(branches[index])
            outs, _ = self.run(sub, consts, ins[1:], self._child(node, (f"branch {index}",)))
            node.inner = [[o] for o in outs]
        elif name == "while":
            if node.ctx.mesh is not None:
                return
            self._expand_while(node)
        elif name == "scan":
            if node.ctx.mesh is not None:
                return
            self._expand_scan(node)
        elif name == "shard_map":
            if node.ctx.mesh is not None:
                return
            self._expand_shard_map(node)

    def _expand_scan(self, node: _Node) -> None:
        p = node.eqn.params
        sub, consts_extra = _closed(p["jaxpr"])
        n_consts, n_carry, length = p["num_consts"], p["num_carry"], p["length"]
        consts = node.ins[:n_consts]
        carry = node.ins[n_consts:n_consts + n_carry]
        xs = node.ins[n_consts + n_carry:]
        ys_parts: list[list[_Val]] = [[] for _ in range(len(node.outs) - n_carry)]
        steps = range(length - 1, -1, -1) if p["reverse"] else range(length)
        for it in steps:
            x_vals = []
            for x in xs:
                link = _Node(None, [x], node.ctx, node.order + (it, -1), link=True)
                val = _Val(x.value[it], producer=link)
                link.outs = [val]
                x_vals.append(val)
            ctx = self._child(node, (f"scan iteration {it}",), (it,))
            outs, _ = self.run(sub, consts_extra, list(consts) + list(carry) + x_vals, ctx)
            carry = outs[:n_carry]
            for k, y in enumerate(outs[n_carry:]):
                ys_parts[k].append(y)
        node.inner = [[c] for c in carry] + ys_parts

    def _expand_while(self, node: _Node) -> None:
        p = node.eqn.params
        cj, cconsts_extra = _closed(p["cond_jaxpr"])
        bj, bconsts_extra = _closed(p["body_jaxpr"])
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cconsts = [x.value for x in node.ins[:nc]]
        bconsts = node.ins[nc:nc + nb]
        carry = node.ins[nc + nb:]
        it = 0
        while True:
            pred = jcore.eval_jaxpr(cj, cconsts_extra, *cconsts, *[c.value for c in carry])[0]
            if not bool(np.asarray(pred)):
                break
            ctx = self._child(node, (f"while iteration {it}",), (it,))
            carry, _ = self.run(bj, bconsts_extra, list(bconsts) + list(carry), ctx)
            it += 1
        node.inner = [[c] for c in carry]

    def _expand_shard_map(self, node: _Node) -> None:
        p = node.eqn.params
        mesh = p["mesh"]
        names, sizes = tuple(mesh.axis_names), tuple(mesh.axis_sizes if hasattr(mesh, "axis_sizes")
                                                       else mesh.devices.shape)
        sub, consts = _closed(p["jaxpr"])
        ins = []
        for x, spec in zip(node.ins, p["in_specs"]):
            link = _Node(None, [x], node.ctx, node.order + (-1,), link=True)
            val = _Val(_Stacked(_split_shards(np.asarray(x.value), spec, names, sizes)), producer=link)
            link.outs = [val]
            ins.append(val)
        ctx = self._child(node, ("shard_map",))
        ctx.mesh = (names, sizes)
        outs, _ = self.run(sub, consts, ins, ctx)
        node.inner = [[o] for o in outs]


def _split_shards(a: np.ndarray, spec, names, sizes) -> np.ndarray:
    """Global array -> per-device blocks stacked with the mesh axes leading."""
    entries = tuple(spec) + (None,) * (a.ndim - len(tuple(spec)))
    blocks = []
    for coord in np.ndindex(*sizes):
        index = []
        for d, entry in enumerate(entries):
            axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
            n, k = 1, 0
            for ax in axes:
                j = names.index(ax)
                k = k * sizes[j] + coord[j]
                n *= sizes[j]
            size = a.shape[d] // n
            index.append(slice(k * size, (k + 1) * size))
        blocks.append(a[tuple(index)])
    stacked = np.stack(blocks)
    return stacked.reshape(*sizes, *blocks[0].shape)


# ----------------------------------------------------------------------------- the report

@dataclasses.dataclass(frozen=True)
class Origin:
    """One place where a non-finite value that reaches the outputs is born.

    Attributes:
      code: ``nonfinite.forward`` / ``.backward`` / ``.update`` / ``.input``.
      primitive: the jaxpr primitive that produced it (``"input"`` for a bad argument).
      phase: ``forward``, ``backward``, ``update`` or ``input``.
      file, line, source: the user's own frame and its source text.
      name_stack: the jaxpr name stack (``jvp()``, ``transpose(jvp())``, ...).
      values: what produced it, e.g. ``sqrt'(0.0) -> inf``.
      cause, fix: the likely cause and what to change.
      reaches: the output leaf paths it flows into.
      where: extra coordinates (scan iteration, shard, batch index under vmap).
    """
    code: str
    primitive: str
    phase: str
    file: str | None
    line: int | None
    source: str
    name_stack: str
    values: str
    cause: str
    fix: str
    reaches: list[str]
    where: list[str] = dataclasses.field(default_factory=list)
    then: str = ""

    @property
    def location(self) -> str:
        if self.file is None:
            return "<unknown location>"
        return f"{os.path.basename(self.file)}:{self.line}"

    def summary(self) -> str:
        """One line: code, primitive, phase, file:line and the values."""
        where = f" [{', '.join(self.where)}]" if self.where else ""
        return f"{self.code}: {self.primitive} ({self.phase}) at {self.location}{where}: {self.values}"

    def render(self) -> str:
        lines = [f"  origin: {self.primitive} ({self.phase}) at {self.location}"
                 + (f"   {self.source}" if self.source else "")]
        if self.where:
            lines.append(f"    where: {', '.join(self.where)}")
        if self.name_stack:
            lines.append(f"    name stack: {self.name_stack}")
        lines.append(f"    values: {self.values}")
        if self.then:
            lines.append(f"    then: {self.then}")
        if self.reaches:
            more = f" and {len(self.reaches) - 6} more" if len(self.reaches) > 6 else ""
            shown = ", ".join(self.reaches[:6]) + more
            lines.append(f"    reaches: {shown}")
        lines.append(f"    cause: {self.cause}")
        lines.append(f"    fix: {self.fix}")
        return "\n".join(lines)

    def to_finding(self) -> Finding:
        return Finding(self.code, f"{self.primitive} ({self.phase}) at {self.location} produced a non-finite value: "
                       f"{self.values}; {self.cause}", self.fix, path=self.reaches[0] if self.reaches else None,
                       file=self.file, line=self.line,
                       extra={"primitive": self.primitive, "phase": self.phase, "reaches": list(self.reaches),
                              "name_stack": self.name_stack, "where": list(self.where), "source": self.source})


@dataclasses.dataclass(frozen=True)
class LocateReport:
    """What :func:`locate` found. ``origins[0]`` is the root cause; ``str(report)`` renders it all.

    Attributes:
      origins: every origin found, earliest first.
      bad_outputs: ``[(path, n_nan, n_inf)]`` for each non-finite output leaf.
      xla_only: True when the de-optimized replay is finite but the compiled program is not.
      prefix: for ``xla_only``, the smallest compiled prefix (number of equations) that reproduces it.
      prefix_at: the primitive and file:line of that prefix's last equation.
      equations: how many equations the replay executed.
    """
    origins: list[Origin]
    bad_outputs: list[tuple[str, int, int]]
    xla_only: bool = False
    prefix: int | None = None
    prefix_total: int | None = None
    prefix_at: str = ""
    equations: int = 0

    def findings(self) -> list[Finding]:
        if self.origins:
            return [o.to_finding() for o in self.origins]
        paths = [p for p, _, _ in self.bad_outputs]
        return [Finding("nonfinite.forward", f"non-finite outputs {', '.join(paths[:4])}: {self._xla_text()}",
                        "run the step without jit (jax.disable_jit()) or with XLA_FLAGS=--xla_cpu_enable_fast_math="
                        "false / --xla_gpu_enable_fast_min_max=false to confirm; check the reported prefix",
                        path=paths[0] if paths else None, extra={"xla_only": True, "prefix": self.prefix})]

    def _xla_text(self) -> str:
        text = "not reproduced outside XLA: the equation-by-equation replay is finite but the compiled program is not"
        if self.prefix is not None:
            text += (f"; the smallest compiled prefix that produces it has {self.prefix} of {self.prefix_total} "
                     f"equations, ending with {self.prefix_at}")
        elif self.xla_only:
            text += "; no compiled prefix reproduced it (XLA optimises the prefixes differently)"
        return text

    def summary(self) -> str:
        return self.origins[0].summary() if self.origins else self._xla_text()

    def __str__(self) -> str:
        outs = ", ".join(f"{p} ({n} NaN, {i} Inf)" for p, n, i in self.bad_outputs[:6])
        more = f" and {len(self.bad_outputs) - 6} more" if len(self.bad_outputs) > 6 else ""
        lines = [f"[jaxsane] locate: non-finite outputs {outs}{more}"]
        if self.xla_only or not self.origins:
            lines.append("  " + self._xla_text())
        for k, o in enumerate(self.origins):
            if k == 1:
                lines.append(f"  {len(self.origins) - 1} further origin(s):")
            lines.append(o.render())
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"LocateReport({self.summary()!r})"


# ----------------------------------------------------------------------------- analysis

_OUT = "output"


class _Analysis:
    """Backward reachability from the bad outputs over the replay graph, with lazy descent."""

    def __init__(self, replay: _Replay, outs: list[_Val], out_paths: list[str]):
        self.replay = replay
        self.consumers: dict[int, list] = {}
        self.vals: dict[int, _Val] = {}
        self.out_of: dict[int, list[str]] = {}
        self.out_order = {p: i for i, p in enumerate(out_paths)}
        self.births: list[_Node] = []
        self.sources: list[_Val] = []
        self.xla: list[tuple[_Node, int]] = []
        self.retrace: Callable[[], list] | None = None
        self._records: list | None = None
        self.reached: set[int] = set()
        work: list[_Val] = []
        for v, path in zip(outs, out_paths):
            if v.bad:
                self.out_of.setdefault(id(v), []).append(path)
                self._use(v, _OUT)
                work.append(v)
        self._walk(work)

    def vjp_records(self) -> list:
        if self._records is None:
            try:
                self._records = self.retrace() if self.retrace is not None else []
            except Exception:  # noqa: BLE001 - best effort
                self._records = []
        return self._records

    def _use(self, v: _Val, consumer) -> None:
        self.vals[id(v)] = v
        lst = self.consumers.setdefault(id(v), [])
        if consumer not in lst:
            lst.append(consumer)

    def _walk(self, work: list[_Val]) -> None:
        seen_vals: set[int] = set()
        while work:
            v = work.pop()
            if id(v) in seen_vals:
                continue
            seen_vals.add(id(v))
            node = v.producer
            if node is None:
                self.sources.append(v)
                continue
            if not node.link and node.prim in _EXPANDABLE and node.inner is None:
                try:
                    self.replay.expand(node)
                except Exception:  # pragma: no cover - descent is best effort; the node stays opaque
                    node.inner = None
            if not node.link and node.inner is not None:
                k = node.outs.index(v)
                inner = [x for x in node.inner[k] if x.bad]
                if not inner:
                    self.xla.append((node, k))
                    continue
                link = _Node(None, inner, node.ctx, node.order, link=True)
                link.outs = [v]
                for x in inner:
                    self._use(x, link)
                    work.append(x)
                continue
            if id(node) in self.reached:
                continue
            self.reached.add(id(node))
            bad_in = [x for x in node.ins if x.bad]
            for x in bad_in:
                self._use(x, node)
                work.append(x)
            if node.link:
                continue
            out_nan = any(o.nan for o in node.outs)
            if not bad_in or (out_nan and not any(x.nan for x in bad_in) and not self._from_birth(node)):
                self.births.append(node)

    def _from_birth(self, node: _Node, depth: int = 0) -> bool:
        """True when some bad input of ``node`` descends from an inf born from finite values (not a source)."""
        stack, seen = [(x, 0) for x in node.ins if x.bad], set()
        while stack:
            v, d = stack.pop()
            if id(v) in seen or d > 400:
                continue
            seen.add(id(v))
            p = v.producer
            if p is None:
                continue
            if not p.link and p.inner is not None:
                k = p.outs.index(v) if v in p.outs else -1
                nxt = [x for x in p.inner[k] if x.bad] if k >= 0 else []
                stack += [(x, d + 1) for x in nxt]
                continue
            bad = [x for x in p.ins if x.bad]
            if not bad and not p.link:
                return True
            stack += [(x, d + 1) for x in bad]
        return False

    # -- forward questions about a birth
    def downstream(self, node: _Node, limit: int = 64) -> list:
        """Nodes reached from ``node``'s bad outputs (breadth first), ``_OUT`` included."""
        seen, order, frontier = set(), [], [o for o in node.outs if o.bad]
        while frontier and len(order) < limit:
            nxt = []
            for v in frontier:
                for c in self.consumers.get(id(v), []):
                    if id(c) in seen:
                        continue
                    seen.add(id(c))
                    order.append(c)
                    if c is not _OUT:
                        nxt += [o for o in c.outs if o.bad]
            frontier = nxt
        return order

    def reaches(self, node: _Node | _Val) -> list[str]:
        seen, paths = set(), []
        frontier = [o for o in node.outs if o.bad] if isinstance(node, _Node) else [node]
        while frontier:
            nxt = []
            for v in frontier:
                if id(v) in seen:
                    continue
                seen.add(id(v))
                paths += [p for p in self.out_of.get(id(v), []) if p not in paths]
                for c in self.consumers.get(id(v), []):
                    if c is not _OUT:
                        nxt += [o for o in c.outs if o.bad]
            frontier = nxt
        return sorted(paths, key=lambda p: self.out_order.get(p, len(self.out_order)))

    def only_backward(self, node: _Node) -> bool:
        """True when ``node``'s bad outputs are consumed only by backward-pass computations."""
        memo: dict[int, bool] = {}

        def rec(n, depth) -> bool:
            if id(n) in memo:
                return memo[id(n)]
            if depth > 200:
                return False
            memo[id(n)] = False
            users = [c for o in n.outs if o.bad for c in self.consumers.get(id(o), [])]
            ok = bool(users)
            for c in users:
                if c is _OUT:
                    ok = False
                elif c.link:
                    ok = ok and rec(c, depth + 1)
                elif "transpose(" in c.stack:
                    continue
                elif "jvp(" in c.stack:
                    ok = ok and rec(c, depth + 1)
                else:
                    ok = False
                if not ok:
                    break
            memo[id(n)] = ok
            return ok

        return rec(node, 0)


# ----------------------------------------------------------------------------- entry point

def _nnx_module():
    try:
        from flax import nnx
        return nnx
    except ImportError:  # pragma: no cover
        return None


def _arg_names(fn: Callable, n: int) -> list[str]:
    from ._experiment import _unwrap
    try:
        params = list(inspect.signature(_unwrap(fn)).parameters.values())
        names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        names = []
    return [names[i] if i < len(names) else f"args[{i}]" for i in range(n)]


def _is_traced_leaf(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _prepare(fn: Callable, args: tuple, kwargs: dict):
    """A pure function of flat array leaves, the leaves, their paths and a namer for the outputs."""
    nnx = _nnx_module()
    names = _arg_names(fn, len(args))
    positions = [i for i, a in enumerate(args) if nnx is not None and isinstance(a, nnx.Pytree)]
    graphdef, nnx_state = None, None
    if positions:
        graphdef, nnx_state = nnx.split(tuple(args[i] for i in positions))
    plain = tuple(None if i in positions else a for i, a in enumerate(args))
    tree = (nnx_state, plain, kwargs)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    paths = []
    for i, (path, _) in enumerate(leaves_with_paths(tree)):
        paths.append(_rename(path, names, positions))
    traced = [i for i, x in enumerate(leaves) if _is_traced_leaf(x)]

    def pure(*arrays):
        flat = list(leaves)
        for i, a in zip(traced, arrays):
            flat[i] = a
        state, plain_, kw = jax.tree_util.tree_unflatten(treedef, flat)
        call = list(plain_)
        objs = ()
        if positions:
            objs = nnx.merge(graphdef, state)
            for p, obj in zip(positions, objs):
                call[p] = obj
        out = fn(*call, **kw)
        if positions:
            return out, nnx.state(objs)
        return out

    def out_paths(out) -> list[str]:
        if positions:
            res, new_state = out
            return (_named_out_paths(res, args, names, positions)
                    + [_rename(p, names, positions, prefix="(state)") for p, _ in
                       leaves_with_paths((new_state, None, None))])
        return _named_out_paths(out, args, names, positions)

    return pure, [leaves[i] for i in traced], [paths[i] for i in traced], out_paths


def _rename(path: str, names: list[str], positions: list[int], prefix: str = "") -> str:
    """Paths of the (nnx_state, plain, kwargs) tuple -> ``model...``, ``batch['x']``, ``kwargs['k']``."""
    if path.startswith("[0]"):
        rest = path[3:]
        k = rest[1:].split("]")[0] if rest.startswith("[") else ""
        if k.isdigit() and int(k) < len(positions):
            return names[positions[int(k)]] + rest[len(k) + 2:]
        return "nnx_state" + rest
    if path.startswith("[1]["):
        rest = path[4:]
        k, _, tail = rest.partition("]")
        return (names[int(k)] if k.isdigit() and int(k) < len(names) else f"args[{k}]") + tail
    if path.startswith("[2]"):
        return "kwargs" + path[3:]
    return path


def _named_out_paths(out, args, names, positions) -> list[str]:
    from ._tree import same_structure
    plain0 = args[0] if args and 0 not in positions else None
    if plain0 is not None and len(jax.tree_util.tree_leaves(plain0)) < 2:
        plain0 = None   # a single array is not a train state: name the outputs "out"
    if isinstance(out, tuple) and len(out) == 2 and plain0 is not None and same_structure(out[0], plain0):
        root = "metrics" if isinstance(out[1], dict) else "loss"
        return ([p for p, _ in leaves_with_paths(out[0], names[0])]
                + [p for p, _ in leaves_with_paths(out[1], root)])
    if plain0 is not None and same_structure(out, plain0):
        return [p for p, _ in leaves_with_paths(out, names[0])]
    if positions and not isinstance(out, (tuple, list, dict)):
        return [p for p, _ in leaves_with_paths(out, "loss")]
    return [p for p, _ in leaves_with_paths(out, "out")]


def _run_compiled(closed, args: Sequence) -> list:
    """Run a ClosedJaxpr compiled by XLA. Tests replace this to simulate compiler-only NaNs."""
    return list(jax.jit(jcore.jaxpr_as_fun(closed))(*args))


def locate(fn: Callable, *args, **kwargs) -> LocateReport | None:
    """Find where the first non-finite value that reaches ``fn``'s outputs is born, and why.

    ``fn`` is any function of arrays and pytrees: a plain or jitted function, a whole train step
    (``grad``/``value_and_grad`` and an optax update inside), an ``nnx.jit`` step taking NNX
    objects (they are split into pure state and merged back; their new state counts as output).
    Non-array arguments are held static. The inputs are not modified.

    Not jit-safe: it replays ``fn`` on the host, equation by equation (``scan``/``while``/``cond``/
    ``shard_map`` run whole and are only opened when they hand a NaN/Inf towards the outputs).

    Args:
      fn: the function that produced non-finite outputs.
      *args, **kwargs: its exact inputs.

    Returns:
      None when every output is finite; else a :class:`LocateReport` whose ``origins[0]`` is the
      root cause (``.code``, ``.file``, ``.line``, ``.fix``, ``.summary()``).

    Raises:
      JaxsaneError: ``fn`` is not callable or does not trace on the given inputs.

    Example:
      >>> import jax.numpy as jnp, jaxsane
      >>> report = jaxsane.locate(lambda x: jnp.log(x) * 2, jnp.zeros(3))
      >>> report.origins[0].primitive, report.origins[0].code
      ('log', 'nonfinite.forward')
    """
    from ._errors import JaxsaneError
    if not callable(fn):
        raise JaxsaneError(f"locate needs a callable, got {type(fn).__name__}; call locate(step, *inputs).")
    pure, arrays, in_paths, out_paths_of = _prepare(fn, args, kwargs)
    try:
        closed, out_shape = jax.make_jaxpr(pure, return_shape=True)(*arrays)
    except Exception as e:  # noqa: BLE001 - the user's function does not trace on these inputs
        raise JaxsaneError(f"locate could not trace {getattr(fn, '__name__', fn)!r} on the given inputs: "
                           f"{type(e).__name__}: {e}. Pass exactly the inputs of the failing call; arguments "
                           "that are not arrays are held static.") from e
    out_paths = out_paths_of(out_shape)
    replay = _Replay()
    ins = [_Val(a, kind="input", name=p) for a, p in zip(arrays, in_paths)]
    outs, env = replay.run(closed.jaxpr, closed.consts, ins, _Ctx())
    if len(out_paths) != len(outs):  # pragma: no cover - defensive
        out_paths = [f"out[{i}]" for i in range(len(outs))]
    if not any(v.bad for v in outs):
        compiled = _run_compiled(closed, arrays)
        bad = [i for i, o in enumerate(compiled) if any(_flags(o))]
        if not bad:
            return None
        bad_outputs = [(out_paths[i], *_counts(compiled[i])) for i in bad]
        target, target_env = closed, env
        while (len(target.jaxpr.eqns) == 1 and target.jaxpr.eqns[0].primitive.name in ("pjit", "jit")
               and list(target.jaxpr.eqns[0].invars) == list(target.jaxpr.invars)):
            inner = target.jaxpr.eqns[0].params["jaxpr"]   # a jitted function: bisect its body
            target, target_env = inner, replay.envs.get(id(inner.jaxpr), (None, {}))[1]
        pre = bisect_compiled(target, arrays, env=target_env)
        return _xla_report(bad_outputs, pre, replay.count)
    analysis = _Analysis(replay, outs, out_paths)
    analysis.retrace = lambda: _trace_custom_vjps(fn, args, kwargs)
    bad_outputs = [(p, *_counts(v.value)) for v, p in zip(outs, out_paths) if v.bad]
    origins = _origins(analysis)
    if not origins and analysis.xla:
        node, _ = analysis.xla[0]
        sub, consts = _closed(node.eqn.params["jaxpr"]) if "jaxpr" in node.eqn.params else (None, None)
        pre = None
        if sub is not None and node.prim in ("pjit", "jit"):
            pre = bisect_compiled(jcore.ClosedJaxpr(sub, consts), [x.value for x in node.ins], env=node.env)
        if pre is None and node.jaxpr is not None:   # the compiled loop/branch itself is the smallest prefix
            frame = node.frame
            at = f"{os.path.basename(frame[0])}:{frame[1]}" if frame else "<unknown location>"
            pre = (node.index + 1, len(node.jaxpr.eqns), f"{node.prim} at {at}")
        return _xla_report(bad_outputs, pre, replay.count)
    return LocateReport(origins, bad_outputs, equations=replay.count)


def replay_dump(path: str, target: Any, load: Callable | None = None) -> LocateReport | None:
    """Run :func:`locate` on the inputs a guarded step dumped (``guard(..., dump_dir=...)``). Not jit-safe.

    Args:
      path: the dump directory.
      target: the step function, an :class:`~jaxsane.Experiment`, or a zero-argument callable returning
        one. For an Experiment the step runs through ``Adapted(experiment).step`` on the dumped
        ``(state, batch)``; a dump of an NNX step's ``(model, optimizer, batch)`` is merged back into
        the Experiment's NNX objects.
      load: the dump reader (default :func:`jaxsane.load_dump`).

    Returns:
      The :class:`LocateReport`, or None when the step's outputs are finite on the dumped inputs.
    """
    from ._dump import load_dump
    from ._errors import JaxsaneError
    from ._experiment import Adapted, Experiment, _positional_arity, first_batch

    load = load or load_dump
    exp = target if isinstance(target, Experiment) else None
    if exp is None and callable(target) and _positional_arity(target) == 0:
        made = target()
        exp = made if isinstance(made, Experiment) else None
        if exp is None:
            raise JaxsaneError(f"{target!r}() returned a {type(made).__name__}, not an Experiment or a step.")
    if exp is None:
        if not callable(target):
            raise JaxsaneError(f"--step must name a step function or an Experiment, got {type(target).__name__}")
        dump = load(path)
        return locate(target, *dump.args, **dump.kwargs)
    adapted = Adapted(exp)
    batch = first_batch(exp.train)
    n_args = len(load(path).args)
    if adapted.nnx:
        nnx = _nnx_module()
        objs = exp.init(jax.random.key(0))
        objs = tuple(objs) if isinstance(objs, (tuple, list)) else (objs,)
        if n_args == len(objs) + 1:
            dump = load(path, like=(*[nnx.state(o) for o in objs], batch))
            rebuilt = [nnx.merge(nnx.graphdef(o), st) for o, st in zip(objs, dump.args[:-1])]
            return locate(exp.step, *rebuilt, dump.args[-1], **dump.kwargs)
    if n_args != 2:
        raise JaxsaneError(f"the dump at {path} holds {n_args} positional arguments; an Experiment's step "
                           "replays (state, batch). Pass the step function itself with --step instead.")
    try:
        dump = load(path, like=(adapted.example_state, batch))
    except Exception:  # plain containers rebuild without a template
        dump = load(path)
    return locate(adapted.step, *dump.args, **dump.kwargs)


def _trace_custom_vjps(fn: Callable, args: tuple, kwargs: dict) -> list:
    """Trace ``fn``'s Python again (bypassing jit's trace cache) and record its custom_vjp calls."""
    from ._experiment import _unwrap
    records: list = []
    pure, arrays, _, _ = _prepare(_unwrap(fn), args, kwargs)
    with _recording_custom_vjp(records):
        jax.make_jaxpr(pure)(*arrays)
    return records


def _counts(x) -> tuple[int, int]:
    a = np.asarray(_raw(x))
    if not is_inexact(a):
        return 0, 0
    return int(np.isnan(a).sum()), int(np.isinf(a).sum())


def _xla_report(bad_outputs, pre, count) -> LocateReport:
    if pre is None:
        return LocateReport([], bad_outputs, xla_only=True, equations=count)
    k, total, at = pre
    return LocateReport([], bad_outputs, xla_only=True, prefix=k, prefix_total=total, prefix_at=at,
                        equations=count)


# ----------------------------------------------------------------------------- XLA-only bisection

def _prefix(closed, k: int):
    """The first ``k`` equations of ``closed`` as a ClosedJaxpr returning every float value they define."""
    j = closed.jaxpr
    eqns = j.eqns[:k]
    outvars = [v for e in eqns for v in e.outvars if not isinstance(v, jcore.DropVar) and is_inexact(v.aval)]
    effects = jcore.join_effects(*(e.effects for e in eqns)) if eqns else frozenset()
    pj = jcore.Jaxpr(j.constvars, j.invars, outvars, eqns, effects)
    return jcore.ClosedJaxpr(pj, closed.consts), outvars


def bisect_compiled(closed, args: Sequence, env: dict | None = None,
                    run: Callable | None = None) -> tuple[int, int, str] | None:
    """Smallest prefix of ``closed`` whose compiled run makes a value non-finite that the replay kept finite.

    Args:
      closed: the program (a ``ClosedJaxpr``).
      args: its inputs.
      env: the replay's values (``Var -> _Val``); values absent from it count as finite.
      run: ``run(closed, args) -> outputs`` compiling a program (default: ``jax.jit``); tests pass
        a simulated compiler.

    Returns:
      ``(k, total, "prim at file:line")`` for the smallest such prefix of ``k`` equations, or None
      when even the whole program, with every intermediate as an output, stays finite. Not jit-safe.
    """
    run = run or _run_compiled
    env = env or {}
    n = len(closed.jaxpr.eqns)

    def bad(k: int) -> bool:
        if k == 0:
            return False
        pj, outvars = _prefix(closed, k)
        if not outvars:
            return False
        outs = run(pj, list(args))
        for v, o in zip(outvars, outs):
            ev = env.get(v)
            if any(_flags(o)) and (ev is None or not ev.bad):
                return True
        return False

    if not bad(n):
        return None
    lo, hi = 0, n          # bad(lo) False, bad(hi) True
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if bad(mid):
            hi = mid
        else:
            lo = mid
    eqn = closed.jaxpr.eqns[hi - 1]
    frame = user_frame(eqn)
    where = f"{os.path.basename(frame[0])}:{frame[1]}" if frame else "<unknown location>"
    return hi, n, f"{eqn.primitive.name} at {where}"


# ----------------------------------------------------------------------------- origins

def _origins(analysis: _Analysis) -> list[Origin]:
    found: list[tuple[tuple, Origin]] = []
    keys: dict[tuple, int] = {}
    for node in sorted(analysis.births, key=lambda n: n.order):
        o = _origin_of(analysis, node)
        key = (o.primitive, o.file, o.line, o.code, node.eqn is not None and id(node.eqn))
        if key in keys:
            continue
        keys[key] = len(found)
        found.append((node.order, o))
    # an infinite constant (a -inf mask) that reaches the outputs as is: name where it enters
    if not found:
        for v in analysis.sources:
            if v.kind not in ("literal", "const"):
                continue
            for c in analysis.consumers.get(id(v), []):
                c = _first_real(analysis, c)
                if c is None or any(o is c for o in analysis.births):
                    continue
                analysis.births.append(c)
                o = _origin_of(analysis, c)
                key = (o.primitive, o.file, o.line, o.code, id(c.eqn))
                if key not in keys:
                    keys[key] = len(found)
                    found.append((c.order, o))
    # a non-finite input is a root cause only when nothing computed is born from it
    for v in analysis.sources:
        if v.kind == "input" and (v.nan or not found):
            o = _input_origin(analysis, v)
            found.append(((-1,), o))
    found.sort(key=lambda t: t[0])
    return [o for _, o in found]


def _first_real(analysis: _Analysis, c) -> _Node | None:
    """The first equation (not a link, not the output) reached through ``c``."""
    seen = 0
    while c is not _OUT and getattr(c, "link", False) and seen < 50:
        users = [u for o in c.outs for u in analysis.consumers.get(id(o), [])]
        c = users[0] if users else _OUT
        seen += 1
    return None if c is _OUT or getattr(c, "link", True) else c


def _input_origin(analysis: _Analysis, v: _Val) -> Origin:
    n_nan, n_inf = _counts(v.value)
    return Origin("nonfinite.input", "input", "input", None, None, "", "",
                  f"{v.name} holds {n_nan} NaN and {n_inf} Inf before any computation",
                  "the function's input is already non-finite",
                  "check the data pipeline (jaxsane.check_data) or the state passed in; repair or drop bad rows",
                  analysis.reaches(v), [])


def _origin_of(analysis: _Analysis, node: _Node) -> Origin:
    phase = node.phase
    deriv = phase == "forward" and "jvp(" in node.stack and analysis.only_backward(node)
    if deriv:
        phase = "backward"
    elif phase == "backward" and node.prim in _COEFF_PRIMS and not any(x.bad for x in node.ins):
        deriv = _primal_of(node) is not None   # e.g. a derivative recomputed by remat in the backward pass
    frame = node.frame
    if phase == "backward":
        frame = _custom_vjp_bwd_frame(node, analysis.vjp_records()) or frame
    file, line = (frame if frame else (None, None))
    reaches = analysis.reaches(node)
    if phase == "update" and reaches and all(p.startswith(("metrics", "loss")) for p in reaches):
        phase = "forward"   # computed after the gradients, but only for the reported metrics
    info: Cause = explain(analysis, node, phase=phase, derivative=deriv)
    where = list(node.ctx.tags)
    shard = _shard_index(node)
    if shard:
        where.append(shard)
    if "vmap(" in node.stack:
        rows = _batch_rows(analysis, node)
        if rows:
            where.append("batch index " + ", ".join(map(str, rows[:8])) + (" ..." if len(rows) > 8 else ""))
    code = {"forward": "nonfinite.forward", "backward": "nonfinite.backward",
            "update": "nonfinite.update"}[phase]
    return Origin(code, node.prim, phase, file, line, source_text(file, line), node.stack, info.values,
                  info.cause, info.fix, reaches, where, info.then)


_COEFF_PRIMS = ("div", "rsqrt", "pow", "integer_pow", "mul", "sqrt", "log")


def _primal_of(node: _Node):
    from ._causes import _primal
    p = _primal(node, backward=True)
    return p if p is not None and p is not node else None


def _shard_index(node: _Node) -> str:
    if node.ctx.mesh is None:
        return ""
    names, sizes = node.ctx.mesh
    for o in node.outs:
        if o.bad:
            a = np.asarray(_raw(o.value))
            lead = a.reshape(*sizes, -1)
            bad = ~np.isfinite(lead).all(axis=-1)
            coords = [tuple(int(c) for c in idx) for idx in np.argwhere(bad)]
            flat = [int(np.ravel_multi_index(c, sizes)) for c in coords]
            return "shard " + ", ".join(map(str, flat)) + f" of {int(np.prod(sizes))} (mesh axes {names})"
    return ""


def _batch_rows(analysis: _Analysis, node: _Node) -> list[int]:
    rows: set[int] = set()
    reached = set(analysis.reaches(node))
    for vid, paths in analysis.out_of.items():
        v = analysis.vals.get(vid)
        if v is None or not set(paths) & reached:
            continue
        a = np.asarray(_raw(v.value))
        if a.ndim >= 1:
            rows |= set(int(i) for i in np.flatnonzero(~np.isfinite(a.reshape(a.shape[0], -1)).all(axis=1)))
    return sorted(rows)


__all__ = ["LocateReport", "Origin", "bisect_compiled", "locate", "replay_dump", "user_frame"]
