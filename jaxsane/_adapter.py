"""The adapter layer's base: the one NNX purifier, and what a step's signature says.

Flax NNX objects (a Module, an Optimizer) are mutable Python graphs; every jaxsane tool runs them as a
pure function of their state instead (``nnx.split`` -> pure call -> ``nnx.merge``, NNX's own advice).
:func:`split_objects` takes the objects out of a call's arguments and :func:`call_split` is the one
purifier: it rebuilds them, calls the function and returns the objects' new state. ``guard``,
``locate`` and :class:`jaxsane.PureExperiment` (which the sweep, the monitor and fit run) all use it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, NamedTuple

from ._tree import PyTree


def nnx_module():
    """``flax.nnx`` (raises ImportError when Flax is not installed). Not jit-relevant."""
    from flax import nnx
    return nnx


@functools.cache
def _nnx_object_type() -> type:
    try:
        return nnx_module().Pytree
    except ImportError:  # pragma: no cover
        return type(None)


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


def call_split(fn: Callable, layout: Layout | None, state: PyTree, args: tuple | list,
               kwargs: dict | None = None) -> tuple[Any, PyTree]:
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


# ----------------------------------------------------------------------------- signatures

def unwrap(fn: Callable) -> Callable:
    """The innermost Python function under ``jax.jit``/``nnx.jit``/``functools.wraps`` wrappers."""
    for attr in ("fun", "_fun", "__wrapped__"):
        inner = getattr(fn, attr, None)
        if callable(inner):
            return unwrap(inner)
    return fn


def positional_names(fn: Callable) -> list[str]:
    """The names of ``fn``'s positional parameters (empty when its signature cannot be read)."""
    try:
        params = list(inspect.signature(unwrap(fn)).parameters.values())
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def positional_arity(fn: Callable) -> int | None:
    """How many positional arguments ``fn`` takes; None for ``*args`` or an unreadable signature."""
    try:
        sig = inspect.signature(unwrap(fn))
    except (TypeError, ValueError):
        return None
    n = 0
    for p in sig.parameters.values():
        if p.kind == p.VAR_POSITIONAL:
            return None
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            n += 1
    return n
