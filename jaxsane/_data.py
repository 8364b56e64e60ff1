"""Data checks: labels, shapes, leakage, duplicates, padding, scale, constant and non-finite inputs.

:func:`check_data` reads each split once, as a stream of row chunks, and keeps only small
per-split accumulators plus one 64-bit content hash and one index per example (16 bytes per row;
4 more per numeric feature input for the row scales of ``data.outliers``, 8 more in a stream for
recognising a wrap to its start), so it runs on real-size data (a 1,000,000 x 784 uint8 split in a few seconds) and on
single-pass generators. Hashing is vectorized over 8-byte words: each word is mixed with a
position key (xor, two odd multiplies and two xor-shifts, as in splitmix64), the mixed words of a
row are summed modulo 2**64, and the sum is finalised with splitmix64. Matching is sort based;
candidate pairs of in-memory data are then confirmed by exact byte comparison, so a hash collision
can never be reported as a leak or duplicate (stream data keeps no rows: its matches are by
64-bit hash, collision probability about n**2 / 2**65).

Nothing here runs inside ``jit``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import numpy as np

from ._data_read import Stream, _get, _host, _leaves, _normalize, _num_rows, _slice, _take
from ._errors import DataError
from ._experiment_data import INPUT_KEYS as _INPUT_KEYS, LABEL_KEYS as _LABEL_KEYS, MASK_KEYS as _MASK_KEYS
from ._findings import Diagnosis, Finding
from ._row_hash import U64 as _U64, combine_hashes as _combine, hash_rows
from ._tree import PyTree
from ._validate import require_bool, require_callable, require_float, require_int


_STATS_ROWS = 1024             # rows per chunk sampled for mean/std (scale check)
_STATS_VALUES = 1 << 22        # after this many sampled values, sample every 16th row
_MAX_CLASSES = 100_000         # integer labels above this (without num_classes) are not class ids
DEFAULT_MAX_BATCHES = 1000     # batches read from an iterable split when max_batches is None


# ----------------------------------------------------------------------------- per-split accumulators

def _first(idx: np.ndarray, k: int) -> list[int]:
    return [int(i) for i in idx[:k]]


class _Flags:
    """A count of flagged examples and the first few of their indices."""

    def __init__(self, k: int):
        self.k, self.count, self.first = k, 0, []

    def add(self, flags: np.ndarray, offset: int) -> None:
        n = int(flags.sum())
        if n:
            if len(self.first) < self.k:
                self.first += (np.flatnonzero(flags)[: self.k - len(self.first)] + offset).tolist()
            self.count += n

    def add_index(self, i: int, n: int = 1) -> None:
        if len(self.first) < self.k:
            self.first.append(int(i))
        self.count += n


class _LeafStats:
    """Scale/range accumulators for one input leaf."""

    def __init__(self, dtype: np.dtype):
        self.dtype = dtype
        self.lo, self.hi = math.inf, -math.inf
        self.n = 0
        self.s = self.ss = 0.0
        self.row_scale: list[np.ndarray] = []   # per-row max |value| (float32, NaN for non-finite rows)


class _Cycle:
    """Recognises a stream that wraps around to its start (an endless generator over a finite array).

    Keeps every row's content hash in stream order (8 bytes a row). The stream has wrapped at row
    ``k`` when rows ``k, k+1, ...`` repeat rows ``0, 1, ...`` (and rows ``0..k`` are not all one
    row); the wrap is confirmed once ``confirm_rows`` rows have matched, and then the reader stops:
    one epoch is ``k`` rows.
    """

    def __init__(self, confirm_rows: int = 64):
        self.buf = np.zeros(1024, _U64)
        self.n = 0
        self.k: int | None = None
        self.confirm_rows = confirm_rows

    def _matches(self, k: int, end: int) -> bool:
        return bool(np.array_equal(self.buf[k:end], self.buf[:end - k]))

    def add(self, h: np.ndarray) -> None:
        n0, n1 = self.n, self.n + len(h)
        if n1 > len(self.buf):
            self.buf = np.concatenate([self.buf, np.zeros(max(n1, 2 * len(self.buf)) - len(self.buf), _U64)])
        self.buf[n0:n1] = h
        self.n = n1
        if self.k is not None:
            if self._matches(self.k, n1):
                return
            start, self.k = self.k + 1, None
        else:
            start = max(1, n0)
        for c in (np.flatnonzero(self.buf[start:n1] == self.buf[0]) + start)[:16].tolist():
            if self._matches(c, n1):
                self.k = c
                return

    def _varied(self) -> bool:
        """The epoch holds at least two distinct rows (a stream of one repeated row is data.constant's)."""
        return bool((self.buf[1:self.k] != self.buf[0]).any())

    @property
    def confirmed(self) -> bool:
        return self.k is not None and self.n - self.k >= self.confirm_rows and self._varied()

    def epoch(self, cut: bool) -> int | None:
        """Rows in one epoch, once confirmed (in a stream cut off by the batch limit: once 2 rows matched)."""
        if self.confirmed or (cut and self.k is not None and self.n - self.k >= 2 and self._varied()):
            return self.k
        return None


class _Split:
    """Single-pass accumulators of one split."""

    def __init__(self, what: str, k: int):
        self.what, self.k = what, k
        self.rows = self.batches = 0
        self.stream = False
        self.memory: PyTree = None            # the split itself when it is in memory (for exact checks)
        self.hashes: list[np.ndarray] = []
        self.hash_index: list[np.ndarray] = []
        self.signature: list | None = None
        self.input_signature: list | None = None   # (path, per-example shape, dtype) of the inputs
        self.label_signature: list | None = None
        self.padded = False
        self.empty_batches = _Flags(k)
        self.partial = False                       # stopped at the default batch limit, more was left
        self.shape_errors = _Flags(k)
        self.shape_warnings = _Flags(k)
        self.shape_detail = ""
        self.shape_warning_detail = ""
        self.nonfinite: dict[str, _Flags] = {}
        self.stats: dict[str, _LeafStats] = {}
        self.constant_batches = _Flags(k)
        self.padding_rows = _Flags(k)
        self.padding_batches = _Flags(k)
        self.label_bad = _Flags(k)
        self.label_lo, self.label_hi = math.inf, -math.inf
        self.label_float = _Flags(k)
        self.label_soft_bad = _Flags(k)
        self.label_column = None              # shape of (B, 1) class-id labels, when seen
        self.label_dtype = None
        self.label_ndim = None
        self.class_counts = np.zeros(0, np.int64)
        self.has_labels = False
        self.count_classes = True
        self.seq_rows = 0                        # token rows whose targets can be compared with inputs
        self.seq_same = _Flags(k)                # targets == inputs (not shifted)
        self.seq_lag = _Flags(k)                 # targets[:, 1:] == inputs[:, :-1] (shifted the wrong way)
        self.cycle: _Cycle | None = None          # the wrap detector of a stream (set by _scan)
        self.epoch: int | None = None            # rows in one pass of a stream that wraps to its start


# ----------------------------------------------------------------------------- the check

def check_data(train: Any, eval: Any = None, *, num_classes: int | None = None,
               inputs: Any = None, labels: Any = None, mask: Any = None,
               apply: Callable | None = None, params: Any = None, max_batches: int | None = None,
               max_imbalance_ratio: float = 10.0, max_duplicate_fraction: float = 0.0,
               max_leakage_fraction: float = 0.0, scale_range: tuple[float, float] = (1e-2, 10.0),
               integer_features: bool | None = None, max_indices: int = 5, apply_examples: int = 4,
               chunk_bytes: int = 1 << 24, outlier_ratio: float = 100.0) -> Diagnosis:
    """Check training (and evaluation) data before the model ever sees it.

    Each split is read once, in row chunks, with bounded memory (16 bytes per example for the
    content hashes plus one chunk), so single-pass generators work and a 1,000,000-row split takes
    seconds. Every finding says how many examples are affected, the first few indices (counted in
    stream order across batches) and the fix.

    Codes: ``data.label_range`` (labels outside ``[0, num_classes)``, negative labels, float class
    labels, soft labels outside [0, 1]), ``data.shape`` (per-example shapes/dtypes that change
    across batches; predictions and labels that silently broadcast, e.g. ``(B, 1)`` against
    ``(B,)``), ``data.leakage`` (eval examples whose inputs also appear in train, exact content
    match), ``data.duplicates`` (repeated inputs within a split), ``data.imbalance``,
    ``data.all_padding`` (sequences whose mask is all zero; batches entirely padding),
    ``data.unnormalized``, ``data.constant`` (the whole input, or a whole batch, is one value),
    ``data.outliers`` (rows whose scale is orders of magnitude beyond the rest, with their indices),
    ``data.unshifted_targets`` (next-token targets ``[B, T]`` equal to the integer inputs, or equal
    to them shifted the wrong way), ``data.epoch`` (info: a stream that starts over after k
    examples is read as one epoch of k examples, not as duplicates),
    ``nonfinite.input`` (NaN/Inf in inputs or float labels), ``data.empty`` (a split with zero
    examples is an error, empty batches inside a stream a warning), ``data.partial`` (info: only
    the first ``max_batches`` batches of a longer stream were read).

    Train and eval are compared: inputs (or labels) whose per-example shape or dtype kind differs
    between the splits are a ``data.shape`` error naming both (only the sequence length differs and
    there is a padding mask: a warning, as dynamic padding recompiles; float32 against float64:
    a warning with ``jax_enable_x64`` on, nothing otherwise, as jax computes both in 32 bits).

    Args:
      train: the training data: a numpy/jax array (inputs only), a dict or ``(x, y)`` tuple of
        arrays (the whole split, chunked internally), or an iterable of such batches (read once,
        as a stream), or a zero-argument callable returning one of those.
      eval: the held-out data, in any of the same forms, or None.
      num_classes: number of classes; enables the label range, float-label and missing-class checks.
      inputs, labels, mask: how to get them from a batch: a function ``batch -> array``, a dict key,
        or None for the defaults (keys ``x``/``image``/``inputs``/``tokens``..., ``y``/``label``/
        ``labels``/``targets``..., ``mask``/``attention_mask``/``padding_mask``/``weights``; element
        0 and 1 of a tuple). Labels and mask are optional unless named.
      apply: ``(params, inputs) -> predictions`` (or ``inputs -> predictions`` when ``params`` is
        None), evaluated (abstractly, via ``jax.eval_shape``) on ``apply_examples`` train examples
        to compare prediction and label shapes.
      params: the parameters passed to ``apply``.
      max_batches: read at most this many batches of an iterable split. None (default): at most
        ``DEFAULT_MAX_BATCHES`` (1000), so an endless generator never hangs the check; when the
        stream had more, an info finding ``data.partial`` says that only a prefix was checked.
      max_imbalance_ratio: flag when the most frequent class has more than this many times the
        examples of the least frequent one (or a class in ``range(num_classes)`` never occurs).
        Default 10: Google's ML Crash Course ("Imbalanced datasets") calls a minority class of
        1-20% "moderate" imbalance that needs handling; 10:1 is 9% of a binary split.
      max_duplicate_fraction: flag a split where more than this fraction of the examples repeat
        an earlier one. Default 0 (any duplicate), as deepchecks' ``DataDuplicates`` condition.
      max_leakage_fraction: flag when more than this fraction of eval examples appear in train.
        Default 0: any exact overlap invalidates the eval (deepchecks warns only at 5%).
      scale_range: float inputs whose root-mean-square ``sqrt(mean**2 + std**2)`` lies outside
        this range are flagged as unnormalized. Default (0.01, 10): inputs should be roughly zero
        mean and unit variance (LeCun et al., "Efficient BackProp", 1998, section 4.3); raw 0..255
        pixels as floats have RMS ~85, pixels divided by 255 twice ~0.001.
      integer_features: whether integer inputs are numeric features (checked for scale: a max
        above 1 means raw values such as 0..255 pixels) or ids (tokens, categories; not checked).
        None (default): uint8 inputs are features (pixels), other integer dtypes are ids.
      max_indices: how many example indices each finding lists.
      apply_examples: how many examples ``apply`` sees.
      chunk_bytes: rows are processed in chunks of about this many bytes.
      outlier_ratio: ``data.outliers`` flags rows of a numeric feature input whose largest absolute
        value is more than this many times the median row's (rows of zeros excluded). Default 100:
        two orders of magnitude, far outside the ~5x spread of row maxima of standardised data
        (the max of 784 unit normals is about 3.2 +- 0.4) and the 1.5 IQR fences of Tukey's
        boxplot rule, so only scale errors, sentinels or corrupt rows reach it.

    Returns:
      A :class:`~jaxsane.Diagnosis`; ``diagnosis.artifacts["data"]`` holds per-split summaries
      (rows, batches, class counts, input mean/std).

    Raises:
      DataError: the data cannot be read: ragged batches or rows (labels of another length than
        the inputs), a named key that is missing, string/object arrays, unsupported types, a
        handle that raises, an iterable that yields no batch at all.
      ArgumentError: an argument of the wrong type or out of range (``num_classes="10"``,
        ``max_batches=0``, a fraction outside [0, 1]).

    Not jit-safe (host numpy).

    Example:
      >>> import numpy as np
      >>> x = np.arange(12, dtype=np.float32).reshape(6, 2) / 12
      >>> y = np.array([0, 1, 0, 1, 0, 2])
      >>> check_data((x, y), num_classes=2).codes
      ['data.label_range']
    """
    fn = "check_data"
    num_classes = require_int(fn, "num_classes", num_classes, min=1, optional=True)
    max_batches = require_int(fn, "max_batches", max_batches, min=1, optional=True)
    for name, handle in (("inputs", inputs), ("labels", labels), ("mask", mask)):
        if not (handle is None or isinstance(handle, str) or callable(handle)):
            raise DataError(f"check_data({name}=...): expected a function batch -> array, a dict key (str) or "
                            f"None, got {type(handle).__name__} {handle!r:.60}. Fix: pass {name}='key' or "
                            f"{name}=lambda batch: ....")
    require_callable(fn, "apply", apply, signature="(params, inputs) -> predictions", optional=True)
    require_float(fn, "max_imbalance_ratio", max_imbalance_ratio, min=1.0)
    require_float(fn, "max_duplicate_fraction", max_duplicate_fraction, min=0.0, max=1.0)
    require_float(fn, "max_leakage_fraction", max_leakage_fraction, min=0.0, max=1.0)
    require_float(fn, "outlier_ratio", outlier_ratio, min=1.0)
    if (isinstance(scale_range, (str, bytes)) or not hasattr(scale_range, "__len__") or len(scale_range) != 2
            or not all(isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool)
                       for v in scale_range) or not 0 <= scale_range[0] < scale_range[1]):
        raise DataError(f"check_data(scale_range=...): expected (low, high) with 0 <= low < high, got "
                        f"{scale_range!r:.60}. Fix: pass e.g. scale_range=(1e-2, 10.0).")
    if integer_features is not None:
        require_bool(fn, "integer_features", integer_features)
    max_indices = require_int(fn, "max_indices", max_indices, min=0)
    apply_examples = require_int(fn, "apply_examples", apply_examples, min=1)
    chunk_bytes = require_int(fn, "chunk_bytes", chunk_bytes, min=1)
    opts = dict(num_classes=None if num_classes is None else int(num_classes), inputs=inputs, labels=labels,
                mask=mask, integer_features=integer_features, chunk_bytes=chunk_bytes,
                apply=apply, params=params, apply_examples=apply_examples)
    diagnosis = Diagnosis(name="data")
    findings: list[Finding] = []
    train_split = _scan(train, "train", max_batches, max_indices, opts, findings)
    eval_split = _scan(eval, "eval", max_batches, max_indices, opts, findings) if eval is not None else None
    splits = [s for s in (train_split, eval_split) if s is not None]
    train_sorted = None
    for split in splits:
        findings += _split_findings(split, opts, max_imbalance_ratio, scale_range, outlier_ratio)
        dup, sorted_ = _duplicates(split, max_duplicate_fraction, max_indices, inputs)
        findings += dup
        if split is train_split:
            train_sorted = sorted_
    if eval_split is not None:
        findings += _compare_splits(train_split, eval_split)
        findings += _leakage(train_split, eval_split, train_sorted, max_leakage_fraction, max_indices, inputs)
    diagnosis.add(findings)
    diagnosis.artifacts["data"] = {s.what: _summary(s) for s in splits}
    return diagnosis


