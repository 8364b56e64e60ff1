"""Matching rows by content for :func:`jaxsane.check_data`: ``data.duplicates`` inside a split
and ``data.leakage`` from eval into train. Matching sorts the 64-bit row hashes; candidate pairs of
in-memory data are confirmed by exact byte comparison, so a hash collision is never reported
(stream data keeps no rows: its matches are by hash). Matches that chance explains (random low-dimensional
rows at their precision, ``chance.py``) are not reported.

Nothing here runs inside ``jit``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._core.finding import Finding, ran_beside
from .._experiment.batches import INPUT_KEYS as _INPUT_KEYS
from .chance import beyond_chance, collision_chance
from .natural_repeats import id_inputs, natural_overlap, seen_again
from .read import apply_handle, host_array, named_leaves, take_rows
from .row_hash import U64 as _U64
from .split import Split
from .with_replacement import sampled_with_replacement


def _hashes(split: Split) -> tuple[np.ndarray, np.ndarray]:
    h = np.concatenate(split.hashes) if split.hashes else np.zeros(0, _U64)
    i = np.concatenate(split.hash_index) if split.hash_index else np.zeros(0, np.int64)
    split.hashes, split.hash_index = [h], [i]
    return h, i


def _confirm(a: Split, ia: np.ndarray, b: Split, ib: np.ndarray, opts_inputs: Any) -> np.ndarray | None:
    """Exact byte equality of the inputs of rows ``ia`` of ``a`` and ``ib`` of ``b``; None for streams."""
    if a.memory is None or b.memory is None:
        return None
    same = np.ones(len(ia), bool)
    for s in range(0, len(ia), 4096):
        ra = apply_handle(take_rows(a.memory, ia[s : s + 4096]), opts_inputs, _INPUT_KEYS, 0, "inputs", a.what, True)
        rb = apply_handle(take_rows(b.memory, ib[s : s + 4096]), opts_inputs, _INPUT_KEYS, 0, "inputs", b.what, True)
        for (_, la), (_, lb) in zip(named_leaves(ra, ""), named_leaves(rb, "")):
            la, lb = host_array(la), host_array(lb)
            if la.ndim == 0:
                continue
            if la.dtype != lb.dtype or la.shape[1:] != lb.shape[1:]:
                same[s : s + 4096] = False
                continue
            ua = np.ascontiguousarray(la).reshape(len(la), -1).view(np.uint8)
            ub = np.ascontiguousarray(lb).reshape(len(lb), -1).view(np.uint8)
            same[s : s + 4096] &= (ua == ub).all(axis=1)
    return same


def find_duplicates(split: Split, max_fraction: float, k: int, inputs: Any):
    """``data.duplicates`` of one split, and its (hash, index) arrays sorted by hash for
    :func:`find_leakage`. Not jit-safe."""
    h, idx = _hashes(split)
    order = np.argsort(h, kind="stable")
    hs, isorted = h[order], idx[order]
    if len(hs) < 2:
        return [], (hs, isorted)
    same = hs[1:] == hs[:-1]
    if not same.any():
        return [], (hs, isorted)
    starts = np.concatenate([[True], ~same])
    group = np.cumsum(starts) - 1
    rep = isorted[starts][group]
    pos = np.flatnonzero(~starts)
    dup, orig = isorted[pos], rep[pos]
    ok = _confirm(split, dup, split, orig, inputs)
    exact = ok is not None
    if ok is not None:
        dup, orig = dup[ok], orig[ok]
    if not len(dup):
        return [], (hs, isorted)
    o = np.argsort(dup, kind="stable")
    dup, orig = dup[o], orig[o]
    if split.memory is None:  # a stream: repeats one period apart are its epochs, not duplicated data
        dup, orig = _off_period(dup, orig, split.rows)
        if not len(dup):
            return [], (hs, isorted)
        pool = sampled_with_replacement(h)
        if pool is not None:  # repeats by chance of a sampler, or duplicated rows: a stream cannot tell them apart
            return [_sampler(split, len(dup), len(h), pool)], (hs, isorted)
    frac = len(dup) / max(1, len(h))
    if frac <= max_fraction:
        return [], (hs, isorted)
    if id_inputs(split):  # a few ids an example repeat by their popularity (natural_repeats.py)
        return [_natural_duplicates(split, len(dup), len(h), seen_again(hs))], (hs, isorted)
    candidates = len(h) * (len(h) - 1) / 2
    q = collision_chance(split, h, idx, inputs, candidates)
    if not beyond_chance(len(dup), candidates, q):
        return [], (hs, isorted)
    how = ("exact content match" if exact else "64-bit content hash") + _chance_text(candidates, q)
    pairs = ", ".join(f"{d}={r}" for d, r in zip(dup[:k].tolist(), orig[:k].tolist()))
    return [
        Finding(
            "data.duplicates",
            f"{len(dup)} of {len(h)} {split.what} examples ({100 * frac:.2g}%) repeat an "
            f"earlier example's inputs ({how}; first duplicate=original indices {pairs})",
            "deduplicate the split (np.unique(x, axis=0, return_index=True)); check for repeated shards or "
            "copy-based oversampling",
            path=f"{split.what} inputs",
            extra={"count": int(len(dup)), "indices": dup[:k].tolist(), "originals": orig[:k].tolist()},
        )
    ], (hs, isorted)


def find_leakage(train: Split, eval_: Split, train_sorted, max_fraction: float, k: int, inputs: Any) -> list[Finding]:
    """``data.leakage``: eval examples whose inputs also appear in train (``train_sorted`` from
    :func:`find_duplicates`). Not jit-safe."""
    hs, isorted = train_sorted
    he, ie = _hashes(eval_)
    if not len(hs) or not len(he):
        return []
    pos = np.searchsorted(hs, he)
    pos = np.minimum(pos, len(hs) - 1)
    hit = hs[pos] == he
    if not hit.any():
        return []
    ev, tr = ie[hit], isorted[pos[hit]]
    ok = _confirm(eval_, ev, train, tr, inputs)
    exact = ok is not None
    if ok is not None:
        ev, tr = ev[ok], tr[ok]
    frac = len(ev) / max(1, len(he))
    if not len(ev) or frac <= max_fraction:
        return []
    natural = natural_overlap(train, hs, frac)
    if natural is not None:
        return [natural]
    pairs = float(len(hs)) * len(he)
    q = collision_chance(train, hs, isorted, inputs, pairs)
    if not beyond_chance(len(ev), pairs, q):
        return []
    how = ("exact content match" if exact else "64-bit content hash") + _chance_text(pairs, q)
    return [
        Finding(
            "data.leakage",
            f"{len(ev)} of {len(he)} eval examples ({100 * frac:.2g}%) also appear in train "
            f"({how}; first eval indices {ev[:k].tolist()} = train indices {tr[:k].tolist()})",
            "remove these examples from one split; deduplicate before splitting (split by a group id such "
            "as the source document or user)",
            path="eval inputs",
            extra={"count": int(len(ev)), "eval_indices": ev[:k].tolist(), "train_indices": tr[:k].tolist()},
        )
    ]


def _chance_text(pairs: float, q: float | None) -> str:
    """What chance alone would give, for a finding's message."""
    if q is None:
        return ""
    expected = pairs * q
    return f"; chance alone explains {expected:.2g} at this dimensionality and precision" if expected >= 0.01 else ""


