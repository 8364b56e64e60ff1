"""The findings of :func:`jaxsane.check_data` read off the accumulators of a scanned split:
``data.partial``, ``data.empty``, ``data.shape``, ``nonfinite.input``, ``data.label_range``,
``data.imbalance``, ``data.epoch``, ``data.unshifted_targets``, ``data.all_padding``,
``data.constant``, ``data.unnormalized`` and ``data.outliers``; and train against eval
(``data.shape``).

Nothing here runs inside ``jit``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._core.finding import Finding
from .split import Flags, LeafStats, Split, is_feature


def compare_splits(train: Split, eval_: Split) -> list[Finding]:
    """``data.shape`` when train and eval inputs (or labels) differ in structure, per-example shape or
    dtype: a model fitted to one cannot be evaluated on the other."""
    out: list[Finding] = []
    for what, a, b in (
        ("inputs", train.input_signature, eval_.input_signature),
        ("labels", train.label_signature, eval_.label_signature),
    ):
        if a is None or b is None or a == b:
            continue
        if [p for p, _, _ in a] != [p for p, _, _ in b]:
            out.append(
                Finding(
                    "data.shape",
                    f"the eval {what} have leaves {[p for p, _, _ in b]} but the train "
                    f"{what} have {[p for p, _, _ in a]}",
                    f"give both splits the same {what} structure (same keys, same order)",
                    path=f"eval {what}",
                )
            )
            continue
        for (p, sa, da), (_, sb, db) in zip(a, b):
            if (sa, da) == (sb, db):
                continue
            kind_change = da.kind != db.kind or len(sa) != len(sb)
            padded_length = sa != sb and not kind_change and (train.padded or eval_.padded)
            width_only = sa == sb and not kind_change  # float32 against float64, int32 against int64
            if width_only and not jax.config.jax_enable_x64:  # type: ignore[attr-defined]  # a flag jax sets at run time; not in its stubs
                continue  # jax canonicalises both to 32 bits: the same program runs on both splits
            severity = "warning" if (padded_length or width_only) else "error"
            why = (
                "each new length recompiles the jitted eval step"
                if padded_length
                else "the eval runs at another precision and recompiles"
                if width_only
                else "a model fitted to the train shape cannot run, or silently broadcasts, on the eval shape"
            )
            out.append(
                Finding(
                    "data.shape",
                    f"eval {what} {p} has per-example shape {sb} dtype {db} but train "
                    f"{what} {p} has shape {sa} dtype {da}: {why}",
                    "load both splits with the same preprocessing (same feature columns, resize, "
                    "padding length and dtype cast)",
                    path=f"eval {p}",
                    severity=severity,
                    extra={"train": [list(sa), str(da)], "eval": [list(sb), str(db)]},
                )
            )
            break  # one finding per kind of leaf is enough to point at the preprocessing
    return out


def _first(idx: np.ndarray, k: int) -> list[int]:
    return [int(i) for i in idx[:k]]


def _idx(flags: Flags) -> str:
    return f"first indices {flags.first}"


def _outliers(split: Split, ratio: float) -> list[Finding]:
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
        out.append(
            Finding(
                "data.outliers",
                f"{count} of {split.rows} {split.what} examples have values in {path} "
                f"more than {ratio:g}x the typical row's scale (max |value| up to {float(scale[idx].max()):.4g} "
                f"against a median row max of {median:.3g}; first indices {idx[: split.k].tolist()}, "
                f"largest at {top.tolist()})",
                "inspect these rows: a unit or scaling error, a sentinel value (e.g. -9999 for missing), "
                "or corrupt records; clip, fix or drop them. A few such rows can overflow the loss "
                "(NaN) only when a batch first draws them",
                severity="warning",
                path=f"{split.what} {path}",
                extra={
                    "count": count,
                    "indices": idx[: split.k].tolist(),
                    "median_scale": median,
                    "max_scale": float(scale[idx].max()),
                },
            )
        )
    return out


@dataclasses.dataclass(frozen=True)
class _Judge:
    """What the rules of one split read: the split's accumulators and the thresholds."""

    split: Split
    num_classes: int | None
    apply: Any
    integer_features: bool | None
    max_ratio: float
    scale_range: tuple[float, float]
    outlier_ratio: float

    @property
    def w(self) -> str:
        return self.split.what


