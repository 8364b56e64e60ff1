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

Here: the entry point and its argument checks. The parts, in this folder: ``read.py`` (user data to
arrays), ``scan.py`` (one pass over a split), ``split.py`` (its accumulators), ``findings.py`` (findings
per split, train against eval), ``match.py`` (duplicates and leakage), ``row_hash.py`` (the row hashes).

Nothing here runs inside ``jit``.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._core.diagnosis import Diagnosis
from .._core.errors import DataError
from .._core.finding import Finding
from .._core.validate import require_bool, require_callable, require_float, require_int
from .._jaxpr.compile_level import quick_jit
from .findings import compare_splits, split_findings
from .match import find_duplicates, find_leakage
from .scan import scan_split
from .split import Split

# ----------------------------------------------------------------------------- the check


def check_data(
    train: Any,
    eval: Any = None,
    *,
    num_classes: int | None = None,
    inputs: Any = None,
    labels: Any = None,
    mask: Any = None,
    apply: Callable | None = None,
    params: Any = None,
    max_batches: int | None = None,
    max_seconds: float | None = None,
    max_imbalance_ratio: float = 10.0,
    max_duplicate_fraction: float = 0.0,
    max_leakage_fraction: float = 0.0,
    scale_range: tuple[float, float] = (1e-2, 10.0),
    integer_features: bool | None = None,
    max_indices: int = 5,
    apply_examples: int = 4,
    chunk_bytes: int = 1 << 24,
    outlier_ratio: float = 100.0,
) -> Diagnosis:
    """Check training (and evaluation) data before the model ever sees it.

    Each split is read once, in row chunks, with bounded memory (16 bytes per example for the content hashes plus
    one chunk), so single-pass generators work and a 1,000,000-row split takes seconds. Every finding says how
    many examples are affected, the first few indices (counted in stream order across batches) and the fix.

    Codes: ``data.label_range`` (labels outside ``[0, num_classes)``, negative labels, float class labels, soft
    labels outside [0, 1]), ``data.shape`` (per-example shapes/dtypes that change across batches; predictions and
    labels that silently broadcast, e.g. ``(B, 1)`` against ``(B,)``), ``data.leakage`` (eval examples whose inputs
    also appear in train, exact content match), ``data.duplicates`` (repeated inputs within a split),
    ``data.imbalance``, ``data.all_padding`` (sequences whose mask is all zero; batches entirely padding),
    ``data.unnormalized``, ``data.constant`` (the whole input, or a whole batch, is one value), ``data.outliers``
    (rows whose scale is orders of magnitude beyond the rest, with their indices), ``data.unshifted_targets``
    (next-token targets ``[B, T]`` equal to the integer inputs, or equal to them shifted the wrong way),
    ``data.epoch`` (info: a stream that starts over after k examples is read as one epoch of k examples, not as
    duplicates), ``nonfinite.input`` (NaN/Inf in inputs or float labels), ``data.empty`` (a split with zero
    examples is an error, empty batches inside a stream a warning), ``data.partial`` (info: only the first
    ``max_batches`` batches of a longer stream were read).

    Train and eval are compared: inputs (or labels) whose per-example shape or dtype kind differs between the
    splits are a ``data.shape`` error naming both (only the sequence length differs and there is a padding mask: a
    warning, as dynamic padding recompiles; float32 against float64: a warning with ``jax_enable_x64`` on, nothing
    otherwise, as jax computes both in 32 bits).

    {args}

    Returns:
      A :class:`~jaxsane.Diagnosis`; ``diagnosis.artifacts["data"]`` holds per-split summaries (rows, batches,
      class counts, input mean/std; for a stream the seconds spent reading it and why reading stopped:
      ``"end"``, ``"epoch"``, ``"time"`` or ``"batches"``); ``artifacts["nonfinite_batches"]`` the first batch
      of each split that holds NaN/Inf, as read.

    Raises:
      DataError: the data cannot be read: ragged batches or rows (labels of another length than the inputs), a
        named key that is missing, string/object arrays, unsupported types, a handle that raises, an iterable
        that yields no batch at all.
      ArgumentError: an argument of the wrong type or out of range (``num_classes="10"``, ``max_batches=0``, a
        fraction outside [0, 1]).

    Not jit-safe (host numpy).

    Example:
      >>> import numpy as np
      >>> x = np.arange(12, dtype=np.float32).reshape(6, 2) / 12
      >>> y = np.array([0, 1, 0, 1, 0, 2])
      >>> check_data((x, y), num_classes=2).codes
      ['data.label_range']
    """
    return (
        _DataCheck(
            num_classes=num_classes,
            inputs=inputs,
            labels=labels,
            mask=mask,
            apply=apply,
            params=params,
            max_batches=max_batches,
            max_seconds=max_seconds,
            max_imbalance_ratio=max_imbalance_ratio,
            max_duplicate_fraction=max_duplicate_fraction,
            max_leakage_fraction=max_leakage_fraction,
            scale_range=scale_range,
            integer_features=integer_features,
            max_indices=max_indices,
            apply_examples=apply_examples,
            chunk_bytes=chunk_bytes,
            outlier_ratio=outlier_ratio,
        )
        .checked()
        .run(train, eval)
    )


