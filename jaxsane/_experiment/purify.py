"""The adapter layer's base: the one NNX purifier, and what a step's signature says.

Flax NNX objects (a Module, an Optimizer) are mutable Python graphs; every jaxsane tool runs them as a
pure function of their state instead (``nnx.split`` -> pure call -> ``nnx.merge``, NNX's own advice).
:func:`split_objects` takes the objects out of a call's arguments and :func:`call_split` is the one
purifier: it rebuilds them, calls the function and returns the objects' new state. ``guard``,
``locate`` and :class:`jaxsane.PureExperiment` (which the sweep, the monitor and fit run) all use it.

Equinox models (``eqx.Module``) are pytrees whose leaves are not all arrays: an ``eqx.nn.MLP`` holds its
activation functions. :func:`partition` is the one purifier of such trees (``eqx.partition(tree,
eqx.is_array)`` without importing equinox): the array part keeps the tree's structure, so its paths read
``model.layers[0].weight``, and the rest is a hashable :class:`Static` that :func:`combine` puts back.
:func:`needs_partition` says when a tree needs it; guard, locate and ``PureExperiment`` all use these.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from .._core.errors import JaxsaneError
from .._core.tree import PyTree, is_array


def nnx_module():
    """``flax.nnx`` (raises ImportError when Flax is not installed). Not jit-relevant."""
    from flax import nnx

    return nnx


class _NoNnx:
    """Stands for ``nnx.Pytree`` while Flax NNX is not imported: nothing is an instance of it."""


def _nnx_object_type() -> type:
    # an object can only be an NNX object once flax.nnx is imported: a program without Flax never pays its import
    nnx = sys.modules.get("flax.nnx")
    return getattr(nnx, "Pytree", _NoNnx) if nnx is not None else _NoNnx


def is_nnx_object(x: Any) -> bool:
    """True for a Flax NNX graph object (a Module, an Optimizer, any ``nnx.Pytree``). Jit-safe."""
    return isinstance(x, _nnx_object_type())


def is_nnx_state(state: Any) -> bool:
    """True when ``state`` holds Flax NNX graph objects (one object, or a tuple/list of them). Jit-safe."""
    items = state if isinstance(state, (tuple, list)) else (state,)
    kind = _nnx_object_type()
    return any(isinstance(x, kind) for x in items)


def nnx_positions(args: tuple) -> tuple[int, ...]:
    """The positions of the NNX objects among a call's positional arguments. Jit-safe."""
    kind = _nnx_object_type()
    return tuple([i for i, a in enumerate(args) if isinstance(a, kind)])


class Layout(NamedTuple):
    """Where a call's NNX objects go: their ``graphdef`` and their argument ``positions``.

    With ``packed`` the merged value (one object, or the tuple of them) is a single argument at
    ``positions[0]``; otherwise the k-th merged object goes to ``positions[k]``. Hashable, so it can be a
    static argument of ``jax.jit``.
    """

    graphdef: Any
    positions: tuple[int, ...]
    packed: bool = False


def split_objects(args: tuple, positions: tuple[int, ...]) -> tuple[Layout | None, PyTree]:
    """``(layout, state)`` of the NNX objects at ``positions`` of ``args`` (``(None, None)`` when there are
    none). The state refers to the live variables: copy its leaves before the objects are updated.
    Jit-safe."""
    if not positions:
        return None, None
    graphdef, state = nnx_module().split(tuple(args[i] for i in positions))
    return Layout(graphdef, tuple(positions)), state


def split_whole(objs: Any, positions: tuple[int, ...] = (0,), packed: bool = True) -> tuple[Layout, PyTree]:
    """``(layout, state)`` of a whole object (or tuple/list of objects), passed as one argument at
    ``positions[0]`` (``packed``) or spread over ``positions``. Jit-safe."""
    graphdef, state = nnx_module().split(objs)
    return Layout(graphdef, tuple(positions), packed), state


def merge(layout: Layout, state: PyTree) -> Any:
    """The objects of ``layout`` rebuilt from ``state`` (``nnx.merge``): fresh objects. Jit-safe."""
    return nnx_module().merge(layout.graphdef, state)


def call_split(
    fn: Callable, layout: Layout | None, state: PyTree, args: tuple | list, kwargs: dict | None = None
) -> tuple[Any, PyTree]:
    """Call ``fn(*args, **kwargs)`` with the NNX objects of ``layout`` rebuilt from ``state`` in their
    places, and return ``(fn's output, the objects' state after the call)``: a pure function of
    ``state`` and ``args``. Without a layout it is ``(fn(*args, **kwargs), None)``. Jit-safe.
    """
    kwargs = kwargs or {}
    if layout is None:
        return fn(*args, **kwargs), None
    nnx = nnx_module()
    objs = nnx.merge(layout.graphdef, state)
    args = list(args)
    if layout.packed:
        args[layout.positions[0]] = objs
    else:
        for p, obj in zip(layout.positions, objs):
            args[p] = obj
    out = fn(*args, **kwargs)
    return out, nnx.state(objs)


