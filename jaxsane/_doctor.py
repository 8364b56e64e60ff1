"""doctor: the whole sanity checklist on one Experiment, in the order a careful engineer runs it.

Each stage is a function ``stage(ctx) -> Iterable[Finding]`` living in the module of its concept;
this module only orders them, shows progress and collects the :class:`Diagnosis`. A stage whose
handles are missing is skipped with an info finding. Not jit-safe.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import time
import traceback
from typing import Any, Callable, Iterable

import jax

from ._errors import JaxsaneError
from ._experiment import Adapted, Experiment, first_batch, replayable
from ._findings import Diagnosis, Finding

# (name, "module:function", what it checks) — in checklist order. A stage module that is not
# importable (an optional dependency missing) is skipped with an info finding.
STAGES: list[tuple[str, str, str]] = [
    ("data", "jaxsane._data:data_stage", "data: shapes, labels, leakage, duplicates, padding, scale"),
    ("init", "jaxsane._init:init_stage", "init: loss at init against ln C, activation scale, symmetric units"),
    ("grads", "jaxsane._grads:grads_stage", "gradients: autodiff vs finite differences, per leaf"),
    ("step", "jaxsane._step_checks:step_stage", "the step: updates, optimizer state, randomness, compiles once"),
    ("batch", "jaxsane._batch:batch_stage", "batch independence: VJP of one example's output"),
    ("overfit", "jaxsane._overfit:overfit_stage", "overfit one small batch (vmapped sweep)"),
    ("run", "jaxsane._run:run_stage", "a short guarded run"),
]


@dataclasses.dataclass
class DoctorContext:
    """What every stage can use. ``adapted`` gives the pure step; ``batch`` is the first train batch."""

    experiment: Experiment
    adapted: Adapted
    key: jax.Array
    batch: Any
    eval_batch: Any
    diagnosis: Diagnosis
    options: dict[str, Any]

    def option(self, name: str, default: Any = None) -> Any:
        return self.options.get(name, default)


def _load_stage(target: str) -> Callable[[DoctorContext], Iterable[Finding]]:
    module, _, fn = target.partition(":")
    return getattr(importlib.import_module(module), fn)


def doctor(experiment: Experiment, *, stages: Iterable[str] | None = None, skip: Iterable[str] = (),
           key: jax.Array | None = None, progress: bool = True, **options: Any) -> Diagnosis:
    """Run the sanity checklist on ``experiment`` and return a :class:`Diagnosis`.

    Args:
      experiment: the :class:`Experiment` to check.
      stages: names of the stages to run (default: all, see ``jaxsane._doctor.STAGES``).
      skip: names of stages not to run.
      key: PRNG key for init and the checks (default ``jax.random.key(0)``).
      progress: show a spinner per stage on stderr.
      **options: per-stage settings (e.g. ``run_steps=20``), documented by each stage.

    Not jit-safe.

    Example:
      >>> from jaxsane.examples import load
      >>> diagnosis = doctor(load("digits_optax"), progress=False)  # doctest: +SKIP
    """
    if not isinstance(experiment, Experiment):
        raise JaxsaneError(f"doctor needs a jaxsane.Experiment, got {type(experiment).__name__}. Build one with "
                           "jaxsane.Experiment(init=..., step=..., train=...).")
    known = [name for name, _, _ in STAGES]
    chosen = list(stages) if stages is not None else known
    unknown = [s for s in [*chosen, *skip] if s not in known]
    if unknown:
        raise JaxsaneError(f"unknown doctor stage(s) {unknown}; the stages are {known}.")
    key = jax.random.key(0) if key is None else key
    # generators can be read once: cache what the stages read, so each stage starts from the first batch
    experiment = dataclasses.replace(experiment, train=replayable(experiment.train),
                                     eval=replayable(experiment.eval))
    diagnosis = Diagnosis(name=experiment.name)
    adapted = Adapted(experiment, key=key)
    eval_batch = first_batch(experiment.eval, "eval") if experiment.eval is not None else None
    ctx = DoctorContext(experiment, adapted, key, first_batch(experiment.train, "train"), eval_batch,
                        diagnosis, options)
    timings = {}
    for name, target, description in STAGES:
        if name not in chosen or name in skip:
            continue
        start = time.perf_counter()
        with _spinner(progress, f"[jaxsane] {experiment.name}: {description}"):
            try:
                stage = _load_stage(target)
            except (ImportError, AttributeError) as e:
                diagnosis.add(Finding("doctor.skipped", f"stage {name!r} unavailable: {e}", ""))
                continue
            try:
                diagnosis.add(stage(ctx))
            except JaxsaneError as e:
                diagnosis.add(Finding("doctor.skipped", f"stage {name!r} could not run: {e}",
                                      "fix the Experiment as the message says, then run doctor again",
                                      severity="warning"))
            except Exception as e:  # a stage bug or a user-code crash: report, keep the other stages
                where = traceback.extract_tb(e.__traceback__)[-1]
                diagnosis.add(Finding("doctor.skipped", f"stage {name!r} crashed: {type(e).__name__}: {e} "
                                      f"({where.filename}:{where.lineno})",
                                      "if the crash is in your code, fix it; otherwise report a jaxsane bug",
                                      severity="warning"))
        timings[name] = time.perf_counter() - start
    diagnosis.artifacts["timings"] = timings
    return diagnosis


class _spinner:
    """A rich status spinner on stderr when ``enabled`` and stderr is a terminal; else nothing."""

    def __init__(self, enabled: bool, text: str):
        self._status = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            self._status = Console(stderr=True).status(text)

    def __enter__(self):
        if self._status is not None:
            self._status.__enter__()
        return self

    def __exit__(self, *exc):
        if self._status is not None:
            self._status.__exit__(*exc)
        return False
