"""doctor's short guarded run: a few real steps under :func:`guard` and the training monitor.

NaNs are caught (and located, when :mod:`jaxsane._locate` is available); the dynamics are judged by
the ``train.*`` detectors of :mod:`jaxsane._monitor` on the recorded history, which is stored in
``diagnosis.artifacts["run"]`` (``History.to_dict()``) for the report.
"""

from __future__ import annotations

from typing import Iterable

import jax

from ._errors import NonFiniteError
from ._experiment import iter_batches
from ._findings import Finding
from ._guard import guard
from ._monitor import Monitor, check_training


def run_stage(ctx) -> Iterable[Finding]:
    """doctor stage: a short monitored, guarded run on the train data.

    Options (``doctor(..., name=value)``): ``run_steps`` (default 30) steps; ``run_eval_every``
    (default 5) evaluations of the loss on the first eval batch, when the Experiment has ``eval`` and
    ``loss``; ``run_dead_every`` (default 5) dead-ReLU samples (needs ``apply``); ``run_thresholds``
    (a dict) overrides for :func:`jaxsane.check_training`. Not jit-safe.
    """
    steps = int(ctx.option("run_steps", 30))
    eval_every = int(ctx.option("run_eval_every", 5))
    adapted = ctx.adapted
    state = adapted.init(ctx.key)
    monitor = Monitor(adapted, every=1, dead_every=int(ctx.option("run_dead_every", 5)), log_every=max(1, steps))
    guarded = guard(monitor.compiled_step, on_nonfinite="raise")
    eval_loss = None
    if ctx.eval_batch is not None and adapted.loss_fn is not None and eval_every > 0:
        eval_loss = jax.jit(adapted.loss_fn)
    findings: list[Finding] = []
    failed = False
    try:
        if eval_loss is not None:
            monitor.record_eval(0, float(eval_loss(adapted.params(state), ctx.eval_batch)))
        for i, batch in enumerate(iter_batches(ctx.experiment.train, steps)):
            state, metrics = guarded(state, batch, monitor.mode_for(i))
            monitor.record(i, metrics, state, batch)
            if eval_loss is not None and (i + 1) % eval_every == 0:
                guarded.flush()
                monitor.record_eval(i + 1, float(eval_loss(adapted.params(state), ctx.eval_batch)))
        guarded.flush()
    except NonFiniteError as e:
        findings.append(e.finding)
        failed = True
    history = monitor.pull()
    ctx.diagnosis.artifacts["run"] = history.to_dict()
    if not failed:  # after a NaN the dynamics are moot: the NaN is the story
        findings.extend(check_training(history, **dict(ctx.option("run_thresholds", {}) or {})))
    return findings