# check_data's docstring, continued: its arguments, filled in at ``{args}`` (so help(check_data) shows them in
# place), kept here so that the function stays short.
_ARGS_DOC = """\
Args:
  train: the training data: a numpy/jax array (inputs only), a dict or ``(x, y)`` tuple of arrays (the whole
    split, chunked internally), or an iterable of such batches (read once, as a stream), or a zero-argument
    callable returning one of those.
  eval: the held-out data, in any of the same forms, or None.
  num_classes: number of classes; enables the label range, float-label and missing-class checks.
  inputs, labels, mask: how to get them from a batch: a function ``batch -> array``, a dict key, or None for
    the defaults (keys ``x``/``image``/``inputs``/``tokens``..., ``y``/``label``/``labels``/``targets``...,
    ``mask``/``attention_mask``/``padding_mask``/``weights``; element 0 and 1 of a tuple). Labels and mask
    are optional unless named.
  apply: ``(params, inputs) -> predictions`` (or ``inputs -> predictions`` when ``params`` is None),
    evaluated (abstractly, via ``jax.eval_shape``) on ``apply_examples`` train examples to compare
    prediction and label shapes.
  params: the parameters passed to ``apply``.
  max_batches: read at most this many batches of an iterable split. None (default): at most
    ``DEFAULT_MAX_BATCHES`` (1000), so an endless generator never hangs the check; when the stream had more,
    an info finding ``data.partial`` says that only a prefix was checked.
  max_seconds: stop reading a stream after this many seconds (per split, at least one batch; a stream
    that starts over, one epoch, or ends stops it earlier). With ``max_batches=None`` there is then no
    batch limit. ``data.partial`` says how much was read. None (default): no time limit.
  max_imbalance_ratio: flag when the most frequent class has more than this many times the examples of the
    least frequent one (or a class in ``range(num_classes)`` never occurs). Default 10: Google's ML Crash
    Course ("Imbalanced datasets") calls a minority class of 1-20% "moderate" imbalance that needs
    handling; 10:1 is 9% of a binary split.
  max_duplicate_fraction: flag a split where more than this fraction of the examples repeat an earlier one.
    Default 0 (any duplicate), as deepchecks' ``DataDuplicates`` condition.
  max_leakage_fraction: flag when more than this fraction of eval examples appear in train. Default 0: any
    exact overlap invalidates the eval (deepchecks warns only at 5%).
  scale_range: float inputs whose root-mean-square ``sqrt(mean**2 + std**2)`` lies outside this range are
    flagged as unnormalized. Default (0.01, 10): inputs should be roughly zero mean and unit variance (LeCun
    et al., "Efficient BackProp", 1998, section 4.3); raw 0..255 pixels as floats have RMS ~85, pixels
    divided by 255 twice ~0.001.
  integer_features: whether integer inputs are numeric features (checked for scale: a max above 1 means raw
    values such as 0..255 pixels) or ids (tokens, categories; not checked). None (default): uint8 inputs
    are features (pixels), other integer dtypes are ids.
  max_indices: how many example indices each finding lists.
  apply_examples: how many examples ``apply`` sees.
  chunk_bytes: rows are processed in chunks of about this many bytes.
  outlier_ratio: ``data.outliers`` flags rows of a numeric feature input whose largest absolute value is more
    than this many times the median row's (rows of zeros excluded). Default 100: two orders of magnitude,
    far outside the ~5x spread of row maxima of standardised data (the max of 784 unit normals is about 3.2
    +- 0.4) and the 1.5 IQR fences of Tukey's boxplot rule, so only scale errors, sentinels or corrupt rows
    reach it."""