def _duplicates_not_judged(split: Split, repeats: int, rows: int, why: str, hint: str, **extra: float) -> Finding:
    """The info that ``repeats`` of a split's ``rows`` repeat one for a reason other than copied rows (``why``)."""
    return ran_beside(
        Finding(
            "doctor.skipped",
            f"data.duplicates not judged: {repeats} of the {rows} {split.what} rows read ({100 * repeats / rows:.2g}%) "
            f"repeat one, {why}",
            hint,
            path=f"{split.what} inputs",
            extra={"count": repeats, **extra},
        )
    )  # (the data stage's other checks ran)


def _sampler(split: Split, repeats: int, rows: int, pool: float) -> Finding:
    """The info that a stream's repeats are those of sampling with replacement from about ``pool`` rows."""
    why = (
        f"as often as drawing with replacement from about {pool:.0f} distinct rows repeats them (a sampler that "
        "picks random indices); duplicated rows read once can look the same"
    )
    hint = f"to check the {split.what} data for duplicates, pass the stored arrays (jaxsane.check_data(arrays))"
    return _duplicates_not_judged(split, repeats, rows, why, hint, pool=pool)


def _natural_duplicates(split: Split, repeats: int, rows: int, chance: float) -> Finding:
    """The info that a split of a few integer ids an example repeats its rows as a popularity distribution does."""
    why = (
        "but the inputs are a few integer ids an example (a recommender's users and items, categorical fields), "
        f"which repeat by their popularity ({100 * chance:.2g}% of the rows occur more than once); a copied row "
        "looks the same"
    )
    hint = f"to check the {split.what} rows for copies, compare them with their source's unique ids"
    return _duplicates_not_judged(split, repeats, rows, why, hint, chance=chance)


def _off_period(dup: np.ndarray, orig: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The duplicate pairs of a stream that are not epoch repeats: when most pairs lie a multiple of the
    commonest distance ``P`` apart (a stream that cycles over its data, re-augmenting or re-padding each
    row, so only some rows repeat exactly) and the stream ran for two periods at least (a short repeat of a
    stream's start before it ends is duplicated data), those pairs are the stream starting over and are
    dropped."""
    gaps = dup - orig
    values, counts = np.unique(gaps, return_counts=True)
    period = int(values[np.argmax(counts)])
    keep = gaps % max(period, 1) != 0
    if period < 2 or keep.mean() > 0.5 or rows < 2 * period:
        return dup, orig
    return dup[keep], orig[keep]
