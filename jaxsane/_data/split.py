"""The single-pass accumulators of :func:`jaxsane.check_data`: one :class:`Split` per split
(counts, content hashes, label and shape records), :class:`Flags` (a count and the first few
indices), :class:`LeafStats` (one input leaf's scale) and :class:`Cycle` (a stream that wraps
around to its start).

Nothing here runs inside ``jit``.
"""

from __future__ import annotations

import math

import numpy as np

from .._core.tree import PyTree
from .row_hash import U64 as _U64


class Flags:
    """A count of flagged examples and the first few of their indices."""

    def __init__(self, k: int):
        self.k, self.count = k, 0
        self.first: list[int] = []

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


class LeafStats:
    """Scale/range accumulators for one input leaf."""

    def __init__(self, dtype: np.dtype):
        self.dtype = dtype
        self.lo, self.hi = math.inf, -math.inf
        self.n = 0
        self.s = self.ss = 0.0
        self.row_scale: list[np.ndarray] = []  # per-row max |value| (float32, NaN for non-finite rows)


class Cycle:
    """Recognises a stream that starts over: an endless generator over a finite array, in the same order
    (a wrap) or reshuffled each epoch.

    Keeps every row's content hash in stream order (8 bytes a row) and, for reshuffles, the set of hashes
    seen. The stream has wrapped at row ``k`` when rows ``k, k+1, ...`` repeat rows ``0, 1, ...`` (and rows
    ``0..k`` are not all one row); it has started a reshuffled epoch at row ``k`` when from ``k`` on every
    chunk of rows is at least ``REPEATED`` rows seen before (a few copied rows never make whole chunks of
    repeats). Either is confirmed once ``confirm_rows`` rows (and, for a reshuffle, two chunks) repeated,
    and then the reader stops: one epoch is ``k`` rows.
    """

    REPEATED = 0.9  # share of a chunk's rows seen before that marks a chunk of a new, reshuffled epoch

    def __init__(self, confirm_rows: int = 64):
        self.buf = np.zeros(1024, _U64)
        self.n = 0
        self.k: int | None = None
        self.confirm_rows = confirm_rows
        self.seen: set[int] = set()
        self.restart: int | None = None  # the row where a run of repeated chunks began
        self.restart_chunks = 0

    def _matches(self, k: int, end: int) -> bool:
        return bool(np.array_equal(self.buf[k:end], self.buf[: end - k]))

    def add(self, h: np.ndarray) -> None:
        n0, n1 = self.n, self.n + len(h)
        if n1 > len(self.buf):
            self.buf = np.concatenate([self.buf, np.zeros(max(n1, 2 * len(self.buf)) - len(self.buf), _U64)])
        self.buf[n0:n1] = h
        self.n = n1
        self._reshuffle(h.tolist(), n0)
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

    def _reshuffle(self, rows: list[int], n0: int) -> None:
        """Track runs of chunks made of rows seen before (a reshuffled new epoch)."""
        if rows and n0 > 0 and sum(r in self.seen for r in rows) >= self.REPEATED * len(rows):
            if self.restart is None:
                self.restart, self.restart_chunks = n0, 0
            self.restart_chunks += 1
        else:
            self.restart = None
        self.seen.update(rows)

    def _varied(self, k: int) -> bool:
        """The epoch holds at least two distinct rows (a stream of one repeated row is data.constant's)."""
        return bool((self.buf[1:k] != self.buf[0]).any())

    def _reshuffled(self) -> bool:
        r = self.restart
        return r is not None and self.restart_chunks >= 2 and self.n - r >= self.confirm_rows and self._varied(r)

    @property
    def confirmed(self) -> bool:
        wrapped = self.k is not None and self.n - self.k >= self.confirm_rows and self._varied(self.k)
        return wrapped or self._reshuffled()

    def epoch(self, cut: bool) -> int | None:
        """Rows in one epoch, once confirmed (in a stream cut off by the batch limit: once 2 rows matched)."""
        if self.k is not None and (
            (self.n - self.k >= self.confirm_rows or (cut and self.n - self.k >= 2)) and self._varied(self.k)
        ):
            return self.k
        if self._reshuffled():
            return self.restart
        return None


class Split:
    """Single-pass accumulators of one split."""

    def __init__(self, what: str, k: int):
        self.what, self.k = what, k
        self.rows = self.batches = 0
        self.stream = False
        self.memory: PyTree = None  # the split itself when it is in memory (for exact checks)
        self.hashes: list[np.ndarray] = []
        self.hash_index: list[np.ndarray] = []
        self.signature: list | None = None
        self.input_signature: list | None = None  # (path, per-example shape, dtype) of the inputs
        self.label_signature: list | None = None
        self.padded = False
        self.empty_batches = Flags(k)
        self.partial = False  # stopped at the default batch limit or the time limit, more was left
        self.timed_out = False  # stopped by the time limit
        self.seconds = 0.0  # time spent reading (a stream)
        self.nonfinite_batch: PyTree = None  # the first raw batch holding NaN/Inf in its inputs or labels
        self.shape_errors = Flags(k)
        self.shape_warnings = Flags(k)
        self.shape_detail = ""
        self.shape_warning_detail = ""
        self.nonfinite: dict[str, Flags] = {}
        self.stats: dict[str, LeafStats] = {}
        self.constant_batches = Flags(k)
        self.padding_rows = Flags(k)
        self.padding_batches = Flags(k)
        self.label_bad = Flags(k)
        self.label_lo, self.label_hi = math.inf, -math.inf
        self.label_in_range = False  # some integer label is a class id (beside any out of range)
        self.label_float = Flags(k)
        self.label_soft_bad = Flags(k)
        self.label_column: tuple[int, ...] | None = None  # shape of (B, 1) class-id labels, when seen
        self.label_dtype: np.dtype | None = None
        self.label_ndim: int | None = None
        self.class_counts = np.zeros(0, np.int64)
        self.has_labels = False
        self.count_classes = True
        self.seq_rows = 0  # token rows whose targets can be compared with inputs
        self.seq_same = Flags(k)  # targets == inputs (not shifted)
        self.seq_lag = Flags(k)  # targets[:, 1:] == inputs[:, :-1] (shifted the wrong way)
        self.cycle: Cycle | None = None  # the wrap detector of a stream (set by scan_split)
        self.epoch: int | None = None  # rows in one pass of a stream that wraps to its start


def is_feature(dtype: np.dtype, integer_features: bool | None) -> bool:
    """Whether inputs of ``dtype`` are numeric features (scale-checked) rather than ids. Not jit-safe."""
    if dtype.kind in "fc":
        return True
    if dtype.kind in "iu":
        return integer_features if integer_features is not None else dtype == np.uint8
    return False
