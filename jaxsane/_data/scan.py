"""Reading one split for :func:`jaxsane.check_data`: batches from :class:`Stream` (``read.py``),
cut into row chunks of about ``chunk_bytes``, folded into a :class:`Split` (``split.py``; content
hashes, per-leaf scale, labels, padding, next-token shift, per-batch shape signatures), and the
predictions-vs-labels shape check of ``apply`` on the first chunk.

Nothing here runs inside ``jit``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from .._core.errors import DataError
from .._core.finding import Finding
from .._core.tree import PyTree
from .._experiment.batches import INPUT_KEYS as _INPUT_KEYS, LABEL_KEYS as _LABEL_KEYS, MASK_KEYS as _MASK_KEYS
from .read import Stream, apply_handle, as_arrays, host_array, named_leaves, num_rows, slice_rows
from .row_hash import U64 as _U64, combine_hashes as _combine, hash_rows
from .split import Cycle, Flags, LeafStats, Split, is_feature

_STATS_ROWS = 1024  # rows per chunk sampled for mean/std (scale check)
_STATS_VALUES = 1 << 22  # after this many sampled values, sample every 16th row
_MAX_CLASSES = 100_000  # integer labels above this (without num_classes) are not class ids
DEFAULT_MAX_BATCHES = 1000  # batches read from an iterable split when max_batches is None


def scan_split(
    data: Any,
    what: str,
    max_batches: int | None,
    k: int,
    opts: dict,
    findings: list[Finding],
    max_seconds: float | None = None,
) -> Split:
    """Read one split once (see the module docstring) into a :class:`Split`: at most ``max_batches``
    batches of a stream (None: ``DEFAULT_MAX_BATCHES``, or no batch limit when ``max_seconds`` bounds the
    reading), for at most ``max_seconds``. Not jit-safe."""
    split = Split(what, k)
    limit = max_batches if max_batches is not None else (None if max_seconds is not None else DEFAULT_MAX_BATCHES)
    batches = Stream(data, what, limit, peek=max_batches is None, seconds=max_seconds)
    split.stream = stream = batches.is_stream
    if stream:
        split.cycle = Cycle()
    offset = 0
    for b, raw in batches:
        where = f"{what} batch {b}" if stream else what
        batch = as_arrays(raw, where)
        if not stream:
            split.memory = batch
        n = num_rows(batch, where)
        padded = apply_handle(batch, opts["mask"], _MASK_KEYS, None, "mask", where, required=opts["mask"] is not None)
        split.padded |= padded is not None
        _signature(split, batch, b, where, padded is not None)
        if n == 0:
            split.empty_batches.add_index(b)
        row_bytes = max(
            1,
            sum(
                int(np.prod(np.shape(a)[1:], dtype=np.int64)) * np.dtype(a.dtype).itemsize
                for _, a in named_leaves(batch, "")
                if np.ndim(a)
            ),
        )
        step = max(1, int(opts["chunk_bytes"]) // row_bytes)
        batch_lo: dict[str, float] = {}
        batch_hi: dict[str, float] = {}
        batch_any_mask = False
        batch_has_mask = False
        nonfinite_before = sum(fl.count for fl in split.nonfinite.values())
        for s in range(0, n, step):
            chunk = slice_rows(batch, s, min(n, s + step)) if (s > 0 or step < n) else batch
            lo, hi, has_mask, any_mask = _scan_chunk(
                split, chunk, offset + s, where, opts, first=(b == 0 and s == 0), findings=findings
            )
            for p in lo:
                batch_lo[p] = min(batch_lo.get(p, math.inf), lo[p])
                batch_hi[p] = max(batch_hi.get(p, -math.inf), hi[p])
            batch_has_mask |= has_mask
            batch_any_mask |= any_mask
        if split.nonfinite_batch is None and sum(fl.count for fl in split.nonfinite.values()) > nonfinite_before:
            split.nonfinite_batch = raw  # kept for judging whether the loss masks them
        if batch_has_mask and not batch_any_mask:
            split.padding_batches.add_index(b)
        elif stream and n > 1 and batch_lo and all(batch_lo[p] == batch_hi[p] for p in batch_lo):
            split.constant_batches.add_index(b)
        offset += n
        split.batches += 1
        if split.cycle is not None and split.cycle.confirmed:
            break  # the stream started over: one epoch has been read, the rest repeats it
    if split.batches == 0:
        raise DataError(
            f"the {what} data is empty: its iterator yielded no batch. Likely cause: an exhausted "
            "generator (already read once) or a filter that dropped everything. Fix: pass a fresh "
            "iterable, or a zero-argument function returning one."
        )
    split.rows = offset
    split.partial = batches.more or (batches.timed_out and not batches.peek)
    split.timed_out, split.seconds = batches.timed_out, batches.seconds_read
    if split.cycle is not None:
        # a stream cut off by the batch limit may end right after its wrap; one that ended by itself
        # with a short repeat of its start holds duplicates (confirmed wraps stopped the reading earlier)
        cut = batches.more or (batches.limit is not None and split.batches >= batches.limit)
        split.epoch = split.cycle.epoch(cut)
        if split.epoch is not None:
            _truncate(split, split.epoch)
            split.rows = split.epoch
        split.cycle = None
    return split


def _truncate(split: Split, rows: int) -> None:
    """Keep only the first ``rows`` examples of the per-row accumulators (one epoch of a wrapped stream).

    Counters of the few repeated rows read before the wrap was confirmed (class counts, scale sums)
    are kept: they are at most ``confirm_rows`` plus one batch of rows."""
    h = np.concatenate(split.hashes) if split.hashes else np.zeros(0, _U64)
    i = np.concatenate(split.hash_index) if split.hash_index else np.zeros(0, np.int64)
    keep = i < rows
    split.hashes, split.hash_index = [h[keep]], [i[keep]]
    for st in split.stats.values():
        if st.row_scale:
            st.row_scale = [np.concatenate(st.row_scale)[:rows]]
    split.partial = False


def _signature(split: Split, batch: PyTree, b: int, where: str, padded: bool) -> None:
    """Compare per-example shapes/dtypes with batch 0: a changed dtype, rank or (without a padding
    mask) size is an error; a changed size in padded data (dynamic padding) is a recompile warning."""
    sig = [(p, tuple(np.shape(a)[1:]), np.dtype(a.dtype).str) for p, a in named_leaves(batch, "batch")]
    if split.signature is None:
        split.signature = sig
        return
    if sig == split.signature:
        return
    if [p for p, _, _ in sig] != [p for p, _, _ in split.signature]:
        detail = f"{where} has leaves {[p for p, _, _ in sig]} but batch 0 had {[p for p, _, _ in split.signature]}"
        severe = True
    else:
        diffs = [(p, s0, d0, s1, d1) for (p, s1, d1), (_, s0, d0) in zip(sig, split.signature) if (s1, d1) != (s0, d0)]
        severe = not padded or any(d0 != d1 or len(s0) != len(s1) for _, s0, d0, s1, d1 in diffs)
        p, s0, d0, s1, d1 = diffs[0]
        detail = (
            f"{p} has per-example shape {s1} dtype {np.dtype(d1)} in {where} but {s0} dtype {np.dtype(d0)} in batch 0"
        )
    if severe:
        if not split.shape_errors.count:
            split.shape_detail = detail
        split.shape_errors.add_index(b)
    else:
        if not split.shape_warnings.count:
            split.shape_warning_detail = detail
        split.shape_warnings.add_index(b)


def _leaf_signature(leaves: list[tuple[str, Any]]) -> list[tuple[str, tuple, np.dtype]]:
    return [(p, tuple(np.shape(a)[1:]), np.dtype(getattr(a, "dtype", np.asarray(a).dtype))) for p, a in leaves]


def _scan_chunk(
    split: Split, chunk: PyTree, offset: int, where: str, opts: dict, *, first: bool, findings: list[Finding]
) -> tuple[dict[str, float], dict[str, float], bool, bool]:
    """Accumulate one chunk of rows; returns per-leaf (min, max) and mask presence/any."""
    x = apply_handle(chunk, opts["inputs"], _INPUT_KEYS, 0, "inputs", where, required=True)
    x = as_arrays(x, f"{where} inputs")
    y = apply_handle(
        chunk,
        opts["labels"],
        _LABEL_KEYS,
        1,
        "labels",
        where,
        required=opts["labels"] is not None or opts["num_classes"] is not None,
    )
    m = apply_handle(chunk, opts["mask"], _MASK_KEYS, None, "mask", where, required=opts["mask"] is not None)
    leaves = [(p, host_array(a)) for p, a in named_leaves(x, "inputs")]
    if split.input_signature is None:
        split.input_signature = _leaf_signature(leaves)
        if y is not None:
            split.label_signature = _leaf_signature(named_leaves(y, "labels"))
    lo: dict[str, float] = {}
    hi: dict[str, float] = {}
    rows, h = _scan_inputs(split, leaves, offset, where, opts["integer_features"], lo, hi)
    keep, has_mask, any_mask = _scan_mask(split, m, rows, offset, where)
    if split.cycle is not None:
        split.cycle.add(h)
    idx = np.arange(offset, offset + rows, dtype=np.int64)
    if keep is not None and not keep.all():
        h, idx = h[keep], idx[keep]
    split.hashes.append(h)
    split.hash_index.append(idx)
    if y is not None:
        _scan_labels(split, y, m, rows, offset, where, opts)
        _scan_shift(split, leaves, y, m, rows, offset)
    if first and split.what == "train" and opts["apply"] is not None:
        findings += _apply_check(opts, x, y, where)
    return lo, hi, has_mask, any_mask


def _scan_inputs(
    split: Split,
    leaves: list[tuple[str, np.ndarray]],
    offset: int,
    where: str,
    integer_features: bool | None,
    lo: dict[str, float],
    hi: dict[str, float],
) -> tuple[int, np.ndarray]:
    """Fold the input leaves of one chunk into ``split``, their finite (min, max) into ``lo``/``hi``:
    ``(rows, the rows' content hashes)``."""
    rows: int | None = None
    h: np.ndarray | None = None
    for path, a in leaves:
        if a.ndim == 0:
            continue
        if rows is None:
            rows = a.shape[0]
        elif a.shape[0] != rows:
            raise DataError(f"ragged inputs in {where}: {path} has {a.shape[0]} rows, another input leaf {rows}.")
        if a.dtype.kind == "b":
            a = a.view(np.uint8)
        h = _combine(h, hash_rows(a))
        _scan_leaf(split, path, a, offset, integer_features, lo, hi)
    if rows is None or h is None:
        raise DataError(f"the inputs of {where} have no leading example axis (scalars only).")
    return rows, h


def _scan_leaf(
    split: Split,
    path: str,
    a: np.ndarray,
    offset: int,
    integer_features: bool | None,
    lo: dict[str, float],
    hi: dict[str, float],
) -> None:
    """One input leaf of a chunk: its non-finite rows, range, row scales and mean/std sample."""
    flat = a.reshape(a.shape[0], -1)
    finite_rows = None
    if a.dtype.kind in "fc":
        bad = ~np.isfinite(flat).all(axis=1)
        if bad.any():
            split.nonfinite.setdefault(path, Flags(split.k)).add(bad, offset)
            finite_rows = ~bad
    if flat.size == 0:
        return
    # per-row min/max in the same pass as the global ones: the row scales feed data.outliers
    rmin, rmax = flat.min(axis=1), flat.max(axis=1)
    if finite_rows is None:
        lo[path], hi[path] = float(rmin.min()), float(rmax.max())
    elif finite_rows.any():
        lo[path], hi[path] = float(rmin[finite_rows].min()), float(rmax[finite_rows].max())
    st = split.stats.setdefault(path, LeafStats(a.dtype))
    feature = is_feature(a.dtype, integer_features)
    if a.dtype.kind in "fiu" and feature:
        scale = np.maximum(np.abs(rmin.astype(np.float32)), np.abs(rmax.astype(np.float32)))
        if finite_rows is not None:
            scale[~finite_rows] = np.nan
        st.row_scale.append(scale)
    if path in lo:
        st.lo, st.hi = min(st.lo, lo[path]), max(st.hi, hi[path])
    if feature:
        _sample_moments(st, flat, finite_rows, complex_=a.dtype.kind == "c")


def _sample_moments(st: LeafStats, flat: np.ndarray, finite_rows: np.ndarray | None, *, complex_: bool) -> None:
    """Mean/std sums from a row sample: at most _STATS_ROWS rows per chunk, and every 16th row once
    _STATS_VALUES values are in (streams of small batches), so the scale check stays cheap."""
    stride = max(1, len(flat) // _STATS_ROWS, 16 if st.n >= _STATS_VALUES else 1)
    sample = flat[::stride]
    if finite_rows is not None:
        sample = sample[finite_rows[::stride]]
    if sample.size:
        sample = sample.astype(np.float64) if not complex_ else np.abs(sample).astype(np.float64)
        st.n += sample.size
        st.s += float(sample.sum())
        st.ss += float(np.einsum("ij,ij->", sample, sample))


def _scan_mask(split: Split, m: Any, rows: int, offset: int, where: str) -> tuple[np.ndarray | None, bool, bool]:
    """The padding mask of one chunk: ``(rows to keep or None, has a mask, any position unmasked)``."""
    if m is None:
        return None, False, False
    mk = host_array(as_arrays(m, f"{where} mask"))
    if mk.ndim == 0 or mk.shape[0] != rows:
        raise DataError(
            f"the mask of {where} has shape {mk.shape} but the inputs have {rows} rows; the mask "
            "needs the same leading (example) axis."
        )
    if mk.ndim >= 2:
        row_any = np.asarray(mk.reshape(rows, -1).any(axis=1))
        split.padding_rows.add(~row_any, offset)
        return row_any, True, bool(row_any.any())
    return None, True, bool(mk.any())


def _scan_labels(split: Split, y: Any, m: Any, rows: int, offset: int, where: str, opts: dict) -> None:
    y = as_arrays(y, f"{where} labels")
    leaves = jax.tree_util.tree_leaves(y)
    if len(leaves) != 1:
        return  # multi-task label pytrees: only the input checks apply
    lab = host_array(leaves[0])
    if lab.ndim == 0 or lab.shape[0] != rows:
        raise DataError(
            f"ragged batch in {where}: the labels have shape {lab.shape} but the inputs have {rows} "
            "rows; every example needs a label."
        )
    split.has_labels = True
    split.label_dtype, split.label_ndim = lab.dtype, lab.ndim
    C = opts["num_classes"]
    if lab.dtype.kind in "fc":
        _scan_float_labels(split, lab, rows, offset, C)
        return
    if lab.dtype.kind not in "iub":
        return
    valid = None
    if m is not None:
        mk = host_array(m)
        if mk.shape == lab.shape or (mk.ndim < lab.ndim and lab.shape[: mk.ndim] == mk.shape and mk.ndim >= 2):
            valid = mk.astype(bool).reshape(mk.shape + (1,) * (lab.ndim - mk.ndim))
    lab_i = lab.astype(np.int64, copy=False)
    bad = lab_i < 0
    if C is not None:
        bad |= lab_i >= C
    if valid is not None:
        bad &= np.broadcast_to(valid, bad.shape)
    in_range = (lab_i >= 0) & (lab_i < C) if C is not None else lab_i >= 0
    split.label_in_range |= bool(in_range.any())
    bad_rows = np.asarray(bad.reshape(rows, -1).any(axis=1))
    if bad_rows.any():
        split.label_bad.add(bad_rows, offset)
        vals = lab_i[bad]
        split.label_lo, split.label_hi = min(split.label_lo, int(vals.min())), max(split.label_hi, int(vals.max()))
    if lab.ndim == 2 and lab.shape[1] == 1 and (C is not None or lab.dtype.kind in "iu"):
        split.label_column = lab.shape
    if split.count_classes and (lab.ndim == 1 or (lab.ndim == 2 and lab.shape[1] == 1)):
        _count_classes(split, lab_i, C)


def _scan_float_labels(split: Split, lab: np.ndarray, rows: int, offset: int, C: int | None) -> None:
    """Float labels: non-finite rows; with ``num_classes``, one-hot/soft labels outside [0, 1] or float class ids."""
    flat_rows = lab.reshape(rows, -1)
    bad = ~np.isfinite(flat_rows).all(axis=1)
    if bad.any():
        split.nonfinite.setdefault("labels", Flags(split.k)).add(bad, offset)
    if C is not None:
        if lab.ndim >= 2 and lab.shape[-1] == C and C > 1:  # one-hot / soft labels
            out = ((flat_rows < 0) | (flat_rows > 1)).any(axis=1) & ~bad
            split.label_soft_bad.add(out, offset)
        else:
            split.label_float.add(np.ones(rows, bool), offset)


def _count_classes(split: Split, lab_i: np.ndarray, C: int | None) -> None:
    """Add integer class ids (negative and out-of-range ones left out) to ``split.class_counts``."""
    good = lab_i.reshape(-1)
    good = good[good >= 0]
    if C is not None:
        good = good[good < C]
    if C is None and good.size and good.max() >= _MAX_CLASSES:  # ids or counts, not classes
        split.count_classes, split.class_counts = False, np.zeros(0, np.int64)
        return
    if good.size:
        counts = np.bincount(good, minlength=C or 0)
        if counts.size > split.class_counts.size:
            counts[: split.class_counts.size] += split.class_counts
            split.class_counts = counts
        else:
            split.class_counts[: counts.size] += counts


def _scan_shift(split: Split, leaves: list[tuple[str, np.ndarray]], y: Any, m: Any, rows: int, offset: int) -> None:
    """Next-token targets ``[B, T]`` against integer inputs of the same shape: targets equal to the
    inputs (not shifted), or equal to the inputs one position late (``targets[:, 1:] == inputs[:, :-1]``,
    shifted the wrong way). Only rows that can tell are counted: at least 3 valid positions whose
    tokens are not all one value (for the wrong-way test, not of period 2 either). Positions that the
    mask marks as padding, and negative targets (an ignore index such as -100), are not compared."""
    lab_leaves = jax.tree_util.tree_leaves(y)
    if len(lab_leaves) != 1:
        return
    lab = host_array(lab_leaves[0])
    if lab.ndim != 2 or lab.shape[1] < 3 or lab.dtype.kind not in "iu":
        return
    tokens = [a for _, a in leaves if a.shape == lab.shape and a.dtype.kind in "iu" and a is not m]
    if not tokens:
        return
    valid = lab >= 0
    if m is not None:
        mk = host_array(m)
        if mk.shape == lab.shape:
            valid &= mk.astype(bool)
    varied_any = same_any = lag_any = np.zeros(rows, bool)
    for tok in tokens:  # every token leaf of the targets' shape (an encoder-decoder feeds the source and the targets)
        varied = ((tok != tok[:, :1]) & valid).any(axis=1) & (valid.sum(axis=1) >= 3)
        same = ((lab == tok) | ~valid).all(axis=1) & varied
        period2 = ((tok[:, 2:] == tok[:, :-2]) | ~valid[:, 2:]).all(axis=1)
        lag = ((lab[:, 1:] == tok[:, :-1]) | ~valid[:, 1:]).all(axis=1) & varied & ~period2
        varied_any, same_any, lag_any = varied_any | varied, same_any | same, lag_any | lag
    if varied_any.any():
        split.seq_rows += int(varied_any.sum())
        split.seq_same.add(same_any, offset)
        split.seq_lag.add(lag_any & ~same_any, offset)


def _apply_check(opts: dict, x: PyTree, y: Any, where: str) -> list[Finding]:
    """Evaluate ``apply`` abstractly on a few examples and compare prediction and label shapes."""
    apply, params, k = opts["apply"], opts["params"], max(1, int(opts["apply_examples"]))
    xs = slice_rows(x, 0, k)
    try:
        fn = (lambda inp: apply(inp)) if params is None else (lambda inp: apply(params, inp))
        try:
            out = jax.eval_shape(fn, xs)
        except Exception:
            out = fn(xs)
    except Exception as e:
        return [
            Finding(
                "doctor.skipped",
                f"predictions-vs-labels check skipped: apply raised "
                f"{type(e).__name__}: {str(e)[:200]} on {where} inputs",
                "make apply(params, inputs) work on a slice of a batch",
                severity="info",
            )
        ]
    leaves = jax.tree_util.tree_leaves(out)
    if y is None or not leaves:
        return []
    pred_shape = tuple(leaves[0].shape)
    lab_leaves = jax.tree_util.tree_leaves(y)
    if len(lab_leaves) != 1:
        return []
    lab = host_array(lab_leaves[0])[:k]
    lab_shape = tuple(lab.shape)
    C = opts["num_classes"]
    if pred_shape == lab_shape:
        return []
    if lab.dtype.kind in "iu" and pred_shape[:-1] == lab_shape and pred_shape[-1] > 1:
        if C is not None and pred_shape[-1] != C:
            return [
                Finding(
                    "data.shape",
                    f"predictions have {pred_shape[-1]} classes (shape {pred_shape}) but num_classes={C}",
                    "make the output layer's width equal num_classes",
                    path="predictions",
                )
            ]
        return []  # logits (B, C) against integer class ids (B,)
    try:
        joint = np.broadcast_shapes(pred_shape, lab_shape)
    except ValueError:
        return [
            Finding(
                "data.shape",
                f"predictions of shape {pred_shape} cannot be compared with labels of shape "
                f"{lab_shape} ({k} examples of {where})",
                "make the model output match the labels (one value per label, or logits (B, C) for integer class ids)",
                path="predictions",
            )
        ]
    if joint != pred_shape or joint != lab_shape:
        return [
            Finding(
                "data.shape",
                f"predictions of shape {pred_shape} and labels of shape {lab_shape} "
                f"silently broadcast to {joint} in an elementwise loss ({k} examples of {where}): every "
                f"prediction is compared with every label",
                "squeeze the trailing axis (preds[:, 0] or labels[:, None]) so both have one shape",
                path="predictions",
                extra={"predictions": pred_shape, "labels": lab_shape},
            )
        ]
    return []