def split_findings(
    split: Split, opts: dict, max_ratio: float, scale_range: tuple[float, float], outlier_ratio: float = 100.0
) -> list[Finding]:
    """The findings of one scanned split (see the module docstring), in the order of :data:`_RULES`.
    Not jit-safe."""
    judge = _Judge(
        split, opts["num_classes"], opts["apply"], opts["integer_features"], max_ratio, scale_range, outlier_ratio
    )
    out = _partial(judge)
    if split.rows == 0:
        return out + _empty_split(judge)
    for rule in _RULES:
        out += rule(judge)
    return out


def _partial(j: _Judge) -> list[Finding]:
    split = j.split
    if not split.partial:
        return []
    why = (
        f"reading stopped at the time limit after {split.seconds:.1f} s"
        if split.timed_out
        else "reading stopped at the batch limit"
    )
    return [
        Finding(
            "data.partial",
            f"the {j.w} stream has more than {split.batches} batches; {why}, so only these "
            f"first {split.batches} batches ({split.rows} examples) were checked",
            "read more (or fewer): check_data(max_batches=N, max_seconds=S), in doctor the options "
            "data_max_batches and data_max_seconds",
            severity="info",
            path=j.w,
            extra={"batches": split.batches, "rows": split.rows, "seconds": round(split.seconds, 3)},
        )
    ]


def _empty_split(j: _Judge) -> list[Finding]:
    return [
        Finding(
            "data.empty",
            f"the {j.w} split has 0 examples ({j.split.batches} batch(es), every one with a leading axis of size 0)",
            "check the filter, split or shard that produced it; an empty split makes every mean a 0/0 NaN",
            path=j.w,
        )
    ]


def _empty_batches(j: _Judge) -> list[Finding]:
    split, w = j.split, j.w
    if not split.empty_batches.count:
        return []
    return [
        Finding(
            "data.empty",
            f"{split.empty_batches.count} {w} batches have 0 examples (batches "
            f"{split.empty_batches.first}): a mean over them is 0/0 = NaN",
            "drop empty batches (or the filter/shard that empties them) before the step",
            severity="warning",
            path=w,
            extra={"batches": split.empty_batches.first},
        )
    ]


def _shape_changes(j: _Judge) -> list[Finding]:
    split, w = j.split, j.w
    out: list[Finding] = []
    if split.shape_errors.count:
        out.append(
            Finding(
                "data.shape",
                f"{split.shape_errors.count} {w} batches change per-example shape/dtype: "
                f"{split.shape_detail} (batches {split.shape_errors.first})",
                "make every batch the same structure, per-example shape and dtype (cast, pad)",
                path=w,
                extra={"batches": split.shape_errors.first},
            )
        )
    if split.shape_warnings.count:
        out.append(
            Finding(
                "data.shape",
                f"{split.shape_warnings.count} {w} batches change a per-example size: "
                f"{split.shape_warning_detail} (batches {split.shape_warnings.first}); each new shape "
                "recompiles the jitted step",
                "pad to one fixed length (or a few bucket lengths)",
                severity="warning",
                path=w,
            )
        )
    return out


def _nonfinite(j: _Judge) -> list[Finding]:
    w, n = j.w, j.split.rows
    return [
        Finding(
            "nonfinite.input",
            f"{fl.count} of {n} {w} examples hold NaN/Inf in {path} ({_idx(fl)})",
            "drop or repair these rows in the data pipeline (check for division by "
            "zero or missing values before normalisation)",
            path=f"{w} {path}",
            extra={"count": fl.count, "indices": fl.first},
        )
        for path, fl in j.split.nonfinite.items()
    ]


