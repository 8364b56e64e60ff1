"""Dropping where a jitted function places its values, so that a program built around it runs on one device.

A data-parallel step is jitted with ``in_shardings``/``out_shardings`` over a mesh (its state replicated, its
batch sharded on the batch axis). A program that traces that step inside (doctor's overfit sweep: many copies of
the step on one small batch) inherits the mesh, and every device then runs the whole program on its replica: on
8 host devices sharing 2 cores, eight times the sweep's work. Those shardings say where values live, not what
they are (GSPMD partitions a program without changing its results), so when placement is all the step holds (no
sharding constraint, ``shard_map``, collective, explicit device placement or mesh context inside, no constant
spread over devices) its jaxpr with the shardings of its outer ``jax.jit`` calls dropped computes the same values,
up to the order of float sums, on whichever single device its inputs are on. Host-side; the functions returned are
jit-safe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jcore

from .interpret import all_eqns

_JIT = ("jit", "pjit")  # the primitive's name (jax >= 0.7: "jit")


def _places(value: Any) -> bool:
    """Whether one equation parameter's value names devices: a sharding, a device, or a mesh that is not empty."""
    for item in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(item, (jax.sharding.Sharding, jax.Device)):
            return True
        if isinstance(item, (jax.sharding.Mesh, jax.sharding.AbstractMesh)) and not item.empty:
            return True
    return False


def _eqn_places(eqn: Any, outer_jit: bool) -> bool:
    """Whether an equation places values or communicates between devices (``outer_jit``: a jit call of the
    function's own, whose ``in_shardings``/``out_shardings`` are dropped, not counted)."""
    params = eqn.params
    if "axis_name" in params or any(isinstance(a, str) for a in params.get("axes", ()) or ()):
        return True  # a collective over a named axis (psum, all_gather, ppermute, axis_index...)
    dropped = ("in_shardings", "out_shardings") if outer_jit else ()
    return any(_places(v) for k, v in params.items() if k not in dropped)


def places_values(closed: Any) -> bool:
    """Whether a jaxpr (nested ones included) places any value on devices or communicates between them, or
    closes over an array that lives on several devices. Not jit-safe."""
    if _spread_constants(closed):
        return True
    return any(_eqn_places(eqn, False) for eqn in all_eqns(closed))


def _spread_constants(closed: Any) -> bool:
    return any(isinstance(c, jax.Array) and len(c.sharding.device_set) > 1 for c in getattr(closed, "consts", ()))


def without_placement(closed: Any) -> Any | None:
    """``closed`` (a ClosedJaxpr) with its top-level ``jax.jit`` calls' ``in_shardings``/``out_shardings`` (and
    layouts) dropped, when those are the only placement it holds; else None. Not jit-safe."""
    from jax._src.sharding_impls import UNSPECIFIED  # private: the "no sharding" marker jit's equations hold

    if _spread_constants(closed):
        return None
    eqns = []
    for eqn in closed.jaxpr.eqns:
        outer = eqn.primitive.name in _JIT
        if _eqn_places(eqn, outer) or any(places_values(j) for j in _jaxprs_in(eqn)):
            return None
        if outer:
            n_in, n_out = len(eqn.params["in_shardings"]), len(eqn.params["out_shardings"])
            params = dict(eqn.params, in_shardings=(UNSPECIFIED,) * n_in, out_shardings=(UNSPECIFIED,) * n_out)
            if "in_layouts" in params:
                params.update(in_layouts=(None,) * n_in, out_layouts=(None,) * n_out)
            eqn = eqn.replace(params=params)
        eqns.append(eqn)
    return closed.replace(jaxpr=closed.jaxpr.replace(eqns=eqns))


def _jaxprs_in(eqn: Any) -> list:
    """The jaxprs an equation's parameters hold (a call's body, a loop's, a branch)."""
    return [
        item
        for value in eqn.params.values()
        for item in (value if isinstance(value, (tuple, list)) else (value,))
        if isinstance(item, (jcore.Jaxpr, jcore.ClosedJaxpr))
    ]


def unplaced(fn: Callable, *args: Any) -> Callable | None:
    """``fn`` traced at ``args``' abstract values with its jit calls' placement dropped (:func:`without_placement`):
    a function of arguments of the same structure and abstract values that computes ``fn``'s outputs wherever its
    inputs are; None when ``fn`` places values itself, or cannot be traced. Not jit-safe to build; the function
    returned is jit-safe (it replays the jaxpr)."""
    try:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    except Exception:  # noqa: BLE001 - a function that cannot be traced here keeps its own placement
        return None
    stripped = without_placement(closed)
    if stripped is None:
        return None
    out_tree = jax.tree_util.tree_structure(out_shape)

    def call(*given: Any) -> Any:
        flat = jax.tree_util.tree_leaves(given)  # (of the structure traced: the sweep builds them from it)
        return jax.tree_util.tree_unflatten(out_tree, jax.core.eval_jaxpr(stripped.jaxpr, stripped.consts, *flat))

    return call
