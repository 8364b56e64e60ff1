"""How often two rows of a split are equal by chance, for :func:`jaxsane.check_data`'s duplicates and leakage.

Random one-feature float data repeats values by coincidence: 1,024 eval rows against 4,096 train rows of
a standard normal rounded to 3 decimals share about a thousand values, and even full float32 precision
shares one now and then. Such coincidences are not leakage. :func:`collision_chance` estimates ``q``,
the probability that two independent rows of a split have equal inputs, from a sample of its
rows: per flattened input element, ``q_e = P(|a - b| <= h) * delta / 2h`` (the density of pairs at a
window ``h``, the median gap between sorted neighbours, wide enough that a few copied rows barely weigh
in, scaled to the data's resolution ``delta``: 1 for integers, for floats the smallest gap between
distinct sampled values, at least the dtype's spacing), and ``q``
is the product over elements (independent elements; correlated ones make ``q`` an underestimate, which
only makes a match look less likely by chance, so real leakage stays an error). :func:`beyond_chance`
then asks whether ``k`` matches among ``pairs`` candidate pairs exceed what ``pairs * q`` coincidences
give (Poisson tail below ``1e-3``). Multi-feature rows, images and token sequences have a ``q`` so small
that one copied row is significant.

Nothing here runs inside ``jit``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._experiment.batches import INPUT_KEYS as _INPUT_KEYS
from .read import apply_handle, host_array, named_leaves, take_rows
from .split import Split

_SAMPLE_ROWS = 2048  # rows sampled for the per-element collision rates
_MAX_ELEMENTS = 4096  # elements per row looked at; the product only shrinks with more
SIGNIFICANCE = 1e-3  # a match count whose Poisson tail under chance is below this is not chance


def collision_chance(
    split: Split, hashes: np.ndarray, index: np.ndarray, inputs: Any, pairs: float = 1.0
) -> float | None:
    """The probability that two random rows of ``split`` have equal inputs; None for a stream (its rows are
    not kept). ``hashes``/``index``: the split's row hashes and their example indices; ``pairs``: the
    candidate pairs the caller compares (the estimate stops once ``pairs * q`` is negligible). Not jit-safe."""
    if split.memory is None or len(index) < 2:
        return None
    rows = index
    if len(rows) > _SAMPLE_ROWS:
        rows = np.sort(np.random.default_rng(0).choice(rows, _SAMPLE_ROWS, replace=False))
    x = apply_handle(take_rows(split.memory, rows), inputs, _INPUT_KEYS, 0, "inputs", split.what, True)
    q, seen = 1.0, 0
    for _, leaf in named_leaves(x, ""):
        a = host_array(leaf)
        if a.ndim == 0:
            continue
        flat = a.reshape(len(a), -1)
        for j in range(min(flat.shape[1], _MAX_ELEMENTS - seen)):
            q *= _element_chance(flat[:, j])
            if pairs * q < 1e-9:  # no coincidence left to expect: the rest cannot matter
                return q
        seen += flat.shape[1]
        if seen >= _MAX_ELEMENTS:
            break
    return q


def _element_chance(v: np.ndarray) -> float:
    """``P(a == b)`` for two random draws of one element, from its sampled values ``v``."""
    kind = v.dtype.kind
    if kind == "c":
        return _element_chance(v.real) * _element_chance(v.imag)
    if kind not in "biuf":
        return 1.0
    w = np.sort(v[np.isfinite(v)] if kind == "f" else v).astype(np.float64)
    n = len(w)
    if n < 2 or w[0] == w[-1]:
        return 1.0
    pairs = n * (n - 1) / 2
    gaps = np.diff(w)
    smallest = float(gaps[gaps > 0].min())
    if kind in "biu" or bool(np.all(np.mod(w, 1) == 0)):
        delta = max(1.0, smallest)
    else:
        delta = max(smallest, float(np.spacing(np.float32(np.median(np.abs(w))))))
    # a window wide enough to hold about n / 2 pairs (the median gap between neighbours), so that the few
    # copies a split may hold barely weigh in the density of pairs it measures
    h = max(delta, float(np.median(gaps)))
    near = float((np.searchsorted(w, w + h, side="right") - np.arange(1, n + 1)).sum())
    return min(1.0, max(near, 1.0) / pairs * delta / (2 * h))  # |a - b| <= h spans 2h


def beyond_chance(matches: int, pairs: float, q: float | None) -> bool:
    """Whether ``matches`` equal rows among ``pairs`` candidate pairs are more than coincidence at collision
    chance ``q`` (None: unknown, every match counts). Not jit-safe."""
    if matches <= 0:
        return False
    if q is None:
        return True
    lam = pairs * q
    return _poisson_tail(matches, lam) < SIGNIFICANCE


def expected_by_chance(pairs: float, q: float | None) -> float | None:
    """The number of equal pairs chance alone gives (None when ``q`` is unknown)."""
    return None if q is None else pairs * q


def _poisson_tail(k: int, lam: float) -> float:
    """``P(X >= k)`` for ``X ~ Poisson(lam)``."""
    if lam <= 0:
        return 0.0
    if lam > 1000:  # normal approximation, continuity corrected
        return 0.5 * math.erfc((k - 0.5 - lam) / math.sqrt(2 * lam))
    if k > lam + 12 * math.sqrt(lam) + 30:
        return 0.0
    below, term = 0.0, math.exp(-lam)
    for i in range(k):
        below += term
        term *= lam / (i + 1)
    return max(0.0, 1.0 - below)
