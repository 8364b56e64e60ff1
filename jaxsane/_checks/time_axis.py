"""What the time-axis probes (``causal.py``, ``sequence.py``) share: which leaves are masks, and how a probe
changes inputs at chosen positions, exactly there. Host-side; not jit-safe."""

from __future__ import annotations

import numpy as np


def _binary(a: np.ndarray) -> bool:
    """A mask-like leaf: bool, or only the values 0 and 1."""
    return a.dtype.kind == "b" or (a.size > 0 and bool(np.isin(a, (0, 1)).all()))


def _perturb(a: np.ndarray, where: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``a`` with the entries at ``where`` (a ``[B, T]`` boolean) changed: integers to another id in
    the observed range, floats by unit-scale noise. Entries elsewhere are untouched (bitwise)."""
    w = where.reshape(where.shape + (1,) * (a.ndim - where.ndim))
    if a.dtype.kind in "iu":
        top = int(a.max()) if a.size else 0
        if top < 1:
            return a
        changed = np.where(a >= 0, (a + 1) % (top + 1), a).astype(a.dtype)  # negatives are ignore indices
        return np.where(w, changed, a)
    if a.dtype.kind in "fc":
        scale = float(np.std(a)) + 1.0
        noise = (rng.standard_normal(a.shape) * scale).astype(a.dtype)
        return np.where(w, a + noise, a)
    return a