def _summary(split: _Split) -> dict[str, Any]:
    out: dict[str, Any] = {"rows": split.rows, "batches": split.batches, "stream": split.stream}
    if split.class_counts.size:
        out["class_counts"] = split.class_counts.tolist()
    out["inputs"] = {}
    for path, st in split.stats.items():
        if st.n:
            mean = st.s / st.n
            out["inputs"][path] = {"dtype": str(st.dtype), "min": st.lo, "max": st.hi, "mean": mean,
                                   "std": math.sqrt(max(st.ss / st.n - mean * mean, 0.0))}
    return out


def _scan(data: Any, what: str, max_batches: int | None, k: int, opts: dict, findings: list[Finding]) -> _Split:
    split = _Split(what, k)
    batches = Stream(data, what, DEFAULT_MAX_BATCHES if max_batches is None else max_batches,
                     peek=max_batches is None)
    split.stream = stream = batches.is_stream
    if stream:
        split.cycle = _Cycle()
    offset = 0
    for b, raw in batches:
        where = f"{what} batch {b}" if stream else what
        batch = _normalize(raw, where)
        if not stream:
            split.memory = batch
        n = _num_rows(batch, where)
        padded = _get(batch, opts["mask"], _MASK_KEYS, None, "mask", where, required=opts["mask"] is not None)
        split.padded |= padded is not None
        _signature(split, batch, b, where, padded is not None)
        if n == 0:
            split.empty_batches.add_index(b)
        row_bytes = max(1, sum(int(np.prod(np.shape(a)[1:], dtype=np.int64)) * np.dtype(a.dtype).itemsize
                               for _, a in _leaves(batch, "") if np.ndim(a)))
        step = max(1, int(opts["chunk_bytes"]) // row_bytes)
        batch_lo: dict[str, float] = {}
        batch_hi: dict[str, float] = {}
        batch_any_mask = False
        batch_has_mask = False
        for s in range(0, n, step):
            chunk = _slice(batch, s, min(n, s + step)) if (s > 0 or step < n) else batch
            lo, hi, has_mask, any_mask = _scan_chunk(split, chunk, offset + s, where, opts,
                                                     first=(b == 0 and s == 0), findings=findings)
            for p in lo:
                batch_lo[p] = min(batch_lo.get(p, math.inf), lo[p])
                batch_hi[p] = max(batch_hi.get(p, -math.inf), hi[p])
            batch_has_mask |= has_mask
            batch_any_mask |= any_mask
        if batch_has_mask and not batch_any_mask:
            split.padding_batches.add_index(b)
        elif stream and n > 1 and batch_lo and all(batch_lo[p] == batch_hi[p] for p in batch_lo):
            split.constant_batches.add_index(b)
        offset += n
        split.batches += 1
        if split.cycle is not None and split.cycle.confirmed:
            break  # the stream started over: one epoch has been read, the rest repeats it
    if split.batches == 0:
        raise DataError(f"the {what} data is empty: its iterator yielded no batch. Likely cause: an exhausted "
                        "generator (already read once) or a filter that dropped everything. Fix: pass a fresh "
                        "iterable, or a zero-argument function returning one.")
    split.rows = offset
    split.partial = batches.more
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


def _truncate(split: _Split, rows: int) -> None:
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


def _signature(split: _Split, batch: PyTree, b: int, where: str, padded: bool) -> None:
    """Compare per-example shapes/dtypes with batch 0: a changed dtype, rank or (without a padding
    mask) size is an error; a changed size in padded data (dynamic padding) is a recompile warning."""
    sig = [(p, tuple(np.shape(a)[1:]), np.dtype(a.dtype).str) for p, a in _leaves(batch, "batch")]
    if split.signature is None:
        split.signature = sig
        return
    if sig == split.signature:
        return
    if [p for p, _, _ in sig] != [p for p, _, _ in split.signature]:
        detail = (f"{where} has leaves {[p for p, _, _ in sig]} but batch 0 had "
                  f"{[p for p, _, _ in split.signature]}")
        severe = True
    else:
        diffs = [(p, s0, d0, s1, d1) for (p, s1, d1), (_, s0, d0) in zip(sig, split.signature) if (s1, d1) != (s0, d0)]
        severe = not padded or any(d0 != d1 or len(s0) != len(s1) for _, s0, d0, s1, d1 in diffs)
        p, s0, d0, s1, d1 = diffs[0]
        detail = (f"{p} has per-example shape {s1} dtype {np.dtype(d1)} in {where} but {s0} dtype "
                  f"{np.dtype(d0)} in batch 0")
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


def _compare_splits(train: _Split, eval_: _Split) -> list[Finding]:
    """``data.shape`` when train and eval inputs (or labels) differ in structure, per-example shape or
    dtype: a model fitted to one cannot be evaluated on the other."""
    out: list[Finding] = []
    for what, a, b in (("inputs", train.input_signature, eval_.input_signature),
                       ("labels", train.label_signature, eval_.label_signature)):
        if a is None or b is None or a == b:
            continue
        if [p for p, _, _ in a] != [p for p, _, _ in b]:
            out.append(Finding("data.shape", f"the eval {what} have leaves {[p for p, _, _ in b]} but the train "
                               f"{what} have {[p for p, _, _ in a]}",
                               f"give both splits the same {what} structure (same keys, same order)",
                               path=f"eval {what}"))
            continue
        for (p, sa, da), (_, sb, db) in zip(a, b):
            if (sa, da) == (sb, db):
                continue
            kind_change = da.kind != db.kind or len(sa) != len(sb)
            padded_length = sa != sb and not kind_change and (train.padded or eval_.padded)
            width_only = sa == sb and not kind_change  # float32 against float64, int32 against int64
            if width_only and not jax.config.jax_enable_x64:
                continue  # jax canonicalises both to 32 bits: the same program runs on both splits
            severity = "warning" if (padded_length or width_only) else "error"
            why = ("each new length recompiles the jitted eval step" if padded_length else
                   "the eval runs at another precision and recompiles" if width_only else
                   "a model fitted to the train shape cannot run, or silently broadcasts, on the eval shape")
            out.append(Finding("data.shape", f"eval {what} {p} has per-example shape {sb} dtype {db} but train "
                               f"{what} {p} has shape {sa} dtype {da}: {why}",
                               "load both splits with the same preprocessing (same feature columns, resize, "
                               "padding length and dtype cast)", path=f"eval {p}", severity=severity,
                               extra={"train": [list(sa), str(da)], "eval": [list(sb), str(db)]}))
            break  # one finding per kind of leaf is enough to point at the preprocessing
    return out


def _is_feature(dtype: np.dtype, integer_features: bool | None) -> bool:
    if dtype.kind in "fc":
        return True
    if dtype.kind in "iu":
        return integer_features if integer_features is not None else dtype == np.uint8
    return False


def _scan_chunk(split: _Split, chunk: PyTree, offset: int, where: str, opts: dict, *, first: bool,
                findings: list[Finding]):
    """Accumulate one chunk of rows; returns per-leaf (min, max) and mask presence/any."""
    x = _get(chunk, opts["inputs"], _INPUT_KEYS, 0, "inputs", where, required=True)
    x = _normalize(x, f"{where} inputs")
    y = _get(chunk, opts["labels"], _LABEL_KEYS, 1, "labels", where,
             required=opts["labels"] is not None or opts["num_classes"] is not None)
    m = _get(chunk, opts["mask"], _MASK_KEYS, None, "mask", where, required=opts["mask"] is not None)
    rows = None
    leaves = [(p, _host(a)) for p, a in _leaves(x, "inputs")]
    if split.input_signature is None:
        split.input_signature = _leaf_signature(leaves)
        if y is not None:
            split.label_signature = _leaf_signature(_leaves(y, "labels"))
    lo: dict[str, float] = {}
    hi: dict[str, float] = {}
    h = None
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
        flat = a.reshape(a.shape[0], -1)
        finite_rows = None
        if a.dtype.kind in "fc":
            bad = ~np.isfinite(flat).all(axis=1)
            if bad.any():
                split.nonfinite.setdefault(path, _Flags(split.k)).add(bad, offset)
                finite_rows = ~bad
        if flat.size == 0:
            continue
        # per-row min/max in the same pass as the global ones: the row scales feed data.outliers
        rmin, rmax = flat.min(axis=1), flat.max(axis=1)
        if finite_rows is None:
            lo[path], hi[path] = float(rmin.min()), float(rmax.max())
        elif finite_rows.any():
            lo[path], hi[path] = float(rmin[finite_rows].min()), float(rmax[finite_rows].max())
        st = split.stats.setdefault(path, _LeafStats(a.dtype))
        if a.dtype.kind in "fiu" and _is_feature(a.dtype, opts["integer_features"]):
            scale = np.maximum(np.abs(rmin.astype(np.float32)), np.abs(rmax.astype(np.float32)))
            if finite_rows is not None:
                scale[~finite_rows] = np.nan
            st.row_scale.append(scale)
        if path in lo:
            st.lo, st.hi = min(st.lo, lo[path]), max(st.hi, hi[path])
        if _is_feature(a.dtype, opts["integer_features"]):
            # mean/std from a row sample: at most _STATS_ROWS rows per chunk, and every 16th row once
            # _STATS_VALUES values are in (streams of small batches), so the scale check stays cheap
            stride = max(1, len(flat) // _STATS_ROWS, 16 if st.n >= _STATS_VALUES else 1)
            sample = flat[::stride]
            if finite_rows is not None:
                sample = sample[finite_rows[::stride]]
            if sample.size:
                sample = sample.astype(np.float64) if a.dtype.kind != "c" else np.abs(sample).astype(np.float64)
                st.n += sample.size
                st.s += float(sample.sum())
                st.ss += float(np.einsum("ij,ij->", sample, sample))
    if rows is None:
        raise DataError(f"the inputs of {where} have no leading example axis (scalars only).")
    # padding mask
    keep = None
    has_mask = any_mask = False
    if m is not None:
        mk = _host(_normalize(m, f"{where} mask"))
        if mk.ndim == 0 or mk.shape[0] != rows:
            raise DataError(f"the mask of {where} has shape {mk.shape} but the inputs have {rows} rows; the mask "
                            "needs the same leading (example) axis.")
        has_mask = True
        if mk.ndim >= 2:
            row_any = mk.reshape(rows, -1).any(axis=1)
            split.padding_rows.add(~row_any, offset)
            keep = row_any
            any_mask = bool(row_any.any())
        else:
            any_mask = bool(mk.any())
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


def _scan_labels(split: _Split, y: Any, m: Any, rows: int, offset: int, where: str, opts: dict) -> None:
    y = _normalize(y, f"{where} labels")
    leaves = jax.tree_util.tree_leaves(y)
    if len(leaves) != 1:
        return  # multi-task label pytrees: only the input checks apply
    lab = _host(leaves[0])
    if lab.ndim == 0 or lab.shape[0] != rows:
        raise DataError(f"ragged batch in {where}: the labels have shape {lab.shape} but the inputs have {rows} "
                        "rows; every example needs a label.")
    split.has_labels = True
    split.label_dtype, split.label_ndim = lab.dtype, lab.ndim
    C = opts["num_classes"]
    valid = None
    if m is not None:
        mk = _host(m)
        if mk.shape == lab.shape or (mk.ndim < lab.ndim and lab.shape[:mk.ndim] == mk.shape and mk.ndim >= 2):
            valid = mk.astype(bool).reshape(mk.shape + (1,) * (lab.ndim - mk.ndim))
    flat_rows = lab.reshape(rows, -1)
    if lab.dtype.kind in "fc":
        bad = ~np.isfinite(flat_rows).all(axis=1)
        if bad.any():
            split.nonfinite.setdefault("labels", _Flags(split.k)).add(bad, offset)
        if C is not None:
            if lab.ndim >= 2 and lab.shape[-1] == C and C > 1:  # one-hot / soft labels
                out = ((flat_rows < 0) | (flat_rows > 1)).any(axis=1) & ~bad
                split.label_soft_bad.add(out, offset)
            else:
                split.label_float.add(np.ones(rows, bool), offset)
        return
    if lab.dtype.kind not in "iub":
        return
    lab_i = lab.astype(np.int64, copy=False)
    bad = lab_i < 0
    if C is not None:
        bad |= lab_i >= C
    if valid is not None:
        bad &= np.broadcast_to(valid, bad.shape)
    bad_rows = bad.reshape(rows, -1).any(axis=1)
    if bad_rows.any():
        split.label_bad.add(bad_rows, offset)
        vals = lab_i[bad]
        split.label_lo, split.label_hi = min(split.label_lo, int(vals.min())), max(split.label_hi, int(vals.max()))
    if lab.ndim == 2 and lab.shape[1] == 1 and (C is not None or lab.dtype.kind in "iu"):
        split.label_column = lab.shape
    if split.count_classes and (lab.ndim == 1 or (lab.ndim == 2 and lab.shape[1] == 1)):
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


def _scan_shift(split: _Split, leaves: list[tuple[str, np.ndarray]], y: Any, m: Any, rows: int,
                offset: int) -> None:
    """Next-token targets ``[B, T]`` against integer inputs of the same shape: targets equal to the
    inputs (not shifted), or equal to the inputs one position late (``targets[:, 1:] == inputs[:, :-1]``,
    shifted the wrong way). Only rows that can tell are counted: at least 3 valid positions whose
    tokens are not all one value (for the wrong-way test, not of period 2 either). Positions that the
    mask marks as padding, and negative targets (an ignore index such as -100), are not compared."""
    lab_leaves = jax.tree_util.tree_leaves(y)
    if len(lab_leaves) != 1:
        return
    lab = _host(lab_leaves[0])
    if lab.ndim != 2 or lab.shape[1] < 3 or lab.dtype.kind not in "iu":
        return
    tokens = [a for _, a in leaves if a.shape == lab.shape and a.dtype.kind in "iu" and a is not m]
    if not tokens:
        return
    valid = lab >= 0
    if m is not None:
        mk = _host(m)
        if mk.shape == lab.shape:
            valid &= mk.astype(bool)
    for tok in tokens:
        varied = ((tok != tok[:, :1]) & valid).any(axis=1) & (valid.sum(axis=1) >= 3)
        if not varied.any():
            continue
        split.seq_rows += int(varied.sum())
        same = ((lab == tok) | ~valid).all(axis=1) & varied
        period2 = ((tok[:, 2:] == tok[:, :-2]) | ~valid[:, 2:]).all(axis=1)
        lag = ((lab[:, 1:] == tok[:, :-1]) | ~valid[:, 1:]).all(axis=1) & varied & ~period2
        split.seq_same.add(same, offset)
        split.seq_lag.add(lag, offset)
        return  # the first token leaf of the targets' shape is the one they are compared with


def _apply_check(opts: dict, x: PyTree, y: Any, where: str) -> list[Finding]:
    """Evaluate ``apply`` abstractly on a few examples and compare prediction and label shapes."""
    apply, params, k = opts["apply"], opts["params"], max(1, int(opts["apply_examples"]))
    xs = _slice(x, 0, k)
    try:
        fn = (lambda inp: apply(inp)) if params is None else (lambda inp: apply(params, inp))
        try:
            out = jax.eval_shape(fn, xs)
        except Exception:
            out = fn(xs)
    except Exception as e:
        return [Finding("doctor.skipped", f"predictions-vs-labels check skipped: apply raised "
                        f"{type(e).__name__}: {str(e)[:200]} on {where} inputs", "make apply(params, inputs) "
                        "work on a slice of a batch", severity="info")]
    leaves = jax.tree_util.tree_leaves(out)
    if y is None or not leaves:
        return []
    pred_shape = tuple(leaves[0].shape)
    lab_leaves = jax.tree_util.tree_leaves(y)
    if len(lab_leaves) != 1:
        return []
    lab = _host(lab_leaves[0])[:k]
    lab_shape = tuple(lab.shape)
    C = opts["num_classes"]
    if pred_shape == lab_shape:
        return []
    if lab.dtype.kind in "iu" and pred_shape[:-1] == lab_shape and pred_shape[-1] > 1:
        if C is not None and pred_shape[-1] != C:
            return [Finding("data.shape", f"predictions have {pred_shape[-1]} classes (shape {pred_shape}) but "
                            f"num_classes={C}", "make the output layer's width equal num_classes",
                            path="predictions")]
        return []  # logits (B, C) against integer class ids (B,)
    try:
        joint = np.broadcast_shapes(pred_shape, lab_shape)
    except ValueError:
        return [Finding("data.shape", f"predictions of shape {pred_shape} cannot be compared with labels of shape "
                        f"{lab_shape} ({k} examples of {where})",
                        "make the model output match the labels (one value per label, or logits (B, C) for "
                        "integer class ids)", path="predictions")]
    if joint != pred_shape or joint != lab_shape:
        return [Finding("data.shape", f"predictions of shape {pred_shape} and labels of shape {lab_shape} "
                        f"silently broadcast to {joint} in an elementwise loss ({k} examples of {where}): every "
                        f"prediction is compared with every label",
                        "squeeze the trailing axis (preds[:, 0] or labels[:, None]) so both have one shape",
                        path="predictions", extra={"predictions": pred_shape, "labels": lab_shape})]
    return []


def _idx(flags: _Flags) -> str:
    return f"first indices {flags.first}"


def _outliers(split: _Split, ratio: float) -> list[Finding]:
    """``data.outliers``: rows whose max |value| is more than ``ratio`` times the median row's."""
    out: list[Finding] = []
    for path, st in split.stats.items():
        if not st.row_scale:
            continue
        scale = np.concatenate(st.row_scale) if len(st.row_scale) > 1 else st.row_scale[0]
        st.row_scale = [scale]
        positive = scale[scale > 0]  # NaN compares False: non-finite rows are nonfinite.input's
        if positive.size < 8:
            continue
        median = float(np.median(positive))
        flags = scale > ratio * median
        count = int(flags.sum())
        if not count:
            continue
        idx = np.flatnonzero(flags)
        top = idx[np.argsort(-scale[idx], kind="stable")][: split.k]
        out.append(Finding("data.outliers", f"{count} of {split.rows} {split.what} examples have values in {path} "
                           f"more than {ratio:g}x the typical row's scale (max |value| up to {float(scale[idx].max()):.4g} "
                           f"against a median row max of {median:.3g}; first indices {idx[: split.k].tolist()}, "
                           f"largest at {top.tolist()})",
                           "inspect these rows: a unit or scaling error, a sentinel value (e.g. -9999 for missing), "
                           "or corrupt records; clip, fix or drop them. A few such rows can overflow the loss "
                           "(NaN) only when a batch first draws them", severity="warning", path=f"{split.what} {path}",
                           extra={"count": count, "indices": idx[: split.k].tolist(), "median_scale": median,
                                  "max_scale": float(scale[idx].max())}))
    return out


def _split_findings(split: _Split, opts: dict, max_ratio: float, scale_range: tuple[float, float],
                    outlier_ratio: float = 100.0) -> list[Finding]:
    out: list[Finding] = []
    w, C = split.what, opts["num_classes"]
    n = split.rows
    if split.partial:
        out.append(Finding("data.partial", f"the {w} stream has more than {split.batches} batches; only these "
                           f"first {split.batches} batches ({n} examples) were checked",
                           "pass check_data(max_batches=N) to read more (or fewer) batches",
                           severity="info", path=w, extra={"batches": split.batches, "rows": n}))
    if n == 0:
        out.append(Finding("data.empty", f"the {w} split has 0 examples ({split.batches} batch(es), every one with "
                           "a leading axis of size 0)", "check the filter, split or shard that produced it; an "
                           "empty split makes every mean a 0/0 NaN", path=w))
        return out
    if split.empty_batches.count:
        out.append(Finding("data.empty", f"{split.empty_batches.count} {w} batches have 0 examples (batches "
                           f"{split.empty_batches.first}): a mean over them is 0/0 = NaN",
                           "drop empty batches (or the filter/shard that empties them) before the step",
                           severity="warning", path=w, extra={"batches": split.empty_batches.first}))
    if split.shape_errors.count:
        out.append(Finding("data.shape", f"{split.shape_errors.count} {w} batches change per-example shape/dtype: "
                           f"{split.shape_detail} (batches {split.shape_errors.first})",
                           "make every batch the same structure, per-example shape and dtype (cast, pad)",
                           path=w, extra={"batches": split.shape_errors.first}))
    if split.shape_warnings.count:
        out.append(Finding("data.shape", f"{split.shape_warnings.count} {w} batches change a per-example size: "
                           f"{split.shape_warning_detail} (batches {split.shape_warnings.first}); each new shape "
                           "recompiles the jitted step", "pad to one fixed length (or a few bucket lengths)",
                           severity="warning", path=w))
    for path, fl in split.nonfinite.items():
        out.append(Finding("nonfinite.input", f"{fl.count} of {n} {w} examples hold NaN/Inf in {path} "
                           f"({_idx(fl)})", "drop or repair these rows in the data pipeline (check for division by "
                           "zero or missing values before normalisation)", path=f"{w} {path}",
                           extra={"count": fl.count, "indices": fl.first}))
    if split.label_bad.count:
        rng = f"[0, {C})" if C is not None else "the non-negative integers"
        out.append(Finding("data.label_range", f"{split.label_bad.count} of {n} {w} examples have labels outside "
                           f"{rng} (offending values from {split.label_lo} to {split.label_hi}; "
                           f"{_idx(split.label_bad)})",
                           "labels must be 0..num_classes-1: fix 1-based labels (y - 1), an ignore index such as "
                           "-100 (mask it instead), or num_classes", path=f"{w} labels",
                           extra={"count": split.label_bad.count, "indices": split.label_bad.first}))
    if split.label_float.count:
        out.append(Finding("data.label_range", f"{w} labels have float dtype {split.label_dtype} although "
                           f"num_classes={C} (all {split.label_float.count} examples): class labels should be "
                           "integer ids", "cast them with labels.astype(np.int32) (and use integer-label cross "
                           "entropy), or pass one-hot labels of shape (B, num_classes)", path=f"{w} labels",
                           extra={"count": split.label_float.count}))
    if split.label_soft_bad.count:
        out.append(Finding("data.label_range", f"{split.label_soft_bad.count} of {n} {w} examples have one-hot/soft "
                           f"labels outside [0, 1] ({_idx(split.label_soft_bad)})",
                           "soft labels are probabilities: check the label smoothing / one-hot encoding",
                           path=f"{w} labels"))
    if split.label_column is not None and opts["apply"] is None:
        out.append(Finding("data.shape", f"{w} class-id labels have shape {split.label_column} (a trailing axis of "
                           "1): against (B,) predictions or per-example losses they silently broadcast to (B, B)",
                           "squeeze them to shape (B,) (labels[:, 0]); pass apply= to compare with the model's "
                           "predictions", path=f"{w} labels", extra={"shape": split.label_column}))
    counts = split.class_counts
    if counts.size >= 2 or (C is not None and C >= 2 and counts.size):
        present = counts[counts > 0]
        missing = np.flatnonzero(counts == 0)
        ratio = float(present.max() / present.min()) if present.size else math.inf
        if missing.size and C is not None:
            out.append(Finding("data.imbalance", f"{missing.size} of {C} classes never occur in the {w} labels "
                               f"(classes {_first(missing, split.k)}; {counts.sum()} labelled examples)",
                               "check the label mapping and num_classes, or stratify the split",
                               path=f"{w} labels", extra={"class_counts": counts.tolist()}))
        elif ratio > max_ratio:
            big, small = int(np.argmax(np.where(counts > 0, counts, -1))), int(np.argmin(np.where(counts > 0, counts,
                                                                                           np.iinfo(np.int64).max)))
            out.append(Finding("data.imbalance", f"{w} class frequencies are skewed {ratio:.1f}:1 (class {big}: "
                               f"{counts[big]} examples, class {small}: {counts[small]} of {counts.sum()}; "
                               f"threshold {max_ratio:g}:1)",
                               "re-weight the loss or resample, and check the labels for a mapping/sampling bug",
                               path=f"{w} labels", extra={"class_counts": counts.tolist(), "ratio": ratio}))
    if split.epoch is not None:
        out.append(Finding("data.epoch", f"the {w} stream starts over after {split.epoch} examples (rows "
                           f"{split.epoch}.. repeat rows 0..): read as one epoch of {split.epoch} examples; the "
                           "repeat is an epoch boundary, not duplicated data", "-", severity="info", path=w,
                           extra={"epoch_rows": split.epoch}))
    if split.seq_rows:
        for flags, what, fix in (
                (split.seq_same, "equal the inputs at every position (next-token targets not shifted: the model "
                 "is trained to copy its input)", "shift them: inputs = tokens[:, :-1], targets = tokens[:, 1:] "
                 "(and the mask likewise)"),
                (split.seq_lag, "equal the inputs one position late (targets[:, 1:] == inputs[:, :-1]: shifted "
                 "the wrong way, the model is trained to predict the previous token)",
                 "shift the other way: inputs = tokens[:, :-1], targets = tokens[:, 1:]")):
            if flags.count and flags.count * 2 >= split.seq_rows:
                out.append(Finding("data.unshifted_targets", f"{flags.count} of {split.seq_rows} {w} token "
                                   f"sequences have targets that {what} ({_idx(flags)})", fix,
                                   path=f"{w} labels", extra={"count": flags.count, "indices": flags.first,
                                                              "rows_compared": split.seq_rows}))
    if split.padding_rows.count:
        out.append(Finding("data.all_padding", f"{split.padding_rows.count} of {n} {w} examples are all padding "
                           f"(mask all zero; {_idx(split.padding_rows)})",
                           "drop empty sequences before batching; check the tokenizer, truncation and packing",
                           path=f"{w} mask", extra={"count": split.padding_rows.count,
                                                    "indices": split.padding_rows.first}))
    if split.padding_batches.count:
        out.append(Finding("data.all_padding", f"{split.padding_batches.count} {w} batches are entirely padding "
                           f"(mask all zero; batches {split.padding_batches.first}): they train on nothing and "
                           "make a masked mean 0/0", "drop empty batches; check the mask polarity (1 = real token)",
                           path=f"{w} mask"))
    outliers = _outliers(split, outlier_ratio)
    outlier_paths = {f.path for f in outliers}
    for path, st in split.stats.items():
        if st.lo == math.inf:
            continue
        if st.lo == st.hi and n > 1:
            out.append(Finding("data.constant", f"every {w} input in {path} is the same value {st.lo:g} "
                               f"(all {n} examples)", "the loader returns a placeholder (zeros?): check the "
                               "decoding and preprocessing", path=f"{w} {path}"))
            continue
        if st.dtype.kind in "iu" and _is_feature(st.dtype, opts["integer_features"]) and st.hi > 1:
            out.append(Finding("data.unnormalized", f"{w} {path} is raw {st.dtype} in [{st.lo:g}, {st.hi:g}] fed as "
                               f"features (all {n} examples)", f"scale it to floats: x.astype(np.float32) / "
                               f"{st.hi:g} (or standardise to zero mean, unit variance)", path=f"{w} {path}"))
        elif st.dtype.kind in "fc" and st.n:
            mean = st.s / st.n
            std = math.sqrt(max(st.ss / st.n - mean * mean, 0.0))
            rms = math.sqrt(max(st.ss / st.n, 0.0))
            if not (scale_range[0] <= rms <= scale_range[1]) and f"{w} {path}" not in outlier_paths:
                out.append(Finding("data.unnormalized", f"{w} {path} has mean {mean:.3g}, std {std:.3g} (RMS {rms:.3g} "
                                   f"outside [{scale_range[0]:g}, {scale_range[1]:g}]; all {n} examples)",
                                   "standardise the inputs ((x - mean) / std over the train split) or scale pixels "
                                   "once by 1/255", path=f"{w} {path}",
                                   extra={"mean": mean, "std": std}))
    out += outliers  # their rows inflate the RMS: data.unnormalized is not reported beside them
    if split.constant_batches.count:
        out.append(Finding("data.constant", f"{split.constant_batches.count} of {split.batches} {w} batches have "
                           f"constant inputs (one value throughout; batches {split.constant_batches.first})",
                           "the loader returns a placeholder batch: check decoding, augmentation and the end of "
                           "the stream", path=f"{w} inputs"))
    return out


# ----------------------------------------------------------------------------- duplicates and leakage

def _hashes(split: _Split) -> tuple[np.ndarray, np.ndarray]:
    h = np.concatenate(split.hashes) if split.hashes else np.zeros(0, _U64)
    i = np.concatenate(split.hash_index) if split.hash_index else np.zeros(0, np.int64)
    split.hashes, split.hash_index = [h], [i]
    return h, i


def _confirm(a: _Split, ia: np.ndarray, b: _Split, ib: np.ndarray, opts_inputs: Any) -> np.ndarray | None:
    """Exact byte equality of the inputs of rows ``ia`` of ``a`` and ``ib`` of ``b``; None for streams."""
    if a.memory is None or b.memory is None:
        return None
    same = np.ones(len(ia), bool)
    for s in range(0, len(ia), 4096):
        ra = _get(_take(a.memory, ia[s:s + 4096]), opts_inputs, _INPUT_KEYS, 0, "inputs", a.what, True)
        rb = _get(_take(b.memory, ib[s:s + 4096]), opts_inputs, _INPUT_KEYS, 0, "inputs", b.what, True)
        for (_, la), (_, lb) in zip(_leaves(ra, ""), _leaves(rb, "")):
            la, lb = _host(la), _host(lb)
            if la.ndim == 0:
                continue
            if la.dtype != lb.dtype or la.shape[1:] != lb.shape[1:]:
                same[s:s + 4096] = False
                continue
            ua = np.ascontiguousarray(la).reshape(len(la), -1).view(np.uint8)
            ub = np.ascontiguousarray(lb).reshape(len(lb), -1).view(np.uint8)
            same[s:s + 4096] &= (ua == ub).all(axis=1)
    return same


def _duplicates(split: _Split, max_fraction: float, k: int, inputs: Any):
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
    frac = len(dup) / max(1, len(h))
    if frac <= max_fraction:
        return [], (hs, isorted)
    how = "exact content match" if exact else "64-bit content hash"
    pairs = ", ".join(f"{d}={r}" for d, r in zip(dup[:k].tolist(), orig[:k].tolist()))
    return [Finding("data.duplicates", f"{len(dup)} of {len(h)} {split.what} examples ({100 * frac:.2g}%) repeat an "
                    f"earlier example's inputs ({how}; first duplicate=original indices {pairs})",
                    "deduplicate the split (np.unique(x, axis=0, return_index=True)); check for repeated shards or "
                    "copy-based oversampling", path=f"{split.what} inputs",
                    extra={"count": int(len(dup)), "indices": dup[:k].tolist(), "originals": orig[:k].tolist()})], \
        (hs, isorted)


def _leakage(train: _Split, eval_: _Split, train_sorted, max_fraction: float, k: int, inputs: Any) -> list[Finding]:
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
    how = "exact content match" if exact else "64-bit content hash"
    return [Finding("data.leakage", f"{len(ev)} of {len(he)} eval examples ({100 * frac:.2g}%) also appear in train "
                    f"({how}; first eval indices {ev[:k].tolist()} = train indices {tr[:k].tolist()})",
                    "remove these examples from one split; deduplicate before splitting (split by a group id such "
                    "as the source document or user)", path="eval inputs",
                    extra={"count": int(len(ev)), "eval_indices": ev[:k].tolist(), "train_indices": tr[:k].tolist()})]


def judge_masked_nonfinite(findings: list[Finding], loss: Callable | None, params: Any,
                           splits: dict[str, Any], max_batches: int = 20) -> list[Finding]:
    """Demote ``nonfinite.input`` to ``data.masked_nonfinite`` (info) where the loss masks the NaNs.

    Data sets mark missing labels with NaN (OGB style) and the loss masks them out. For each split
    (``{"train": data, "eval": data}``) with a ``nonfinite.input`` finding, the loss at init is
    evaluated on the first of its batches (up to ``max_batches``) that holds non-finite floats: a
    finite loss means the NaNs never reach it, and the finding becomes info; a non-finite loss (or
    no loss handle, or no such batch found) keeps the error. Not jit-safe.
    """
    from ._experiment_data import iter_batches

    if loss is None or not any(f.code == "nonfinite.input" for f in findings):
        return findings
    masked: set[str] = set()
    for what, data in splits.items():
        if data is None or not any(f.code == "nonfinite.input" and str(f.path or "").startswith(what)
                                   for f in findings):
            continue
        try:
            batch = next((b for b in iter_batches(data, max_batches, what) if _holds_nonfinite(b)), None)
            value = None if batch is None else float(jax.jit(loss)(params, batch))
        except Exception:  # a loss that cannot run on this batch decides nothing here
            value = None
        if value is not None and math.isfinite(value):
            masked.add(what)
    out = []
    for f in findings:
        split = str(f.path or "").split(" ", 1)[0]
        if f.code == "nonfinite.input" and split in masked:
            f = Finding("data.masked_nonfinite", f"{f.message}; the loss at init is finite on them, so the loss "
                        "masks them (e.g. NaN marking missing labels)", "nothing to do if that is intended; "
                        "guard reports such values only when an output of the step goes non-finite",
                        path=f.path, extra=dict(f.extra or {}))
        out.append(f)
    return out


def _holds_nonfinite(batch: Any) -> bool:
    return any(np.asarray(x).dtype.kind in "fc" and not np.isfinite(np.asarray(x)).all()
               for x in jax.tree_util.tree_leaves(batch))
