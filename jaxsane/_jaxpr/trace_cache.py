"""Trace a user function once per input signature, and replay its jaxpr wherever it is called again.

The doctor's checks call the user's ``loss`` and ``apply`` inside many programs (the initial loss, the
gradient check, the batch probes, the overfit sweep, the run's telemetry...): each program traces them
afresh, and tracing a Flax model costs far more than the primitives it records (module machinery, NNX graph
merges). :class:`TracedOnce` traces the function to a jaxpr the first time it sees an input signature (the
pytree structure, each leaf's abstract value, jax's trace context) and afterwards evaluates that jaxpr
with ``jax.core.eval_jaxpr``: the calling trace records the very equations direct tracing would record
(same primitives, parameters, nested ``jit`` calls and source lines), so checks that read jaxprs, and the
compiled programs, are unchanged. An eager call (no trace active) runs the function itself, op by op as
the user's code runs: replaying a jaxpr eagerly would dispatch its inlined parts one by one, whose float
results can differ in the last bit from the user's own eager call. A signature the function cannot be
traced for (a Python branch on a value, a non-array input or output) is remembered and always runs the
function itself.

Jit-safe: call it anywhere the function could be called.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax._src import core as jcore  # trace_state_clean: whether a trace is active (as _compile_level)

from .._core.user_code import USER_CODE

try:  # the configuration that shapes a trace (x64, promotion rules, matmul precision...), as jit keys its cache
    from jax._src.config import trace_context as _trace_context
except ImportError:  # pragma: no cover - a jax without it: key by the public x64 flag alone

    def _trace_context() -> tuple:
        return (jax.config.jax_enable_x64,)  # type: ignore[attr-defined]  # a flag jax sets at run time; not in its stubs


_UNTRACEABLE = object()


def _signature(flat: list) -> tuple | None:
    """The abstract values of the flat inputs, or None when one is not an array-like value."""
    avals = []
    for leaf in flat:
        try:
            avals.append(jax.typeof(leaf))
        except TypeError:
            return None
    return tuple(avals)


class TracedOnce:
    """``fn`` evaluated from one cached jaxpr per input signature (see the module docstring). Jit-safe."""

    def __init__(self, fn: Callable):
        functools.update_wrapper(self, fn)  # jit names its program after fn; signatures read through
        self.fn = fn
        self._jaxprs: dict[tuple, Any] = {}
        self._lock = USER_CODE  # doctor's background threads trace the same functions: one trace of user code at once

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if jcore.trace_state_clean():  # an eager call runs the function itself: op by op, exactly as the user's
            with self._lock:
                return self.fn(*args, **kwargs)
        flat, tree = jax.tree_util.tree_flatten((args, kwargs))
        avals = _signature(flat)
        if avals is None:
            with self._lock:
                return self.fn(*args, **kwargs)
        key = (tree, avals, _trace_context())
        entry = self._jaxprs.get(key)
        if entry is None:
            entry = self._trace(key, args, kwargs)
        if entry is _UNTRACEABLE:
            with self._lock:
                return self.fn(*args, **kwargs)
        closed, out_tree = entry
        outs = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *flat)
        return jax.tree_util.tree_unflatten(out_tree, outs)

    def _trace(self, key: tuple, args: tuple, kwargs: dict) -> Any:
        with self._lock:
            if key in self._jaxprs:
                return self._jaxprs[key]
            entry: object
            try:
                closed, out_shape = jax.make_jaxpr(self.fn, return_shape=True)(*args, **kwargs)
                entry = (closed, jax.tree_util.tree_structure(out_shape))
            except Exception:  # the function itself raises the same error where it matters, or runs eagerly
                entry = _UNTRACEABLE
            self._jaxprs[key] = entry
            return entry
