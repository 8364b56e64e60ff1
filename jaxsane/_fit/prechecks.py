"""fit's checks before the first step and its report side: the eval batches against the train batch
(:func:`check_eval_data`: a model fitted to one must run on the other), the checks it can run first
(``fit(..., checks=True)``: the overfit sweep and the init-scale sweep, whose plots the report then shows)
and the run metadata it records for the report and the JSON (steps, wall time, seconds per stage,
checkpoint directory, best step). Host-side, not jit-safe."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import jax

from .._core.diagnosis import Diagnosis
from .._core.errors import DataError
from .._core.finding import Finding
from .._experiment.batch_match import batch_mismatch, cause_text, layout
from .._experiment.contract import PureExperiment


def check_eval_data(adapted: PureExperiment, batches: Iterator[tuple[int, Any]], eval_batches: list) -> list:
    """Before the first step: each eval batch against the first train batch, peeked from ``batches`` (returned
    as ``[(index, batch)]`` for the loop to step first, or ``[]`` when the data is empty).

    Raises :class:`DataError` naming both batches' leaves when an eval batch has a leaf of another rank or dtype
    kind, or another structure or per-example shape on which ``Experiment.loss`` cannot run (it is traced, not
    run); a shape the loss accepts (a longer sequence) passes (see :func:`batch_mismatch`). Not jit-safe."""
    first = next(batches, None)
    if first is None:
        return []
    index, train = first
    seen: set = set()
    loss, params = adapted.loss_fn, adapted.params(adapted.example_state)
    trace = (lambda b: jax.eval_shape(loss, params, b)) if loss is not None else None
    for j, eval_batch in enumerate(eval_batches):
        key = repr(layout(eval_batch))
        if key in seen:
            continue
        seen.add(key)
        problem, cause = batch_mismatch(train, eval_batch, "train", trace)
        if problem:
            raise DataError(
                f"[jaxsane] fit: eval batch {j} does not match train batch {index}: {problem}. A model fitted "
                "to the train batches cannot be evaluated on it"
                + (f"; Experiment.loss fails on it{cause_text(cause)}" if cause else "")
                + ". Fix: load both splits with the same preprocessing (same keys, feature columns, resize, "
                "padding length and dtype cast)."
            ) from cause
    return [first]


# the doctor's overfit defaults (seconds on a small model): one batch of 16, 2 seeds, 300 steps
CHECK_SEEDS, CHECK_STEPS, CHECK_BATCH = 2, 300, 16


def run_checks(adapted: PureExperiment, diagnosis: Diagnosis, timings: dict, progress: bool) -> None:
    """The overfit sweep and the init-scale sweep on the first train batch, before training: their findings
    go into ``diagnosis``, their results into ``artifacts["overfit"]``/``["init_scales"]`` (the report draws
    them), their seconds into ``timings``. A check that needs a missing handle (no ``loss``) is skipped
    with a ``doctor.skipped`` info finding saying why."""
    from .._checks.init_sweep import init_scale_sweep
    from .._overfit.overfit import overfit

    if adapted.loss_fn is None:
        diagnosis.add(
            Finding(
                "doctor.skipped",
                "fit(checks=True): the overfit and init-scale sweeps need Experiment.loss, which is missing",
                "pass Experiment(loss=...)",
                severity="info",
            )
        )
        return
    t = time.perf_counter()
    result = overfit(adapted, seeds=CHECK_SEEDS, steps=CHECK_STEPS, batch_size=CHECK_BATCH, progress=progress)
    timings["overfit"] = time.perf_counter() - t
    diagnosis.add(result.findings)
    diagnosis.artifacts["overfit"] = result
    t = time.perf_counter()
    diagnosis.artifacts["init_scales"] = init_scale_sweep(adapted, scales=(0.5, 1.0, 2.0), progress=progress)
    timings["init_scales"] = time.perf_counter() - t


def record_meta(
    diagnosis: Diagnosis,
    *,
    steps: int,
    position: int,
    started: float,
    timings: dict,
    checkpoint_dir: str | None,
    metrics_path: str | None,
    loop: dict,
    resumed_from: int | None,
    stopped_early: bool,
    skipped: list,
    error: BaseException | None,
) -> None:
    """``diagnosis.artifacts["meta"]``: what the report's metadata block and the JSON's ``meta`` show."""
    wall = time.perf_counter() - started
    stages = dict(timings)
    stages["train"] = max(0.0, wall - sum(timings.values()))
    meta: dict[str, Any] = {
        "steps": position,
        "steps_requested": steps,
        "wall_seconds": round(wall, 3),
        "timings": stages,
        "resumed_from": resumed_from,
        "checkpoint_dir": checkpoint_dir,
        "metrics_path": metrics_path,
        "best_step": loop.get("best_step"),
        "best_eval_loss": loop.get("best"),
        "stopped_early": stopped_early,
        "rollbacks": loop.get("rollbacks", 0),
        "skipped_batches": list(skipped),
    }
    if error is not None:
        meta["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    diagnosis.artifacts["meta"] = meta
