"""doctor's short guarded run: a few real steps under :func:`guard`, NaNs caught and named."""

from __future__ import annotations

from typing import Iterable

import jax
import numpy as np

from ._errors import NonFiniteError
from ._experiment import iter_batches
from ._findings import Finding
from ._guard import guard


def run_stage(ctx) -> Iterable[Finding]:
    """doctor stage: ``run_steps`` (default 30) guarded steps on the train data; records the losses."""
    steps = int(ctx.option("run_steps", 30))
    adapted = ctx.adapted
    state = adapted.init(ctx.key)
    guarded = guard(jax.jit(adapted.step), on_nonfinite="raise")
    losses = []
    findings: list[Finding] = []
    try:
        for batch in iter_batches(ctx.experiment.train, steps):
            state, metrics = guarded(state, batch)
            losses.append(metrics.get("loss"))
        guarded.flush()
    except NonFiniteError as e:
        finding = e.finding
        findings.append(finding)
    ctx.diagnosis.artifacts["run"] = {"loss": [float(np.asarray(l)) for l in losses if l is not None]}
    return findings
