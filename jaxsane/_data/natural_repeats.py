"""Inputs that repeat by nature: a few integer ids an example (a recommender's user and item, a click log's
categorical fields), drawn from a skewed popularity, repeat within a split and across splits with no bug.

``data.leakage`` compares eval rows with train rows by content; its chance model (``chance.py``) takes random
rows spread over their range, which a Zipf-distributed pair of ids is not: a held-out two-tower recommender's
eval split, drawn independently of its train stream, had 82% of its (user, item) pairs in train. Here the
chance that an independent draw repeats a train row is estimated from the train split itself (Good-Turing: one
minus the share of train rows seen once); an eval overlap no larger than that is not judged. Host-side; not
jit-safe.
"""

from __future__ import annotations

import numpy as np

from .._core.finding import Finding, ran_beside
from .split import Split

MAX_ID_ELEMENTS = 16  # integer elements an example holds at most, for its inputs to count as a few ids
SLACK = 1.5  # an eval overlap up to this many times the estimated chance is the distribution's own


def id_inputs(split: Split) -> bool:
    """Whether every input leaf is integer and an example holds at most :data:`MAX_ID_ELEMENTS` of them."""
    signature = split.input_signature or []
    elements = sum(int(np.prod(shape)) for _, shape, _ in signature)
    return bool(signature) and all(np.dtype(d).kind in "iu" for _, _, d in signature) and elements <= MAX_ID_ELEMENTS


def seen_again(sorted_hashes: np.ndarray) -> float:
    """Good-Turing: the chance that a new draw from the split's distribution repeats one of its rows, one minus
    the share of its rows that occur once."""
    if not len(sorted_hashes):
        return 0.0
    _, counts = np.unique(sorted_hashes, return_counts=True)
    return 1.0 - float(np.sum(counts == 1)) / len(sorted_hashes)


def natural_overlap(train: Split, sorted_hashes: np.ndarray, overlap: float) -> Finding | None:
    """The info that an eval overlap of ``overlap`` (a share of the eval rows) is what id inputs drawn from the
    train split's own distribution give; None when the inputs are not a few ids or the overlap is larger."""
    if not id_inputs(train):
        return None
    chance = seen_again(sorted_hashes)
    if overlap > SLACK * chance:
        return None
    return ran_beside(
        Finding(
            "doctor.skipped",
            f"data.leakage not judged: {100 * overlap:.2g}% of the eval examples also appear in train, but the inputs "
            f"are a few integer ids an example, and a new draw from the train split's own distribution repeats one "
            f"of its rows {100 * chance:.2g}% of the time (Good-Turing: the rows not seen once), so the overlap is "
            "what the data's popularity gives (a recommender's users and items), not a split that shares examples",
            "to check the split itself, split by a group id (user, session) and compare the groups",
            path="eval inputs",
            extra={"overlap": overlap, "chance": chance},
        )
    )
