"""doctor's step-stage check for updates that round away: a few real steps beside their float32 shadow steps
(see ``underflow.py``), judged per parameter leaf. Host-side driver of compiled steps; not jit-safe."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .._core.finding import Finding
from .._core.tree import is_inexact, leaves_with_paths
from .._experiment.contract import PureExperiment
from .underflow import has_low_precision, shadow_lost_fractions, shadow_supported, underflow_finding

DEFAULT_FRACTION = 0.25


def check_step_underflow(
    adapted: PureExperiment, batch: Any, *, key: jax.Array | None = None, calls: int = 3,
    fraction: float = DEFAULT_FRACTION,
) -> list[Finding]:  # fmt: skip
    """``train.update_underflow`` when, over ``calls`` steps on ``batch``, a bf16/fp16 parameter leaf's median
    fraction of updates lost to rounding is at least ``fraction``; ``doctor.skipped`` (info) when the model
    has low-precision parameters but its step cannot run on a float32-upcast state. Empty for a float32
    model (nothing runs). Not jit-safe."""
    key = jax.random.key(0) if key is None else key
    state = adapted.init(key)
    params = adapted.params(state)
    if not has_low_precision(params):
        return []
    if not shadow_supported(adapted.step, state, batch, adapted.params):
        return [
            Finding(
                "doctor.skipped",
                "update underflow not checked: the step does not run on a state upcast to float32 (its float32 "
                "shadow step is how a rounded-away update is told from a zero one)",
                "fit/Monitor still measure it with the gradient proxy when Experiment.loss is given",
            )
        ]

    def measured(state, batch):
        new_state, _ = adapted.step(state, batch)
        lost = shadow_lost_fractions(adapted.step, adapted.params, state, batch, adapted.params(new_state))
        return new_state, lost

    run = jax.jit(measured)
    rows = []
    for _ in range(int(calls)):
        state, lost = run(state, batch)
        rows.append(np.asarray(lost, np.float64))
    table = np.where(np.stack(rows) < 0, np.nan, np.stack(rows))
    with np.errstate(all="ignore"):
        med = [float(np.nanmedian(c)) if np.isfinite(c).any() else float("nan") for c in table.T]
    paths = [p for p, x in leaves_with_paths(params, "params") if is_inexact(x)]
    found = underflow_finding(paths, med, len(rows), fraction)
    return [found] if found is not None else []