IGNORE_INDEXES = (-100, -1, 255)  # the ignore labels of PyTorch/Hugging Face, of "unlabelled", of segmentation masks


def _ignore_index(lo: float, hi: float, classes: int | None, some_valid: bool) -> bool:
    """Whether the out-of-range labels are one value that reads as an ignore index: a single known one
    (:data:`IGNORE_INDEXES`), or any single negative value or one at twice the classes or more, beside valid
    labels. Labels off by one (1..C for C classes) are C itself: never one."""
    if not (some_valid and lo == hi and classes is not None):
        return False
    return int(lo) in IGNORE_INDEXES or lo < 0 or lo >= 2 * classes


def _label_range(j: _Judge) -> list[Finding]:
    split, w, n, C = j.split, j.w, j.split.rows, j.num_classes
    out: list[Finding] = []
    # valid labels beside the one value out of range: whole examples without it, or (sequence labels, an ignore
    # index at every unlabelled position of every row) class ids within the same examples
    some_valid = split.label_bad.count < n or split.label_in_range
    if split.label_bad.count and _ignore_index(split.label_lo, split.label_hi, C, some_valid):
        v = split.label_lo
        out.append(
            Finding(
                "data.label_range",
                f"{split.label_bad.count} of {n} {w} examples hold the label {v}, outside [0, {C}) and the only value "
                f"there: an ignore index ({_idx(split.label_bad)})? If the loss leaves it out, pass "
                f"Experiment(mask=lambda batch: labels != {v}) so the checks leave it out too; if not, it is a bug",
                f"mask the label {v} in the loss (and pass mask=), or fix the labels",
                severity="warning",
                path=f"{w} labels",
                extra={"count": split.label_bad.count, "indices": split.label_bad.first, "ignore_index": v},
            )
        )
    elif split.label_bad.count:
        rng = f"[0, {C})" if C is not None else "the non-negative integers"
        out.append(
            Finding(
                "data.label_range",
                f"{split.label_bad.count} of {n} {w} examples have labels outside "
                f"{rng} (offending values from {split.label_lo} to {split.label_hi}; "
                f"{_idx(split.label_bad)})",
                "labels must be 0..num_classes-1: fix 1-based labels (y - 1), an ignore index such as "
                "-100 (mask it instead), or num_classes",
                path=f"{w} labels",
                extra={"count": split.label_bad.count, "indices": split.label_bad.first},
            )
        )
    if split.label_float.count:
        out.append(
            Finding(
                "data.label_range",
                f"{w} labels have float dtype {split.label_dtype} although "
                f"num_classes={C} (all {split.label_float.count} examples): class labels should be "
                "integer ids",
                "cast them with labels.astype(np.int32) (and use integer-label cross "
                "entropy), or pass one-hot labels of shape (B, num_classes)",
                path=f"{w} labels",
                extra={"count": split.label_float.count},
            )
        )
    if split.label_soft_bad.count:
        out.append(
            Finding(
                "data.label_range",
                f"{split.label_soft_bad.count} of {n} {w} examples have one-hot/soft "
                f"labels outside [0, 1] ({_idx(split.label_soft_bad)})",
                "soft labels are probabilities: check the label smoothing / one-hot encoding",
                path=f"{w} labels",
            )
        )
    return out


def _label_column(j: _Judge) -> list[Finding]:
    split, w = j.split, j.w
    if split.label_column is None or j.apply is not None:
        return []
    return [
        Finding(
            "data.shape",
            f"{w} class-id labels have shape {split.label_column} (a trailing axis of "
            "1): against (B,) predictions or per-example losses they silently broadcast to (B, B)",
            "squeeze them to shape (B,) (labels[:, 0]); pass apply= to compare with the model's predictions",
            path=f"{w} labels",
            extra={"shape": split.label_column},
        )
    ]


