"""Data checks: label range, shapes across batches, non-finite inputs."""

from __future__ import annotations

from typing import Any, Iterable

import jax
import numpy as np

from ._experiment import Experiment, get_inputs, get_labels, iter_batches
from ._findings import Finding
from ._tree import is_inexact, leaves_with_paths


def _first_indices(mask: np.ndarray, n: int = 5) -> list[int]:
    return np.flatnonzero(mask)[:n].tolist()


def basic_data_checks(exp: Experiment, *, max_batches: int = 20) -> list[Finding]:
    """Shapes/dtypes consistent across batches, labels in range, inputs finite. Not jit-safe."""
    findings: list[Finding] = []
    signature = None
    offset = 0
    for b, batch in enumerate(iter_batches(exp.train, max_batches)):
        sig = [(p, np.shape(x)[1:], np.asarray(x).dtype.str) for p, x in leaves_with_paths(batch, "batch")]
        if signature is None:
            signature = sig
        elif sig != signature:
            findings.append(Finding("data.shape", f"batch {b} has shapes/dtypes {sig} but batch 0 had {signature}",
                                    "make every batch the same per-example shape and dtype (pad, cast)",
                                    path=f"batch {b}"))
            break
        for path, x in leaves_with_paths(batch, "batch"):
            if is_inexact(x):
                bad = ~np.isfinite(np.asarray(x)).reshape(len(x), -1).all(axis=1) if np.ndim(x) else \
                    ~np.isfinite(np.asarray(x)).reshape(1)
                if bad.any():
                    findings.append(Finding("nonfinite.input", f"{int(bad.sum())} examples of {path} hold NaN/Inf "
                                            f"(first indices {[offset + i for i in _first_indices(bad)]})",
                                            "drop or repair these rows in the data pipeline", path=path))
        if exp.num_classes is not None:
            try:
                labels = np.asarray(get_labels(exp, batch))
            except Exception:
                labels = None
            if labels is not None and labels.dtype.kind in "iu":
                bad = (labels < 0) | (labels >= exp.num_classes)
                if bad.any():
                    findings.append(Finding(
                        "data.label_range", f"{int(bad.sum())} labels outside [0, {exp.num_classes}) in batch {b} "
                        f"(min {labels.min()}, max {labels.max()}; first indices "
                        f"{[offset + i for i in _first_indices(bad.reshape(-1))]})",
                        "labels must be 0..num_classes-1: fix an off-by-one (1-based labels) or num_classes",
                        path="labels"))
        offset += len(jax.tree_util.tree_leaves(batch)[0]) if np.ndim(jax.tree_util.tree_leaves(batch)[0]) else 1
    # de-duplicate repeated findings of the same code and path
    seen, unique = set(), []
    for f in findings:
        if (f.code, f.path) not in seen:
            seen.add((f.code, f.path))
            unique.append(f)
    return unique


def data_stage(ctx) -> Iterable[Finding]:
    """doctor stage: basic data sanity on the train batches."""
    get_inputs(ctx.experiment, ctx.batch)  # raises a clear DataError when inputs cannot be found
    return basic_data_checks(ctx.experiment)
