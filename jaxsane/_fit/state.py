"""fit's host copies of the train state: the rollback snapshot, the best evaluation's state, dtype drift.

Host-side only (not jit-safe): these run between compiled steps of :func:`jaxsane.fit`.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np

from .._core.errors import JaxsaneWarning
from .._core.frames import user_stacklevel
from .._core.tree import PyTree, is_key, leaves_with_paths
from .._experiment.contract import PureExperiment
from . import checkpoint as _ckpt

# ----------------------------------------------------------------------------- checkpoints


def keep_copy(state: PyTree) -> PyTree:
    """A copy of ``state`` that outlives donation: host numpy where the array is fully addressable,
    a device copy otherwise (typed PRNG keys, multi-host shards). Not jit-safe."""

    def copy(x):
        if not isinstance(x, jax.Array):
            return x
        if is_key(x) or not x.is_fully_addressable:
            return x.copy()
        return np.asarray(x)

    return jax.tree_util.tree_map(copy, state)


def best_state(
    kept: tuple | None, best_step: int, *, ckpt_dir: str | None, keep: int, like: PyTree, init: Any
) -> PyTree:
    """The state of the best evaluation, placed like ``like``: the kept copy, else (after a resume) ``init()``
    for step 0 or its checkpoint, else ``like`` itself with a warning. Not jit-safe."""
    if kept is None and best_step == 0:
        return init()
    if kept is not None and kept[0] == best_step:
        return jax.tree_util.tree_map(
            lambda h, x: jax.device_put(h, x.sharding) if isinstance(x, jax.Array) and isinstance(h, np.ndarray) else h,
            kept[1],
            like,
        )
    if ckpt_dir is not None:
        ckpt = _ckpt.Checkpoints(ckpt_dir, keep, like)
        try:
            if best_step in ckpt.steps():
                out = ckpt.verify(best_step)
                if not isinstance(out, str):
                    return out[0]
        finally:
            ckpt.close()
    warnings.warn(
        f"[jaxsane] restore_best: the state of the best evaluation (step {best_step}) is neither in "
        "memory nor among the kept checkpoints; returning the last state. Raise keep=... so the "
        "best checkpoint survives a resume.",
        JaxsaneWarning,
        stacklevel=user_stacklevel(),
    )
    return like


# ----------------------------------------------------------------------------- rollback


class Snapshot:
    """A host copy of a state known to be finite, and how to put it back on its devices. Not jit-safe."""

    def __init__(self, position: int, state: PyTree):
        self.position = position
        leaves, self.treedef = jax.tree_util.tree_flatten(keep_copy(state))
        self.leaves = leaves
        self.shardings = [x.sharding if isinstance(x, jax.Array) else None for x in jax.tree_util.tree_leaves(state)]

    def restore(self) -> PyTree:
        """A fresh device copy each time (the step may donate what it is given)."""

        def put(x, sharding):
            if isinstance(x, np.ndarray) and sharding is not None:
                return jax.device_put(x, sharding)
            return x.copy() if isinstance(x, jax.Array) else x

        return jax.tree_util.tree_unflatten(self.treedef, [put(x, s) for x, s in zip(self.leaves, self.shardings)])


def dtype_changes(adapted: PureExperiment, before: PyTree, after: PyTree) -> list[str]:
    """``"path: float32 -> float16"`` for each parameter whose dtype the step changed. Not jit-safe."""
    try:
        old = leaves_with_paths(adapted.params(before), "params")
        new = leaves_with_paths(adapted.params(after), "params")
    except Exception:
        return []
    if len(old) != len(new):
        return []
    return [
        f"{p}: {getattr(a, 'dtype', None)} -> {getattr(b, 'dtype', None)}"
        for (p, a), (_, b) in zip(old, new)
        if getattr(a, "dtype", None) is not None and getattr(a, "dtype", None) != getattr(b, "dtype", None)
    ]