if check_data.__doc__:  # None under python -OO
    check_data.__doc__ = check_data.__doc__.replace("{args}", textwrap.indent(_ARGS_DOC, "    ").lstrip())


@dataclasses.dataclass(frozen=True)
class _DataCheck:
    """The arguments of :func:`check_data` after ``checked()``, and the check itself (``run``). Not jit-safe."""

    num_classes: int | None
    inputs: Any
    labels: Any
    mask: Any
    apply: Callable | None
    params: Any
    max_batches: int | None
    max_seconds: float | None
    max_imbalance_ratio: float
    max_duplicate_fraction: float
    max_leakage_fraction: float
    scale_range: tuple[float, float]
    integer_features: bool | None
    max_indices: int
    apply_examples: int
    chunk_bytes: int
    outlier_ratio: float

    def checked(self) -> _DataCheck:
        """These arguments with the ints made Python ints; raises on a bad one, in argument order."""
        fn = "check_data"
        num_classes = require_int(fn, "num_classes", self.num_classes, min=1, optional=True)
        max_batches = require_int(fn, "max_batches", self.max_batches, min=1, optional=True)
        for name in ("inputs", "labels", "mask"):
            handle = getattr(self, name)
            if not (handle is None or isinstance(handle, str) or callable(handle)):
                raise DataError(
                    f"check_data({name}=...): expected a function batch -> array, a dict key (str) or "
                    f"None, got {type(handle).__name__} {handle!r:.60}. Fix: pass {name}='key' or "
                    f"{name}=lambda batch: ...."
                )
        require_callable(fn, "apply", self.apply, signature="(params, inputs) -> predictions", optional=True)
        if self.max_seconds is not None:
            require_float(fn, "max_seconds", self.max_seconds, min=0.0)
        require_float(fn, "max_imbalance_ratio", self.max_imbalance_ratio, min=1.0)
        require_float(fn, "max_duplicate_fraction", self.max_duplicate_fraction, min=0.0, max=1.0)
        require_float(fn, "max_leakage_fraction", self.max_leakage_fraction, min=0.0, max=1.0)
        require_float(fn, "outlier_ratio", self.outlier_ratio, min=1.0)
        _check_scale_range(self.scale_range)
        if self.integer_features is not None:
            require_bool(fn, "integer_features", self.integer_features)
        return dataclasses.replace(
            self,
            num_classes=num_classes,
            max_batches=max_batches,
            max_indices=require_int(fn, "max_indices", self.max_indices, min=0),
            apply_examples=require_int(fn, "apply_examples", self.apply_examples, min=1),
            chunk_bytes=require_int(fn, "chunk_bytes", self.chunk_bytes, min=1),
        )

    def run(self, train: Any, eval: Any) -> Diagnosis:
        """Scan each split once, then its findings, its duplicates, and eval against train."""
        opts = dict(
            num_classes=None if self.num_classes is None else int(self.num_classes),
            inputs=self.inputs,
            labels=self.labels,
            mask=self.mask,
            integer_features=self.integer_features,
            chunk_bytes=self.chunk_bytes,
            apply=self.apply,
            params=self.params,
            apply_examples=self.apply_examples,
        )
        k = self.max_indices
        diagnosis = Diagnosis(name="data")
        findings: list[Finding] = []
        read = dict(max_seconds=self.max_seconds)
        train_split = scan_split(train, "train", self.max_batches, k, opts, findings, **read)
        eval_split = scan_split(eval, "eval", self.max_batches, k, opts, findings, **read) if eval is not None else None
        splits = [s for s in (train_split, eval_split) if s is not None]
        train_sorted = None
        for split in splits:
            findings += split_findings(split, opts, self.max_imbalance_ratio, self.scale_range, self.outlier_ratio)
            dup, sorted_ = find_duplicates(split, self.max_duplicate_fraction, k, self.inputs)
            findings += dup
            if split is train_split:
                train_sorted = sorted_
        if eval_split is not None:
            findings += compare_splits(train_split, eval_split)
            findings += find_leakage(train_split, eval_split, train_sorted, self.max_leakage_fraction, k, self.inputs)
        diagnosis.add(findings)
        diagnosis.artifacts["data"] = {s.what: _summary(s) for s in splits}
        diagnosis.artifacts["nonfinite_batches"] = {
            s.what: s.nonfinite_batch for s in splits if s.nonfinite_batch is not None
        }
        return diagnosis