def _imbalance(j: _Judge) -> list[Finding]:
    split, w, C, counts = j.split, j.w, j.num_classes, j.split.class_counts
    if not (counts.size >= 2 or (C is not None and C >= 2 and counts.size)):
        return []
    present = counts[counts > 0]
    missing = np.flatnonzero(counts == 0)
    ratio = float(present.max() / present.min()) if present.size else math.inf
    if missing.size and C is not None:
        return [
            Finding(
                "data.imbalance",
                f"{missing.size} of {C} classes never occur in the {w} labels "
                f"(classes {_first(missing, split.k)}; {counts.sum()} labelled examples)",
                "check the label mapping and num_classes, or stratify the split",
                path=f"{w} labels",
                extra={"class_counts": counts.tolist()},
            )
        ]
    if ratio <= j.max_ratio:
        return []
    big, small = (
        int(np.argmax(np.where(counts > 0, counts, -1))),
        int(np.argmin(np.where(counts > 0, counts, np.iinfo(np.int64).max))),
    )
    return [
        Finding(
            "data.imbalance",
            f"{w} class frequencies are skewed {ratio:.1f}:1 (class {big}: "
            f"{counts[big]} examples, class {small}: {counts[small]} of {counts.sum()}; "
            f"threshold {j.max_ratio:g}:1)",
            "re-weight the loss or resample, and check the labels for a mapping/sampling bug",
            path=f"{w} labels",
            extra={"class_counts": counts.tolist(), "ratio": ratio},
        )
    ]


def _epoch(j: _Judge) -> list[Finding]:
    split, w = j.split, j.w
    if split.epoch is None:
        return []
    return [
        Finding(
            "data.epoch",
            f"the {w} stream starts over after {split.epoch} examples (rows "
            f"{split.epoch}.. repeat earlier rows, in order or reshuffled): read as one epoch of {split.epoch} "
            f"examples ({split.batches} batches read); the repeat is an epoch boundary, not duplicated data",
            "-",
            severity="info",
            path=w,
            extra={"epoch_rows": split.epoch, "batches": split.batches},
        )
    ]


_SHIFT_PROBLEMS = (  # (the split's flags, what the targets do, the fix)
    (
        "seq_same",
        "equal the inputs at every position (next-token targets not shifted: the model is trained to copy its input)",
        "shift them: inputs = tokens[:, :-1], targets = tokens[:, 1:] (and the mask likewise); a decoder's "
        "teacher-forced inputs are the targets shifted right behind a BOS id: [BOS, y[:, :-1]]",
    ),
    (
        "seq_lag",
        "equal the inputs one position late (targets[:, 1:] == inputs[:, :-1]: shifted "
        "the wrong way, the model is trained to predict the previous token)",
        "shift the other way: inputs = tokens[:, :-1], targets = tokens[:, 1:]",
    ),
)


def _unshifted_targets(j: _Judge) -> list[Finding]:
    split, w = j.split, j.w
    out: list[Finding] = []
    if not split.seq_rows:
        return out
    for attr, what, fix in _SHIFT_PROBLEMS:
        flags = getattr(split, attr)
        if flags.count and flags.count * 2 >= split.seq_rows:
            out.append(
                Finding(
                    "data.unshifted_targets",
                    f"{flags.count} of {split.seq_rows} {w} token sequences have targets that {what} ({_idx(flags)})",
                    fix,
                    path=f"{w} labels",
                    extra={"count": flags.count, "indices": flags.first, "rows_compared": split.seq_rows},
                )
            )
    return out