# ----------------------------------------------------------------------------- Equinox: arrays and the rest


class _ArraySlot:
    """Marks where :class:`Static` expects an array leaf."""

    def __repr__(self) -> str:
        return "<array>"


_ARRAY = _ArraySlot()


class _Hashed:
    """A leaf as part of a hash key: by value when hashable, else by identity."""

    __slots__ = ("value", "key")

    def __init__(self, value: Any):
        self.value = value
        try:
            hash(value)
            self.key = (0, value)
        except TypeError:
            self.key = (1, id(value))

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, _Hashed) or self.key[0] != other.key[0]:
            return False
        if self.key[0]:
            return self.key[1] == other.key[1]
        try:
            return bool(self.value is other.value or self.value == other.value)
        except Exception:  # an odd __eq__ (an array-like): then only identity counts
            return False

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:  # shown in treedefs (a recompile's "structure ... -> ..." names the value)
        return repr(self.value)


class Static:
    """The non-array part of a pytree (an Equinox model's activation functions, Python flags, strings): the
    tree's structure and its non-array leaves. Hashable, so it can be a static argument of ``jax.jit``, and a
    pytree node without children, so a jitted function can return it (it rides in the output's treedef,
    as in ``eqx.filter_jit``). Build it with :func:`partition`; put the arrays back with :func:`combine`."""

    __slots__ = ("treedef", "leaves", "_key")

    def __init__(self, treedef: Any, leaves: tuple):
        self.treedef = treedef
        self.leaves = leaves
        self._key = (treedef, tuple(_Hashed(x) for x in leaves))

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Static) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return f"Static({sum(x is _ARRAY for x in self.leaves)} arrays, {self.treedef})"


jax.tree_util.register_pytree_node(Static, lambda s: ((), s), lambda s, _: s)


def _eqx_module_type() -> type | None:
    eqx = sys.modules.get("equinox")  # a tree cannot hold an eqx.Module unless equinox was imported
    return getattr(eqx, "Module", None)


def needs_partition(tree: PyTree) -> bool:
    """True when ``tree`` has leaves no jitted function can take and :func:`partition` should split them off:
    a callable leaf (an activation function), or any non-array leaf inside an Equinox module (whose
    ``eqx.filter_jit`` treats Python scalars, strings and functions as static). Other trees are left as
    they are (Python scalars in a plain state stay traced values). Jit-safe; never imports equinox."""
    leaves = jax.tree_util.tree_leaves(tree)
    odd = [x for x in leaves if not is_array(x)]
    if not odd:
        return False
    if any(callable(x) for x in odd):
        return True
    module = _eqx_module_type()
    if module is None:
        return False
    nodes = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, module))
    return any(isinstance(x, module) and not all(is_array(y) for y in jax.tree_util.tree_leaves(x)) for x in nodes)


def partition(tree: PyTree) -> tuple[PyTree, Static]:
    """``(arrays, static)``: ``tree`` with every non-array leaf replaced by None (the same nodes, so the
    same paths: ``model.layers[0].weight``), and the rest. ``eqx.partition(tree, eqx.is_array)`` without
    equinox. Jit-safe (tracers are arrays)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = jax.tree_util.tree_unflatten(treedef, [x if is_array(x) else None for x in leaves])
    return arrays, Static(treedef, tuple(_ARRAY if is_array(x) else x for x in leaves))


def arrays_of(tree: PyTree) -> PyTree:
    """The array part of ``tree`` (:func:`partition`'s first half) when it needs one, else ``tree``. Jit-safe."""
    return partition(tree)[0] if needs_partition(tree) else tree


def combine(arrays: PyTree, static: Static) -> PyTree:
    """The tree :func:`partition` split: ``static``'s leaves with ``arrays``' leaves in the array places.
    Jit-safe.

    Raises:
      JaxsaneError: ``arrays`` has another number of leaves than ``static`` has array places.
    """
    values = jax.tree_util.tree_leaves(arrays)
    slots = sum(x is _ARRAY for x in static.leaves)
    if len(values) != slots:
        raise JaxsaneError(
            f"[jaxsane] cannot put {len(values)} arrays back into a tree with {slots} array leaves "
            f"({static.treedef}). Likely cause: the array part of another tree was passed. Fix: "
            "pass the arrays split from this tree (same structure, None where the rest was)."
        )
    it = iter(values)
    return jax.tree_util.tree_unflatten(static.treedef, [next(it) if x is _ARRAY else x for x in static.leaves])


class Kept:
    """A non-array leaf of an Equinox state (a Python int, a flag, an activation function) kept IN the array
    tree: a pytree node without children whose value rides in the treedef, as ``eqx.filter_jit`` carries it.
    A step that changes the value (a Python-int counter) returns a tree with another treedef, so the value
    flows from step to step as in the user's own loop (and recompiles the user's ``filter_jit`` as it does
    there). Build trees of them with :func:`keep_static`; :func:`restore_static` puts the values back."""

    __slots__ = ("value", "_hashed")

    def __init__(self, value: Any):
        self.value = value
        self._hashed = _Hashed(value)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Kept) and self._hashed == other._hashed

    def __hash__(self) -> int:
        return hash(self._hashed)

    def __repr__(self) -> str:
        return f"Kept({self.value!r})"


