"""fit's report side: the checks it can run first (``fit(..., checks=True)``: the overfit sweep and the
init-scale sweep, whose plots the report then shows) and the run metadata it records for the report and
the JSON (steps, wall time, seconds per stage, checkpoint directory, best step). Host-side, not jit-safe."""

from __future__ import annotations

import time
from typing import Any

from .._core.diagnosis import Diagnosis
from .._core.finding import Finding
from .._experiment.contract import PureExperiment

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
