"""guard's traced side: the finite flags of a step's leaves, grouped into a few fused reductions
(:func:`grouped_flags`, :func:`flag_chunks`), and the selection that keeps the old state when a step
fails under ``on_nonfinite="skip"`` (:func:`select_tree`, :func:`select_state`); and the cheap test of
whether a guarded call is itself being traced (:func:`under_trace`).

Everything here is jit-safe (it runs inside guard's compiled step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.errors import GuardConfigError
from .._core.tree import can_be_nonfinite, leaves_with_paths, same_structure

_CHUNK = 64  # leaves per grouped reduction: XLA:CPU compiles many small fusions faster than a few huge ones


_trace_state_clean: Callable[[], bool] | None
try:  # cheap test for "called under jit/vmap/grad tracing" (no pytree flattening on the hot path)
    from jax._src import core as _jax_core

    _trace_state_clean = _jax_core.trace_state_clean
except (ImportError, AttributeError):  # pragma: no cover
    _trace_state_clean = None


def under_trace(tree: Any) -> bool:
    """Whether guard is called under jit/vmap/grad tracing (``tree``: the call's args, looked at only when
    jax's cheap trace-state test is missing). Jit-safe."""
    if _trace_state_clean is not None:
        return not _trace_state_clean()
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree))


def grouped_flags(tree: Any) -> jax.Array:
    """One bool per chunk of at most ``_CHUNK`` inexact leaves of one (shape, dtype): True when all are finite.

    Leaves of one shape (a kernel, its Adam ``mu`` and ``nu``) are combined elementwise before a single
    ``uint8`` min-reduction, so XLA reads each array once; chunking bounds the size of each fused
    computation, so a state of 10,000 same-shaped leaves compiles as fast as a few hundred small fusions.
    No reshapes or concatenations: sharded leaves stay sharded. Jit-safe.
    """
    leaves = jax.tree_util.tree_leaves(tree)
    flags = []
    for chunk in flag_chunks(leaves):
        finite = jnp.isfinite(leaves[chunk[0]])
        for i in chunk[1:]:
            finite = finite & jnp.isfinite(leaves[i])
        flags.append(jnp.min(finite.astype(jnp.uint8)).astype(bool) if finite.ndim else finite)
    return jnp.stack(flags) if flags else jnp.ones((0,), bool)


def flag_chunks(leaves: list) -> list[list[int]]:
    """The leaf indices behind each flag of :func:`grouped_flags`, in flag order. Jit-safe."""
    groups: dict = {}
    for i, x in enumerate(leaves):
        if can_be_nonfinite(x) and np.size(x):  # empty leaves are trivially finite; Python floats count
            groups.setdefault((np.shape(x), jnp.result_type(x)), []).append(i)
    return [idx[start : start + _CHUNK] for idx in groups.values() for start in range(0, len(idx), _CHUNK)]


def select_tree(ok: jax.Array, new: Any, old: Any) -> Any:
    """``new`` if ``ok`` else ``old``, as one ``lax.cond`` over the whole pytree: one op however many leaves
    (a per-leaf select made XLA:CPU's compile time explode with the leaf count). Under ``vmap`` with a
    batched ``ok`` JAX turns it into selects. Jit-safe."""
    new_leaves, new_def = jax.tree_util.tree_flatten(new)
    old_leaves = jax.tree_util.tree_leaves(old)
    if not new_leaves:
        return new
    for k, (n, o) in enumerate(zip(new_leaves, old_leaves)):
        if jnp.shape(n) != jnp.shape(o) or jnp.result_type(n) != jnp.result_type(o):
            path = leaves_with_paths(new, "state")[k][0]  # (names only on this error path)
            raise GuardConfigError(
                f"[jaxsane] guard(on_nonfinite='skip') keeps the old state when a step fails, so the step must "
                f"return its state with the same shapes and dtypes; {path} comes in as "
                f"{jnp.result_type(o)}{list(jnp.shape(o))} and goes out as {jnp.result_type(n)}{list(jnp.shape(n))}. "
                f"Cast it back in the step (a dtype change is usually a bug), or use on_nonfinite='raise'."
            )
    chosen = jax.lax.cond(ok, lambda n, o: list(n), lambda n, o: list(o), new_leaves, old_leaves)
    return jax.tree_util.tree_unflatten(new_def, chosen)


def select_state(ok: jax.Array, out: Any, state_in: Any) -> Any:
    """Replace the state part of a step's output by ``state_in`` when ``ok`` is False. Jit-safe."""
    if state_in is None:
        return out
    if isinstance(out, tuple) and len(out) >= 1 and same_structure(out[0], state_in):
        return (select_tree(ok, out[0], state_in), *out[1:])
    if same_structure(out, state_in):
        return select_tree(ok, out, state_in)
    raise GuardConfigError(
        "[jaxsane] guard(on_nonfinite='skip') needs a step that returns its new state (or "
        "(state, metrics)) with the same structure as its first argument; use "
        "on_nonfinite='raise' for steps that return something else."
    )


def replica_target(out: Any, new_nnx_state: Any, state_in: Any) -> Any:
    """The new state (same structure as the state passed in) whose replicas are checked. Jit-safe."""
    if new_nnx_state is not None:
        return new_nnx_state
    if isinstance(out, tuple) and len(out) >= 1 and same_structure(out[0], state_in):
        return out[0]
    return out if same_structure(out, state_in) else state_in  # a loss-only step: check the state passed in