jax.tree_util.register_pytree_node(Kept, lambda k: ((), k._hashed), lambda h, _: Kept(h.value))


def _is_kept(x: Any) -> bool:
    return isinstance(x, Kept)


def keep_static(tree: PyTree) -> PyTree:
    """``tree`` with every non-array leaf replaced by a :class:`Kept` node holding it: the leaves are the
    arrays (the same paths as :func:`partition`'s array part), the rest rides in the treedef. Jit-safe."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return jax.tree_util.tree_unflatten(treedef, [x if is_array(x) else Kept(x) for x in leaves])


def restore_static(tree: PyTree) -> PyTree:
    """The user's tree from :func:`keep_static`'s: every :class:`Kept` node replaced by its value. Jit-safe."""
    return jax.tree_util.tree_map(lambda x: x.value if _is_kept(x) else x, tree, is_leaf=_is_kept)


def has_kept(tree: PyTree) -> bool:
    """Whether ``tree`` holds :class:`Kept` nodes (a state made by :func:`keep_static`). Jit-safe."""
    return any(_is_kept(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_kept))


def kept_erased(tree: PyTree) -> PyTree:
    """``tree`` with its :class:`Kept` nodes as None: compare the structure of two states whose non-array
    values differ (a step that changes a Python-int field). Jit-safe."""
    return jax.tree_util.tree_map(lambda x: None if _is_kept(x) else x, tree, is_leaf=_is_kept)


def uncounted(fn: Callable) -> Callable:
    """``fn`` without an ``eqx.debug.assert_max_traces`` layer: the function under the outermost one (the
    ``eqx.filter_jit`` above it is dropped too; jaxsane runs the step under its own ``jax.jit``), else
    ``fn`` itself. jaxsane's tools trace the user's step in contexts of their own (a smaller batch, a vmapped
    sweep, a replay); those traces must not spend the user's trace budget, whose purpose (no recompiles in
    the training loop) the step stage checks itself. Never imports equinox. Not jit-relevant."""
    f: Any = fn
    for _ in range(32):  # a wrapper chain, never a cycle
        kind = type(f)
        if kind.__name__ == "_AssertMaxTraces" and kind.__module__.startswith("equinox"):
            return f.__wrapped__
        f = getattr(f, "__wrapped__", None)
        if f is None:
            break
    return fn


# ----------------------------------------------------------------------------- signatures


def unwrap(fn: Callable) -> Callable:
    """The innermost Python function under ``jax.jit``/``nnx.jit``/``functools.wraps`` wrappers."""
    for attr in ("fun", "_fun", "__wrapped__"):
        inner = getattr(fn, attr, None)
        if callable(inner):
            return unwrap(inner)
    return fn


def call_parameters(fn: Callable) -> list[inspect.Parameter] | None:
    """The parameters a call of ``fn`` binds to: its own signature when it declares one (``jax.jit`` shows the
    jitted function's; a decorator with explicit parameters may inject more into the function it wraps), else,
    for a generic wrapper (``*args``, or no readable signature: ``nnx.jit``, ``eqx.filter_jit``, ``jax.pmap``),
    the wrapped function's (:func:`unwrap`); None when neither can be read."""
    try:
        own = list(inspect.signature(fn, follow_wrapped=False).parameters.values())
        if not any(p.kind == p.VAR_POSITIONAL for p in own):
            return own
    except (TypeError, ValueError):
        pass
    try:
        return list(inspect.signature(unwrap(fn)).parameters.values())
    except (TypeError, ValueError):
        return None


def positional_names(fn: Callable) -> list[str]:
    """The names of ``fn``'s positional parameters (empty when its signature cannot be read)."""
    params = call_parameters(fn) or []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def positional_arity(fn: Callable, required: bool = False) -> int | None:
    """How many positional arguments ``fn`` takes (``required``: only those without a default); None for
    ``*args`` or an unreadable signature."""
    params = call_parameters(fn)
    if params is None:
        return None
    n = 0
    for p in params:
        if p.kind == p.VAR_POSITIONAL:
            return None
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and not (required and p.default is not p.empty):
            n += 1
    return n
