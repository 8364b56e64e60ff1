"""Whether a stream's repeated rows are what sampling with replacement gives: a pipeline that draws each batch's
indices at random with replacement (``rng.integers(0, n, batch)``, ``rng.choice(n, batch)``) repeats rows by
chance, and those repeats are no duplicated data. Host-side numpy; not jit-safe.
"""

from __future__ import annotations

import math

import numpy as np


def pool_size(draws: int, distinct: int) -> float:
    """The number ``N`` of distinct rows that ``draws`` uniform draws with replacement would need to show
    ``distinct`` of them on average: the root of ``N (1 - exp(-draws / N)) = distinct`` (bisection; ``inf`` when
    nothing repeated)."""
    if distinct >= draws:
        return math.inf
    low, high = float(distinct), float(distinct)
    while high * -math.expm1(-draws / high) < distinct:
        high *= 2.0
    for _ in range(60):
        mid = (low + high) / 2
        if mid * -math.expm1(-draws / mid) < distinct:
            low = mid
        else:
            high = mid
    return high


def sampled_with_replacement(hashes: np.ndarray) -> float | None:
    """The pool size (:func:`pool_size`) when the rows' repeat counts are those of uniform sampling with replacement
    from it: the rows seen three times or more as many as a Poisson draw of rate ``draws / N`` gives, within three
    standard deviations (rows copied once in the data, each seen exactly twice, have none). None otherwise, when
    nothing repeats, or when the repeats are too few for the test to tell the two apart (the expected count of rows
    seen three times is within three standard deviations of none)."""
    _, counts = np.unique(hashes, return_counts=True)
    draws, distinct = int(counts.sum()), len(counts)
    pool = pool_size(draws, distinct)
    if not math.isfinite(pool):
        return None
    rate = draws / pool
    below_three = math.exp(-rate) * (1 + rate + rate * rate / 2)
    expected = pool * max(0.0, 1.0 - below_three)
    seen = int(np.sum(counts >= 3))
    slack = 3 * math.sqrt(expected) + 2
    if expected - slack <= 0:  # too few repeats to tell a sampler from rows copied once: duplicates, as before
        return None
    return pool if abs(seen - expected) <= slack else None