def _all_padding(j: _Judge) -> list[Finding]:
    split, w, n = j.split, j.w, j.split.rows
    out: list[Finding] = []
    if split.padding_rows.count:
        out.append(
            Finding(
                "data.all_padding",
                f"{split.padding_rows.count} of {n} {w} examples are all padding "
                f"(mask all zero; {_idx(split.padding_rows)})",
                "drop empty sequences before batching; check the tokenizer, truncation and packing",
                path=f"{w} mask",
                extra={"count": split.padding_rows.count, "indices": split.padding_rows.first},
            )
        )
    if split.padding_batches.count:
        out.append(
            Finding(
                "data.all_padding",
                f"{split.padding_batches.count} {w} batches are entirely padding "
                f"(mask all zero; batches {split.padding_batches.first}): they train on nothing and "
                "make a masked mean 0/0",
                "drop empty batches; check the mask polarity (1 = real token)",
                path=f"{w} mask",
            )
        )
    return out


def _input_scale(j: _Judge) -> list[Finding]:
    """``data.constant`` and ``data.unnormalized`` per input leaf, then ``data.outliers``."""
    outliers = _outliers(j.split, j.outlier_ratio)
    outlier_paths = {f.path for f in outliers}
    out: list[Finding] = []
    for path, st in j.split.stats.items():
        if st.lo != math.inf:
            out += _leaf_scale(j, path, st, outlier_paths)
    return out + outliers  # their rows inflate the RMS: data.unnormalized is not reported beside them


def _leaf_scale(j: _Judge, path: str, st: LeafStats, outlier_paths: set[str | None]) -> list[Finding]:
    w, n, scale_range = j.w, j.split.rows, j.scale_range
    if st.lo == st.hi and n > 1:
        return [
            Finding(
                "data.constant",
                f"every {w} input in {path} is the same value {st.lo:g} (all {n} examples)",
                "the loader returns a placeholder (zeros?): check the decoding and preprocessing",
                path=f"{w} {path}",
            )
        ]
    if st.dtype.kind in "iu" and is_feature(st.dtype, j.integer_features) and st.hi > 1:
        return [
            Finding(
                "data.unnormalized",
                f"{w} {path} is raw {st.dtype} in [{st.lo:g}, {st.hi:g}] fed as features (all {n} examples)",
                f"scale it to floats: x.astype(np.float32) / {st.hi:g} (or standardise to zero mean, unit variance)",
                path=f"{w} {path}",
            )
        ]
    if st.dtype.kind in "fc" and st.n:
        mean = st.s / st.n
        std = math.sqrt(max(st.ss / st.n - mean * mean, 0.0))
        rms = math.sqrt(max(st.ss / st.n, 0.0))
        if not (scale_range[0] <= rms <= scale_range[1]) and f"{w} {path}" not in outlier_paths:
            return [
                Finding(
                    "data.unnormalized",
                    f"{w} {path} has mean {mean:.3g}, std {std:.3g} (RMS {rms:.3g} "
                    f"outside [{scale_range[0]:g}, {scale_range[1]:g}]; all {n} examples)",
                    "standardise the inputs ((x - mean) / std over the train split) or scale pixels once by 1/255",
                    path=f"{w} {path}",
                    extra={"mean": mean, "std": std},
                )
            ]
    return []


def _constant_batches(j: _Judge) -> list[Finding]:
    split, w = j.split, j.w
    if not split.constant_batches.count:
        return []
    return [
        Finding(
            "data.constant",
            f"{split.constant_batches.count} of {split.batches} {w} batches have "
            f"constant inputs (one value throughout; batches {split.constant_batches.first})",
            "the loader returns a placeholder batch: check decoding, augmentation and the end of the stream",
            path=f"{w} inputs",
        )
    ]


# the rules of a non-empty split, in the order their findings are reported (after data.partial)
_RULES: tuple[Callable[[_Judge], list[Finding]], ...] = (
    _empty_batches,
    _shape_changes,
    _nonfinite,
    _label_range,
    _label_column,
    _imbalance,
    _epoch,
    _unshifted_targets,
    _all_padding,
    _input_scale,
    _constant_batches,
)
