"""Row content hashes: one 64-bit hash per example, from its raw bytes.

Vectorized over 8-byte words: each word is mixed with a position key (xor, two odd multiplies and
two xor-shifts, as in splitmix64), the mixed words of a row are summed modulo 2**64, and the sum is
finalised with splitmix64. Used by :func:`jaxsane.check_data` for duplicates and leakage.

Nothing here runs inside ``jit``.
"""

from __future__ import annotations

import numpy as np

U64 = np.uint64
_C1, _C2 = U64(0xBF58476D1CE4E5B9), U64(0x94D049BB133111EB)  # splitmix64 multipliers
_GOLDEN = U64(0x9E3779B97F4A7C15)
_HASH_BLOCK_BYTES = 1 << 20  # rows hashed per numpy pass: ~1 MiB of words stays in cache


def _splitmix(z: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, in place on a uint64 array."""
    z ^= z >> U64(30)
    z *= _C1
    z ^= z >> U64(27)
    z *= _C2
    z ^= z >> U64(31)
    return z


_KEYS_CACHE: dict[int, np.ndarray] = {}


def _position_keys(words: int) -> np.ndarray:
    keys = _KEYS_CACHE.get(words)
    if keys is None:
        keys = _splitmix(np.arange(1, words + 1, dtype=U64) * _GOLDEN)
        _KEYS_CACHE[words] = keys
    return keys


def hash_rows(x: np.ndarray) -> np.ndarray:
    """One uint64 content hash per row (leading axis) of ``x``, from its raw bytes. Not jit-safe.

    Vectorized: no Python loop per example; memory beyond the output is about 1 MiB.
    Equal rows (same dtype, shape and bytes) always get equal hashes.
    """
    n = x.shape[0]
    rows = np.ascontiguousarray(x).reshape(n, -1).view(np.uint8)
    nbytes = rows.shape[1]
    out = np.empty(n, U64)
    if nbytes == 0 or n == 0:
        out[:] = 0
        return _splitmix(out)
    width = -(-nbytes // 8) * 8
    keys = _position_keys(width // 8)
    block = max(1, _HASH_BLOCK_BYTES // width)
    for s in range(0, n, block):
        part = rows[s : s + block]
        if width != nbytes:  # pad each row to whole 8-byte words
            padded = np.zeros((len(part), width), np.uint8)
            padded[:, :nbytes] = part
            part = padded
        z = part.view(U64) ^ keys
        z *= _C1
        z ^= z >> U64(32)
        z *= _C2
        z ^= z >> U64(29)
        out[s : s + block] = z.sum(axis=1, dtype=U64)
    out ^= U64((nbytes * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
    return _splitmix(out)


def combine_hashes(h: np.ndarray | None, g: np.ndarray) -> np.ndarray:
    """One uint64 hash per row from the running row hashes ``h`` (None at first) and the next part's ``g``."""
    if h is None:
        return g
    h = h * _C1
    h ^= g
    return _splitmix(h)
