"""The replay engine behind :func:`jaxsane.locate`: a jaxpr run equation by equation on real values.

:class:`Replay` evaluates a jaxpr on the host: the common primitives (elementwise math,
reductions, ``dot_general``, shape ops, ``select_n``) with numpy (``host_ops.py``), the rest through ``bind``.
Each equation becomes a :class:`Node` whose outputs are :class:`Val` values carrying their
NaN/Inf flags and their producer. Calls (``jit``, ``custom_jvp``/``custom_vjp``, ``remat``) are
replayed inline; ``scan``/``while``/``cond``/``shard_map`` run whole until :meth:`Replay.expand`
opens their body. :class:`Replay` is a set of hooks on jaxsane's one interpreter
(``_jaxpr/interpret.py``), whose rules it uses to open loops and branches; only the per-device
``shard_map`` expansion is its own. The names here are shared with ``locate.py`` only.
Not jit-safe: everything here runs on the host, off the hot path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jcore

from .._core.frames import in_optax, is_library_file, user_frame
from .._core.tree import can_be_nonfinite
from .._jaxpr.compile_level import quick_options
from .._jaxpr.interpret import CALLS, LOOPS, RULES, Interpreter, all_eqns, closed
from .host_ops import NP, NP_UFUNCS, np_random_bits, np_threefry_fold_in

# ----------------------------------------------------------------------------- values and nodes


def flags(x: Any) -> tuple[bool, bool]:
    """(has NaN, has Inf) of an array; (False, False) for integer/bool/key arrays."""
    if not can_be_nonfinite(x):
        return False, False
    a = np.asarray(x)
    if a.size == 0:
        return False, False
    if np.isfinite(a).all():
        return False, False
    return bool(np.isnan(a).any()), bool(np.isinf(a).any())


def is_key(x: Any) -> bool:
    """Whether ``x`` is a typed PRNG key array (``jax.random.key``, dtype ``key<fry>``): never non-finite, and
    numpy cannot hold it (its bits are ``jax.random.key_data``)."""
    dtype = getattr(raw(x), "dtype", None)
    try:
        return dtype is not None and bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
    except TypeError:  # pragma: no cover - not a dtype
        return False


def host_array(x: Any) -> np.ndarray:
    """A replayed value (a per-shard stack included) as a numpy array; a typed key array as its key bits."""
    x = raw(x)
    return np.asarray(jax.random.key_data(x)) if is_key(x) else np.asarray(x)


class Val:
    """A runtime value of the replay, with its non-finite flags and the node that produced it."""

    __slots__ = ("value", "nan", "inf", "producer", "kind", "name", "site", "entry", "__weakref__")

    def __init__(self, value, producer=None, kind=None, name=None):
        self.value = value
        self.nan, self.inf = flags(value)
        self.producer = producer
        self.kind = kind  # None (computed), "input", "literal", "const"
        self.name = name
        self.site: tuple | None = None  # a literal returned as is: (the jaxpr returning it, its Ctx)
        self.entry: Node | None = None  # a non-finite constant passed straight to a user function: that call

    @property
    def bad(self) -> bool:
        return self.nan or self.inf


@dataclasses.dataclass
class Ctx:
    """Where a jaxpr is being replayed: enclosing name stack, fallback frame, phase, shard mode, tags."""

    stack: str = ""
    frame: tuple[str, int] | None = None
    phase: str | None = None
    mesh: Any = None  # (axis_names, axis_sizes) while inside a shard_map body
    tags: tuple = ()
    order: tuple = ()
    in_optax: bool = False
    eqns: tuple = ()  # the call/loop equations around this jaxpr, outermost first


class Node:
    """One equation executed by the replay (or a link that forwards values, e.g. a scan's ys)."""

    __slots__ = (
        "eqn",
        "ins",
        "outs",
        "ctx",
        "order",
        "jaxpr",
        "index",
        "inner",
        "link",
        "env",
        "siblings",
        "last_grad",
    )

    def __init__(self, eqn, ins, ctx, order, jaxpr=None, index=-1, link=False):
        self.eqn, self.ins, self.ctx, self.order = eqn, ins, ctx, order
        self.jaxpr, self.index, self.link = jaxpr, index, link
        self.outs: list[Val] = []
        self.inner: list[list[Val]] | None = None  # expanded: outer out i <- inner values
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
        if self.eqn is not None and (self.ctx.in_optax or in_optax(self.eqn)):
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

EXPANDABLE = {"shard_map"} | set(LOOPS) | set(CALLS)  # nodes whose body expand() can open


# primitives numpy does not replay that only move, pick or add values: each runs as one program compiled at
# XLA:CPU's quick level (it runs once, on one shape), which gives the values eager dispatch gives
QUICK_BOUND = frozenset(
    {"gather", "scatter", "scatter-add", "split", "dynamic_slice", "dynamic_update_slice", "concatenate", "pad"}
)
_QUICK_PROGRAMS: dict = {}  # (primitive, params) -> its jitted bind


def _quick_bind(primitive, params: dict) -> Any:
    """A ``jax.jit`` of ``primitive.bind(*xs, **params)`` compiled at the quick level, one per primitive and
    params; None where it does not apply (not the CPU backend, unhashable params)."""
    options = quick_options()
    if options is None:
        return None
    key = (primitive, tuple(sorted(params.items())))
    try:
        program = _QUICK_PROGRAMS.get(key)
    except TypeError:  # params jax itself would not cache by (an unhashable value)
        return None
    if program is None:
        program = _QUICK_PROGRAMS[key] = jax.jit(lambda *xs: primitive.bind(*xs, **params), compiler_options=options)
    return program


def _bind(eqn, values: list, mesh=None) -> list:
    bp = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = bp if isinstance(bp, tuple) else ((), bp)
    quick = (
        _quick_bind(eqn.primitive, params)
        if mesh is None and not subfuns and eqn.primitive.name in QUICK_BOUND
        else None
    )

    def call(*xs):
        out = quick(*xs) if quick is not None else eqn.primitive.bind(*subfuns, *xs, **params)
        return list(out) if eqn.primitive.multiple_results else [out]

    if mesh is None:
        return call(*values)
    if eqn.primitive.name in _TYPE_CASTS:  # a cast of the varying-axes type only: the values are unchanged
        return list(values)
    names, sizes = mesh
    stacked = [isinstance(v, _Stacked) for v in values]
    if not any(stacked):
        try:
            return call(*values)
        except Exception:  # noqa: BLE001 - it names a mesh axis (axis_index, a collective): bind it per shard
            pass
    fn = lambda *xs: call(*xs)  # noqa: E731
    for name, size in reversed(list(zip(names, sizes))):
        fn = jax.vmap(fn, in_axes=[0 if s else None for s in stacked], axis_name=name, axis_size=size)
    out = fn(*[v.value if s else v for v, s in zip(values, stacked)])
    return [_Stacked(o) for o in out]


# shard_map's casts between varying-axes types (check_vma=True): identities on the per-shard values
_TYPE_CASTS = frozenset({"pvary", "pcast", "core_pvary"})
# moves of a value between shardings (explicit-axis meshes): the replay keeps every value on the host
_PLACEMENTS = frozenset({"reshard"})


def _evaluate(eqn, values: list, mesh=None) -> list:
    """One equation on real values: on the host with numpy when it can, else ``bind`` (jax caches it)."""
    name = eqn.primitive.name
    if name in _PLACEMENTS:  # where the value lives, not what it is (a reshard needs the mesh's context to bind)
        return list(values)
    if name == "check" and not eqn.outvars:  # a checkify check (a chex value assertion traced under chexify, kept
        return []  # in jit's trace cache): the replay finds values, it asserts nothing
    if name in _HOST_KEY_OPS and mesh is None:
        out = _HOST_KEY_OPS[name](*values, **eqn.params)
        if out is not None:
            return [out]
    fn = NP.get(name)
    if fn is None or mesh is not None or any(_is_extended(v) for v in values):
        return _bind(eqn, values, mesh)
    arrays = [np.asarray(v) for v in values]
    try:
        with np.errstate(all="ignore"):
            out = fn(*arrays) if name in NP_UFUNCS else fn(*arrays, **eqn.params)
    except Exception:  # anything numpy reads differently: let jax do it
        return _bind(eqn, values, mesh)
    outs = [np.asarray(o) for o in out] if eqn.primitive.multiple_results else [np.asarray(out)]
    if len(outs) != len(eqn.outvars) or any(o.shape != tuple(v.aval.shape) for o, v in zip(outs, eqn.outvars)):
        return _bind(eqn, values, mesh)
    with np.errstate(all="ignore"):
        return [o.astype(v.aval.dtype, copy=False) for o, v in zip(outs, eqn.outvars)]


def _threefry_key_data(keys: Any) -> np.ndarray | None:
    """The data of one threefry key (``key<fry>[]``), or None for anything else: another PRNG, a batch of keys."""
    try:
        if getattr(keys, "shape", None) != () or str(jax.random.key_impl(keys)) != "threefry2x32":
            return None
        return np.asarray(jax.random.key_data(keys), np.uint32)
    except Exception:  # not a typed key this jax knows how to read
        return None


def _host_random_bits(keys: Any, *, bit_width: int, shape: Sequence[int], **_: Any) -> np.ndarray | None:
    """``random_bits`` of one threefry key drawn on the host (no compile; the bits jax draws, bit for bit), or
    None for what jax must draw itself: another PRNG, a batch of keys, the non-partitionable threefry."""
    data = _threefry_key_data(keys)
    if data is None or getattr(jax.config, "jax_threefry_partitionable", None) is not True:  # the draws it replays
        return None
    return np_random_bits(data, bit_width=int(bit_width), shape=tuple(shape))


def _host_random_fold_in(keys: Any, msgs: Any, **_: Any) -> jax.Array | None:
    """``random_fold_in`` of one threefry key and one integer on the host (the key jax derives), or None."""
    data = _threefry_key_data(keys)
    if data is None or np.ndim(msgs) != 0 or not np.issubdtype(np.asarray(msgs).dtype, np.integer):
        return None
    new_data = jnp.asarray(np_threefry_fold_in(data, np.asarray(msgs)))
    return jax.random.wrap_key_data(new_data, impl="threefry2x32")


# key operations the replay computes on the host, for the values where they apply (else jax binds them)
_HOST_KEY_OPS: dict[str, Callable[..., Any]] = {
    "random_bits": _host_random_bits,
    "random_fold_in": _host_random_fold_in,
}
HOST_PRIMITIVES = frozenset(NP) | frozenset(_HOST_KEY_OPS)
"""The primitives :func:`evaluate_on_host` runs without a compile (most of them for most values)."""


def evaluate_on_host(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list:
    """The outputs of a flat ``jaxpr`` (no sub-jaxprs) on ``args``, each equation as the replay evaluates it:
    with numpy where it can (:data:`HOST_PRIMITIVES`), no compile; any other equation through ``bind``. Not
    jit-safe."""
    env: dict = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for eqn in jaxpr.eqns:
        env.update(zip(eqn.outvars, _evaluate(eqn, [read(v) for v in eqn.invars])))
    return [read(v) for v in jaxpr.outvars]


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


def raw(v: Any) -> Any:
    return v.value if isinstance(v, _Stacked) else v


class Replay(Interpreter):
    """Evaluates jaxprs on real values, recording every equation as a :class:`Node`.

    A set of hooks on the ``Interpreter`` of ``_jaxpr/interpret.py``: calls are replayed inline; loops and
    ``cond`` are evaluated whole (``bind``) and only opened, with the interpreter's shared rules, by
    :meth:`expand`; ``shard_map`` bodies are opened per device by :meth:`_expand_shard_map`.
    """

    def __init__(self):
        super().__init__()
        self.count = 0
        self.envs: dict[int, tuple] = {}  # id(replayed jaxpr) -> (jaxpr, its replayed values)
        self._runs: list[tuple[int, list]] = []  # per jaxpr being replayed: (last backward index, its nodes)
        self._last_env: dict = {}

    def replay(self, jaxpr, consts: Sequence, ins: Sequence[Val], ctx: Ctx) -> tuple[list[Val], dict]:
        """Replay ``jaxpr`` on ``ins``: ``(outputs, the environment var -> Val)``."""
        outs, _ = self.run(jaxpr, consts, ins, ctx)
        return outs, self._last_env

    # -- interpreter hooks
    def run(self, jaxpr, consts, args, ctx=None, tags=None):
        self._runs.append((_last_grad_index(jaxpr), []))
        try:
            outs, out_tags = super().run(jaxpr, consts, args, ctx, tags)
        finally:
            self._runs.pop()
        for v, var in zip(outs, jaxpr.outvars):
            if isinstance(v, Val) and v.kind == "literal" and v.site is None and isinstance(var, jcore.Literal):
                v.site = (jaxpr, ctx)  # a constant the jaxpr returns as is: where it is written (origins.py)
        return outs, out_tags

    def finished(self, jaxpr, env: dict) -> None:
        self._last_env = env
        self.envs[id(jaxpr)] = (jaxpr, env)

    def at(self, eqn, invals, ctx, index, jaxpr) -> Node:
        last_grad, nodes = self._runs[-1]
        node = Node(eqn, invals, ctx, ctx.order + (index,), jaxpr, index)
        node.siblings = nodes
        node.last_grad = last_grad
        nodes.append(node)
        self.count += 1
        if eqn.primitive.name in _USER_CALLS:
            consts = [v for v in invals if isinstance(v, Val) and v.kind in ("literal", "const") and v.bad]
            if any(v.entry is None for v in consts) and _calls_user_code(eqn, node.frame):
                for v in consts:  # f(jnp.inf): the constant is an argument of the user's function, written here
                    v.entry = v.entry or node
        return node

    def enters(self, eqn, node: Node) -> bool:
        return eqn.primitive.name in CALLS and node.ctx.mesh is None  # loops wait for expand()

    def bind(self, eqn, invals, node: Node) -> list:
        outs = [Val(o, producer=node) for o in _evaluate(eqn, [x.value for x in invals], node.ctx.mesh)]
        node.outs = outs
        return outs

    def literal(self, lit) -> Val:
        return Val(np.asarray(lit.val, dtype=lit.aval.dtype), kind="literal")

    def const(self, c) -> Val:
        return c if isinstance(c, Val) else Val(c, kind="const")

    def value(self, v):
        return v.value if isinstance(v, Val) else v

    def child(self, eqn, node: Node, label=None, order=()) -> Ctx:
        return self._child(node, (label,) if label else (), order)

    def index(self, x: Val, t: int, eqn, node: Node) -> Val:
        link = Node(None, [x], node.ctx, node.order + (t, -1), link=True)
        val = Val(x.value[t], producer=link)
        link.outs = [val]
        return val

    def select(self, going, new: Val, old: Val, eqn, node: Node) -> Val:
        link = Node(None, [new, old], node.ctx, node.order + (-1,), link=True)
        a, b = host_array(new.value), host_array(old.value)  # (a key carry: its bits, wrapped back below)
        picked = np.where(going.reshape(going.shape + (1,) * (a.ndim - going.ndim)), a, b)
        if is_key(new.value):
            picked = jax.random.wrap_key_data(jnp.asarray(picked), impl=jax.random.key_impl(raw(new.value)))
        val = Val(picked, link)
        link.outs = [val]
        return val

    def stack(self, parts, eqn, node, aval=None) -> list:
        return list(parts[::-1]) if eqn.params.get("reverse") else list(parts)  # in the order they ran

    @staticmethod
    def _child(node: Node, tags: tuple = (), order_extra: tuple = ()) -> Ctx:
        phase = node.phase
        ctx = node.ctx
        return Ctx(
            stack=node.stack,
            frame=node.frame,
            phase=phase if phase != "forward" else ctx.phase,
            mesh=ctx.mesh,
            tags=ctx.tags + tags,
            order=node.order + order_extra,
            in_optax=ctx.in_optax or (node.eqn is not None and in_optax(node.eqn)),
            eqns=ctx.eqns + ((node.eqn,) if node.eqn is not None else ()),
        )

    # -- lazy descent into compiled calls
    def expand(self, node: Node) -> None:
        """Replay the body of a jit/scan/while/cond/shard_map node; sets ``node.inner``."""
        name = node.prim
        if name == "shard_map":
            if node.ctx.mesh is None:
                self._expand_shard_map(node)
            return
        if name in LOOPS and node.ctx.mesh is not None:
            return
        rule = RULES.get(name)
        if rule is None:
            return
        self.path.append(node.eqn)
        try:
            result = rule(self, node.eqn, list(node.ins), [None] * len(node.ins), node)
        finally:
            self.path.pop()
        if result is None:
            return
        outs = result[0]
        if name == "scan":
            ncarry = node.eqn.params["num_carry"]
            node.inner = [[c] for c in outs[:ncarry]] + [list(ys) for ys in outs[ncarry:]]
            return
        if name in ("pjit", "jit"):
            node.env = self._last_env
        node.inner = [[o] for o in outs]

    def _expand_shard_map(self, node: Node) -> None:
        p = node.eqn.params
        mesh = p["mesh"]
        names, sizes = (
            tuple(mesh.axis_names),
            tuple(mesh.axis_sizes if hasattr(mesh, "axis_sizes") else mesh.devices.shape),
        )
        sub, consts = closed(p["jaxpr"])
        ins = []
        for x, spec in zip(node.ins, p["in_specs"]):
            link = Node(None, [x], node.ctx, node.order + (-1,), link=True)
            val = Val(_Stacked(_shards_of(x.value, spec, names, sizes)), producer=link)
            link.outs = [val]
            ins.append(val)
        ctx = self._child(node, ("shard_map",))
        ctx.mesh = (names, sizes)
        outs, _ = self.replay(sub, consts, ins, ctx)
        node.inner = [[o] for o in outs]


_USER_CALLS = frozenset({"pjit", "jit", "shard_map"})


def _calls_user_code(eqn, call_frame) -> bool:
    """Whether a call equation runs a function of the user's: its body's ``debug_info`` names a user file, or
    (``pmap``'s wrapper) its equations carry user lines other than the call's own."""
    body = eqn.params.get("jaxpr")
    info = getattr(getattr(body, "jaxpr", body), "debug_info", None)
    src = str(getattr(info, "func_src_info", "") or "")
    file = src.rpartition(" at ")[2].rpartition(":")[0]
    if file and not is_library_file(file):
        return True
    for k, e in enumerate(all_eqns(body) if body is not None else ()):
        frame = user_frame(e)
        if frame is not None and frame != call_frame:
            return True
        if k > 200:
            break
    return False


def _shards_of(x: Any, spec, names, sizes) -> Any:
    """:func:`_split_shards` of a global value; a typed key array is split by its bits and wrapped back."""
    if is_key(x):
        bits = _split_shards(np.asarray(jax.random.key_data(x)), spec, names, sizes)
        return jax.random.wrap_key_data(jnp.asarray(bits), impl=jax.random.key_impl(x))
    return _split_shards(np.asarray(x), spec, names, sizes)


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
