"""The step check's record of the state after each call: what ``check_step`` compares between calls.

The comparisons need only whether a leaf changed, bit for bit, and the state rebuilt for a trace (shapes and
dtypes) and for the random-draw replay (the keys and counters it reads). So a small leaf is copied to the host,
and a large one on an accelerator is kept as a :class:`Fingerprint`: two 32-bit sums of its bits computed on the
device, of which only 8 bytes come back. A 50M-parameter model's state (its parameters and Adam's two moments,
640 MB) copied from a GPU once per call is 2.6 GB of host memory that the user's own run never holds. On the CPU
numpy reads the array's own buffer, so everything is kept as it is.

A single changed element always changes the first sum (each element's bits are multiplied by a distinct odd
number, invertible modulo 2^32); several changes that cancel in it must also cancel in the second, which mixes
each element's bits nonlinearly before weighting them. Nothing here is jit-safe; the fingerprint's program is.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._core.tree import PyTree, is_key, leaves_with_paths
from .._jaxpr.compile_level import quick_jit

FINGERPRINT_BYTES = 1 << 20
"""A state leaf of at least this many bytes, on an accelerator, is kept as a :class:`Fingerprint` rather than
copied to the host."""

HOST_PLATFORMS = ("cpu",)
"""Platforms whose arrays are copied whatever their size: their buffers are host memory already, and numpy reads
them in place (measured on the 10M-parameter LM: ``check_step``'s peak memory 1.05x a plain run of the step)."""


class Fingerprint(NamedTuple):
    """A large array leaf as the step check keeps it: its shape, dtype, sharding and two 32-bit sums of its bits."""

    shape: tuple[int, ...]
    dtype: Any
    sharding: Any
    sums: tuple[int, int]

    def same(self, other: Any) -> bool:
        return isinstance(other, Fingerprint) and (self.shape, self.dtype, self.sums) == (
            other.shape,
            other.dtype,
            other.sums,
        )


def _has_words(dtype: Any) -> bool:
    """Whether :func:`_as_words` reads this dtype's bits: bool, and real numbers of 8, 16, 32 or 64 bits (a complex
    or a sub-byte type, int4, is copied instead)."""
    if dtype == jnp.bool_:
        return True
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.finfo(dtype).bits == 8 * dtype.itemsize
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.iinfo(dtype).bits == 8 * dtype.itemsize
    return False


def _fingerprinted(leaf: Any) -> bool:
    if not isinstance(leaf, jax.Array) or is_key(leaf) or not _has_words(leaf.dtype):
        return False
    if math.prod(leaf.shape) * leaf.dtype.itemsize < FINGERPRINT_BYTES:
        return False
    return not all(getattr(d, "platform", None) in HOST_PLATFORMS for d in leaf.sharding.device_set)


def _as_words(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as a flat uint32 vector (16-bit and 8-bit types widened, 64-bit types split in two)."""
    if x.dtype == jnp.bool_:
        return jnp.ravel(x).astype(jnp.uint32)
    width = x.dtype.itemsize
    if width == 8:
        return jnp.ravel(jax.lax.bitcast_convert_type(x, jnp.uint32))
    unsigned = {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[width]
    return jnp.ravel(jax.lax.bitcast_convert_type(x, unsigned)).astype(jnp.uint32)


def _sums(leaves: list[jax.Array]) -> jax.Array:
    """``[n, 2]`` uint32: per leaf, sum(w_i * (2i + 1)) and sum(mix(w_i) * (i * 0x9E3779B9 | 1)), mod 2^32."""
    rows = []
    for x in leaves:
        w = _as_words(x)
        i = jnp.arange(w.shape[0], dtype=jnp.uint32)
        mixed = (w ^ (w >> 15)) * jnp.uint32(0x2C1B3C6D)
        mixed = mixed ^ (mixed >> 12) ^ (w << 7)
        first = jnp.sum(w * (2 * i + 1), dtype=jnp.uint32)
        second = jnp.sum(mixed * ((i * jnp.uint32(0x9E3779B9)) | 1), dtype=jnp.uint32)
        rows.append(jnp.stack([first, second]))
    return jnp.stack(rows)


_SUMS = quick_jit(_sums, runs=4)


def _host(x: Any) -> Any:
    if is_key(x):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x) if hasattr(x, "shape") else x


def snapshot(state: PyTree) -> list[tuple[str, Any]]:
    """``(path, value)`` per leaf of ``state``, taken before the next call: a host copy (keys as their raw data),
    or a :class:`Fingerprint` for an array of at least :data:`FINGERPRINT_BYTES`."""
    leaves = leaves_with_paths(state, "state")
    big = [i for i, (_, leaf) in enumerate(leaves) if _fingerprinted(leaf)]
    sums = np.asarray(_SUMS([leaves[i][1] for i in big])) if big else np.zeros((0, 2), np.uint32)
    fingerprints = {
        i: Fingerprint(tuple(leaves[i][1].shape), leaves[i][1].dtype, leaves[i][1].sharding, (int(a), int(b)))
        for i, (a, b) in zip(big, sums)
    }
    return [(path, fingerprints[i] if i in fingerprints else _host(leaf)) for i, (path, leaf) in enumerate(leaves)]


def bitwise_equal(a: Any, b: Any) -> bool:
    """Whether two snapshot values (host copies or fingerprints) are bitwise the same."""
    if isinstance(a, Fingerprint) or isinstance(b, Fingerprint):
        return isinstance(a, Fingerprint) and a.same(b)
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def state_from_snapshot(like: PyTree, snapshot_: list) -> PyTree:
    """``like``'s structure with the snapshot's values: host copies put back on the leaf's own sharding (a
    donated array keeps its sharding metadata, so sharded steps trace alike), keys rewrapped, fingerprinted
    leaves as ``jax.ShapeDtypeStruct`` (enough to trace the step; a program that reads their values fails)."""
    leaves, treedef = jax.tree_util.tree_flatten(like)
    rebuilt: list[Any] = []
    for leaf, (_, value) in zip(leaves, snapshot_):
        if isinstance(value, Fingerprint):
            rebuilt.append(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=value.sharding))
        elif is_key(leaf):
            rebuilt.append(jax.random.wrap_key_data(jax.device_put(value), impl=jax.random.key_impl(leaf)))
        else:  # Python scalars too, so that consecutive states have one signature (no recompile)
            sharding = leaf.sharding if isinstance(leaf, jax.Array) else None
            rebuilt.append(_put(np.asarray(value, getattr(leaf, "dtype", None)), leaf, sharding))
    return jax.tree_util.tree_unflatten(treedef, rebuilt)


def _put(value: np.ndarray, leaf: Any, sharding: Any) -> jax.Array:
    """``value`` on ``sharding``, weakly typed where ``leaf`` is (a TrainState's step counter made from a Python
    ``0``): the rebuilt state then has the original's signature, so the step is not traced again for it (0.7 s
    of an MLP-Mixer's step check)."""
    if value.shape == () and isinstance(leaf, jax.Array) and jax.typeof(leaf).weak_type:
        weak = jax.device_put(value.item(), sharding)
        if weak.dtype == value.dtype:
            return weak
    return jax.device_put(value, sharding)