def _check_scale_range(scale_range: Any) -> None:
    if (
        isinstance(scale_range, (str, bytes))
        or not hasattr(scale_range, "__len__")
        or len(scale_range) != 2
        or not all(
            isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool) for v in scale_range
        )
        or not 0 <= scale_range[0] < scale_range[1]
    ):
        raise DataError(
            f"check_data(scale_range=...): expected (low, high) with 0 <= low < high, got "
            f"{scale_range!r:.60}. Fix: pass e.g. scale_range=(1e-2, 10.0)."
        )


def _summary(split: Split) -> dict[str, Any]:
    out: dict[str, Any] = {"rows": split.rows, "batches": split.batches, "stream": split.stream}
    if split.stream:
        out["seconds"] = round(split.seconds, 3)
        out["stopped"] = (
            "epoch"
            if split.epoch is not None
            else "time"
            if split.partial and split.timed_out
            else "batches"
            if split.partial
            else "end"
        )
    if split.class_counts.size:
        out["class_counts"] = split.class_counts.tolist()
    out["inputs"] = {}
    for path, st in split.stats.items():
        if st.n:
            mean = st.s / st.n
            out["inputs"][path] = {
                "dtype": str(st.dtype),
                "min": st.lo,
                "max": st.hi,
                "mean": mean,
                "std": math.sqrt(max(st.ss / st.n - mean * mean, 0.0)),
            }
    return out


def judge_masked_nonfinite(
    findings: list[Finding], loss: Callable | None, params: Any, splits: dict[str, Any], max_batches: int = 20
) -> list[Finding]:
    """Demote ``nonfinite.input`` to ``data.masked_nonfinite`` (info) where the loss masks the NaNs.

    Data sets mark missing labels with NaN (OGB style) and the loss masks them out. For each split
    (``{"train": data, "eval": data}``) with a ``nonfinite.input`` finding, the loss at init is
    evaluated on the first of its batches (up to ``max_batches``) that holds non-finite floats: a
    finite loss means the NaNs never reach it, and the finding becomes info; a non-finite loss (or
    no loss handle, or no such batch found) keeps the error. Not jit-safe.
    """
    from .._experiment.batches import iter_batches

    if loss is None or not any(f.code == "nonfinite.input" for f in findings):
        return findings
    masked: set[str] = set()
    for what, data in splits.items():
        if data is None or not any(
            f.code == "nonfinite.input" and str(f.path or "").startswith(what) for f in findings
        ):
            continue
        try:
            batch = next((b for b in iter_batches(data, max_batches, what) if _holds_nonfinite(b)), None)
            value = None if batch is None else float(quick_jit(loss)(params, batch))
        except Exception:  # a loss that cannot run on this batch decides nothing here
            value = None
        if value is not None and math.isfinite(value):
            masked.add(what)
    out = []
    for f in findings:
        split = str(f.path or "").split(" ", 1)[0]
        if f.code == "nonfinite.input" and split in masked:
            f = Finding(
                "data.masked_nonfinite",
                f"{f.message}; the loss at init is finite on them, so the loss "
                "masks them (e.g. NaN marking missing labels)",
                "nothing to do if that is intended; "
                "guard reports such values only when an output of the step goes non-finite",
                path=f.path,
                extra=dict(f.extra or {}),
            )
        out.append(f)
    return out


def _holds_nonfinite(batch: Any) -> bool:
    return any(
        np.asarray(x).dtype.kind in "fc" and not np.isfinite(np.asarray(x)).all()
        for x in jax.tree_util.tree_leaves(batch)
    )
