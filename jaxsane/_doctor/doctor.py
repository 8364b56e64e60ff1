"""doctor: run the pipeline (``STAGES`` in ``_doctor/pipeline.py``) on one Experiment and say what it found.

This module checks the options before any work, runs each requested stage, shows progress and
collects a :class:`DoctorDiagnosis`, which records for every requested stage whether it ran
(and how long it took) or why not. doctor never passes what it could not check:

* a crash in the user's own code (init, step, loss, apply) is a ``doctor.user_code_crashed``
  error naming the exception and the user's ``file:line``;
* a step whose output is not ``(new_state, metrics)`` or ``new_state`` (e.g. only metrics) is a
  ``doctor.step_output`` error: such a step cannot train;
* a stage that cannot judge the program (a missing handle) is ``doctor.skipped`` with the reason;
  a crash inside jaxsane itself is a ``doctor.skipped`` warning that says "jaxsane bug".

:attr:`DoctorDiagnosis.passed` (the CLI's exit code 0) holds only when every requested stage ran
and no error was found. Not jit-safe.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import time
from collections.abc import Iterable
from typing import Any

import jax

from .._core.diagnosis import Diagnosis
from .._core.errors import ArgumentError, DoctorOptionError
from .._core.host_memory import Releaser
from .._experiment.batches import first_batch, replayable
from .._experiment.contract import Experiment, PureExperiment
from .._jaxpr.compile_cache import enable_compilation_cache
from .._render.progress import Progress
from .background import BACKGROUND, BackgroundPool, in_background
from .budget import plan_stages
from .options import resolve, select_stages
from .pipeline import PREPARE, RUN_ORDER, STAGES, Stage, StageContext, check_options
from .triage import CRASHED, FAILED, NOT_APPLICABLE, RAN, SKIPPED, Triage, step_output_problem, user_crash


class DoctorDiagnosis(Diagnosis):
    """A :class:`Diagnosis` that also records which requested stages ran, which did not and why.

    ``artifacts["stages"]`` is a list of ``{"name", "status", "reason", "seconds"}`` in checklist
    order (status ``ran``, ``not applicable`` (a handle it needs is missing), ``skipped``, ``crashed`` (the
    user's code) or ``failed`` (jaxsane)), each with ``requested`` (named in ``stages=``) and
    ``compiles``/``compile_seconds`` (XLA compilations and persistent-cache loads during the stage) and
    ``background_seconds`` (what doctor ran for it ahead, in its background threads, while earlier stages ran);
    ``artifacts["timings"]`` maps each stage to its seconds; ``artifacts["compiles"]`` counts those
    before the first stage (``setup``) and in doctor's background threads (later stages' work). All are in
    the JSON and the terminal summary. Not jit-safe.
    """

    @property
    def stages(self) -> list[dict[str, Any]]:
        return list(self.artifacts.get("stages", []))

    @property
    def complete(self) -> bool:
        """True when every requested stage ran. With the default stage list, a stage that is not
        applicable (a handle it needs is missing) is listed but does not count against it."""
        return all(
            s["status"] == RAN or (s["status"] == NOT_APPLICABLE and not s.get("requested")) for s in self.stages
        )

    @property
    def passed(self) -> bool:
        """True when every requested stage ran and no error was found (the CLI's exit code 0)."""
        return self.ok and self.complete

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["complete"] = self.complete
        d["stages"] = [
            dict(
                s,
                seconds=round(s["seconds"], 4),
                compile_seconds=round(s.get("compile_seconds", 0.0), 4),
                background_seconds=round(s.get("background_seconds", 0.0), 4),
            )
            for s in self.stages
        ]
        d["compiles"] = self.artifacts.get("compiles", {})
        d["timings"] = {k: round(v, 4) for k, v in self.artifacts.get("timings", {}).items()}
        d["compile_cache"] = self.artifacts.get("compile_cache")
        d["plan"] = self.artifacts.get("plan")
        return d

    def stage_lines(self) -> list[str]:
        """The stage summary: what ran and how long it took, what did not run and why."""
        ran = [s for s in self.stages if s["status"] == RAN]
        lines = list((self.artifacts.get("plan") or {}).get("lines", []))  # what doctor reduced, and why
        if ran:
            total = sum(s["seconds"] for s in self.stages)
            ahead = {s["name"] for s in ran if s.get("background_seconds", 0) >= 0.05}  # worth a mention
            lines.append(
                "stages run: "
                + ", ".join(
                    f"{s['name']} {s['seconds']:.1f} s"
                    + (f" (+{s['background_seconds']:.1f} s ahead)" if s["name"] in ahead else "")
                    for s in ran
                )
                + f" (total {total:.1f} s"
                + ("; ahead: run in the background while earlier stages ran)" if ahead else ")")
            )
            compiled = [s for s in ran if s.get("compiles")]
            if compiled:
                background = self.artifacts.get("compiles", {}).get("background", 0)
                lines.append(
                    "compiles per stage: "
                    + ", ".join(f"{s['name']} {s['compiles']} ({s['compile_seconds']:.1f} s)" for s in compiled)
                    + (f"; {background} in the background while they ran" if background else "")
                )
        for s in self.stages:
            if s["status"] != RAN:
                lines.append(
                    f"stage {s['name']} {'did not finish' if s['status'] == FAILED else s['status']}: {s['reason']}"
                )
        if not self.complete:
            missing = sum(
                s["status"] != RAN and (s["status"] != NOT_APPLICABLE or bool(s.get("requested"))) for s in self.stages
            )
            lines.append(
                f"incomplete: {missing} of {len(self.stages)} requested stages did not run, so doctor "
                "cannot pass this program (give what a skipped stage needs, or leave it out with skip=)"
            )
        return lines

    def __str__(self) -> str:
        return "\n".join([super().__str__(), *self.stage_lines()])

    def render(self, console: Any = None) -> None:
        """Print the findings, then the stage summary, to the terminal."""
        try:
            from rich.console import Console
            from rich.markup import escape
        except ImportError:  # pragma: no cover - rich is a dependency
            print(self)
            return
        console = console or Console()
        super().render(console)
        for line in self.stage_lines():
            style = "dim" if line.startswith(("stages run", "compiles per stage", "plan:", "budget")) else "yellow"
            console.print(f"[{style}]{escape(line)}[/]")


# ----------------------------------------------------------------------------- compile accounting

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
INTERRUPTED = "interrupted by Ctrl-C"  # the reason recorded for the stage a KeyboardInterrupt stopped


def _background_workers() -> int:
    """Background threads for doctor's work ahead: two, or one on a machine of two cores or fewer, where the main
    thread's compile and one background compile already take every core and a third compile at once only adds
    its memory (the 1M-parameter LM: about 450 MB at the peak)."""
    return 2 if (os.cpu_count() or 1) > 2 else 1


class _TimedPool:
    """``pool`` for one stage's :data:`PREPARE` function: each submitted job's seconds add to ``seconds[name]``."""

    def __init__(self, pool: concurrent.futures.Executor, name: str, seconds: dict[str, float]):
        self.pool, self.name, self.seconds = pool, name, seconds

    def submit(self, fn: Any, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        def timed() -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[self.name] = self.seconds.get(self.name, 0.0) + time.perf_counter() - start

        return self.pool.submit(timed)


class _CompileLog:
    """Compilations (XLA compiles and persistent-cache loads) and their seconds, per doctor stage; those of
    doctor's background thread apart. A ``jax.monitoring`` listener while active. Not jit-safe."""

    def __init__(self) -> None:
        self.stage = "setup"
        self.counts: dict[str, list[float]] = {}

    def listener(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event != _COMPILE_EVENT:
            return
        where = "background" if in_background() else self.stage
        entry = self.counts.setdefault(where, [0, 0.0])
        entry[0] += 1
        entry[1] += duration_secs

    def __enter__(self) -> _CompileLog:
        jax.monitoring.register_event_duration_secs_listener(self.listener)
        return self

    def __exit__(self, *exc: Any) -> None:
        jax.monitoring.unregister_event_duration_listener(self.listener)

    def of(self, where: str) -> tuple[int, float]:
        count, seconds = self.counts.get(where, (0, 0.0))
        return int(count), float(seconds)


# ----------------------------------------------------------------------------- doctor


def doctor(
    experiment: Experiment,
    *,
    stages: Iterable[str] | None = None,
    skip: Iterable[str] = (),
    key: jax.Array | None = None,
    progress: bool = True,
    compile_cache: bool | str = True,
    time_budget: float | None = None,
    **options: Any,
) -> Diagnosis:
    """Run the sanity checklist on ``experiment`` and return a :class:`DoctorDiagnosis`.

    Args:
      experiment: the :class:`Experiment` to check.
      stages: names of the stages to run (default: all; the report lists them in checklist order: ``data``,
        ``init``, ``grads``, ``step``, ``batch``, ``overfit``, ``run``, and ``jaxsane doctor --help`` describes
        them). They run in another order: first those whose work is all on the main thread, then those whose
        work starts ahead in the background (``_doctor/pipeline.py``: ``RUN_ORDER``).
      skip: names of stages not to run.
      key: PRNG key for init and the checks (default ``jax.random.key(0)``).
      progress: show progress on stderr (a spinner on a terminal, one line per stage otherwise).
      compile_cache: keep compiled programs in JAX's persistent compilation cache, so a second doctor
        on unchanged code loads them instead of compiling again: True (default) uses
        ``$JAXSANE_CACHE_DIR`` or ``~/.cache/jaxsane/xla`` (``JAXSANE_CACHE=0`` turns it off), a
        string names the directory, False leaves JAX's cache settings as they are (CLI: ``--no-cache``).
        The cache is a process-wide JAX setting: once on, it stays on for the process.
      time_budget: seconds the stages should take (CLI: ``--budget``). doctor estimates each stage's cost from
        the user's step (its flops, at this machine's measured rate, and its size for the compiles) and reduces
        the overfit sweep, the gradient check's sampled leaves and the run's steps until the estimate fits,
        saying in the summary what it reduced (``_doctor/budget.py``). Default None: only the per-stage rules
        for a large step (fewer examples, sampled leaves, fewer sweep configurations) apply.
      **options: per-stage settings with flat names (e.g. ``run_steps=20``), one frozen options dataclass per
        stage; ``jaxsane doctor --help`` lists each option's name, type, default and meaning.

    Returns:
      The findings, with ``.stages`` (what ran, what did not and why), ``.complete`` and
      ``.passed`` (every requested stage ran and no error was found).

    Raises:
      DoctorOptionError: an unknown stage or option name, or an ill-typed or out-of-range value
        (checked before any work).
      JaxsaneError: an Experiment that cannot be used at all (not an Experiment, unreadable data).

    Not jit-safe.

    Example:
      >>> from jaxsane.examples import load
      >>> diagnosis = doctor(load("digits_optax"), progress=False)  # doctest: +SKIP
    """
    chosen, opts = _checked_arguments(experiment, stages, skip, progress, compile_cache, time_budget, options)
    cache_dir = enable_compilation_cache(None if compile_cache is True else compile_cache)
    key = jax.random.key(0) if key is None else key
    # generators can be read once: cache what the stages read, so each stage starts from the first batch
    experiment = dataclasses.replace(experiment, train=replayable(experiment.train), eval=replayable(experiment.eval))
    diagnosis = DoctorDiagnosis(name=experiment.name)
    diagnosis.artifacts["stages"] = []
    diagnosis.artifacts["timings"] = {}
    diagnosis.artifacts["compile_cache"] = cache_dir
    triage = Triage(diagnosis)
    blocked: dict[str, tuple[str, str] | None] = {}  # need ("data", "state", "step") -> (status, why it failed)

    with contextlib.ExitStack() as cleanup:
        log = cleanup.enter_context(_CompileLog())  # compilations per stage, for the stage summary
        _RUNNING.append(diagnosis)  # what the CLI's Ctrl-C watcher prints
        cleanup.callback(_RUNNING.remove, diagnosis)
        try:  # a Ctrl-C while doctor plans or traces the user's step keeps what was found too
            start = time.perf_counter()
            batch, eval_batch, adapted = _first_batches_and_state(experiment, key, triage, blocked)
            # the user's own costs, measured as doctor goes (its yardstick: budget.sweep_seconds)
            diagnosis.artifacts["user_seconds"] = {"init": time.perf_counter() - start}
            if adapted is not None and not blocked:  # fit the stages to the program's size (and the budget)
                planned = plan_stages(adapted, batch, opts, set(options), time_budget=time_budget)
                opts = planned.apply(opts)
                diagnosis.artifacts["plan"] = planned.summary()
            # run the later stages' work ahead, in background threads (_background_workers), while the earlier stages
            # run: the gradient check and the overfit sweep's compile, then the init-scale sweep and the run stage's
            # telemetry programs; what fails there is left to its stage to report
            pool = BackgroundPool(_background_workers(), BACKGROUND)  # daemon threads: a Ctrl-C never waits for them
            # runs before the log closes: what has not started is cancelled; on a normal end the threads are joined
            # (a daemon thread still ending as the interpreter finalizes aborts the process inside XLA: "terminate
            # called ... exception not rethrown"), on a Ctrl-C they are left to the process's end
            cleanup.push(lambda kind, *_: pool.shutdown(wait=kind is None, cancel_futures=True))
            plan = RunPlan(
                experiment, adapted, key, batch, eval_batch, opts, chosen, requested=stages is not None,
                diagnosis=diagnosis, triage=triage, blocked=blocked, progress=progress, log=log,
            )  # fmt: skip
            if adapted is not None and not blocked:
                with pool.held():  # every stage's programs made before any job that shares them starts
                    plan.prepare_ahead(pool)
            _run_stages(plan)
        except KeyboardInterrupt as e:  # keep what was found: the CLI prints it, a notebook finds it on the error
            e.diagnosis = diagnosis  # type: ignore[attr-defined]  # an attribute of this instance only
            e.add_note(
                f"[jaxsane] doctor was interrupted {interrupted_where(diagnosis)}; e.diagnosis holds what it found"
            )
            raise
    count, seconds = log.of("background")
    diagnosis.artifacts["compiles"] = {"setup": log.of("setup")[0], "background": count, "background_seconds": seconds}
    return diagnosis


_RUNNING: list[DoctorDiagnosis] = []  # the doctor calls in progress in this process, innermost last


def running() -> DoctorDiagnosis | None:
    """The diagnosis of the doctor call in progress in this process (what it found so far, and in
    ``artifacts["current_stage"]`` the stage it is running), or None. The CLI prints it on Ctrl-C. Not jit-safe."""
    return _RUNNING[-1] if _RUNNING else None


def interrupted_where(diagnosis: DoctorDiagnosis) -> str:
    """``"during stage 'grads' of 'name'"``: where an interrupted doctor call was."""
    stage = diagnosis.artifacts.get("current_stage")
    if stage is None:
        interrupted = [s["name"] for s in diagnosis.stages if s["reason"] == INTERRUPTED]
        stage = interrupted[-1] if interrupted else None
    if stage:
        return f"during stage {stage!r} of {diagnosis.name!r}"
    done = [s["name"] for s in diagnosis.stages]  # between two stages: after the last one that ended
    return (
        f"after stage {done[-1]!r} of {diagnosis.name!r}" if done else f"before the first stage of {diagnosis.name!r}"
    )


def _checked_arguments(
    experiment: Any,
    stages: Iterable[str] | None,
    skip: Iterable[str],
    progress: Any,
    compile_cache: Any,
    time_budget: Any,
    options: dict[str, Any],
) -> tuple[list[str], dict[str, Any]]:
    """``(chosen stage names, resolved options)``; raises on a bad argument, before any work."""
    if time_budget is not None and (
        isinstance(time_budget, bool) or not isinstance(time_budget, (int, float)) or not time_budget > 0
    ):
        raise DoctorOptionError(
            f"doctor: time_budget must be a positive number of seconds or None, got {time_budget!r}."
        )
    if not isinstance(experiment, Experiment):
        raise ArgumentError(
            f"doctor needs a jaxsane.Experiment, got {type(experiment).__name__}. Build one with "
            "jaxsane.Experiment(init=..., step=..., train=...)."
        )
    chosen = select_stages(stages, skip)
    opts = resolve(options)
    check_options(opts)
    if not isinstance(progress, bool):
        raise DoctorOptionError(f"doctor: progress must be True or False, got {progress!r}.")
    if not isinstance(compile_cache, (bool, str)) or compile_cache == "":
        raise DoctorOptionError(
            f"doctor: compile_cache must be True, False or a directory path, got "
            f"{compile_cache!r}. Pass compile_cache=False to leave JAX's compilation cache off."
        )
    return chosen, opts


def _first_batches_and_state(
    experiment: Experiment, key: jax.Array, triage: Triage, blocked: dict[str, tuple[str, str] | None]
) -> tuple[Any, Any, PureExperiment | None]:
    """``(batch, eval_batch, adapted)``; a crash of the user's code blocks ``"data"`` or ``"state"``."""
    batch = eval_batch = adapted = None
    try:
        batch = first_batch(experiment.train, "train")
        eval_batch = first_batch(experiment.eval, "eval") if experiment.eval is not None else None
    except Exception as e:
        crash = user_crash(e)
        if crash is None:
            raise  # a clear DataError: the data cannot be read as batches
        blocked["data"] = (CRASHED, triage.user(crash, "reading the first batch"))
    if "data" not in blocked:
        try:
            adapted = PureExperiment(experiment, key=key, reuse_init=True)
            adapted.settle_params(batch)
        except Exception as e:
            crash = user_crash(e)
            if crash is None:
                raise  # a clear ExperimentError: init's signature or output cannot be used
            blocked["state"] = (CRASHED, triage.user(crash, "Experiment.init"))
    return batch, eval_batch, adapted


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """One doctor run: what its stages read (the experiment, its pure view, key, first batches, options) and
    what they write (the diagnosis, the triage, the failed needs, the compile log). Not jit-safe.

    Attributes:
      requested: the stages were named (``stages=``): a stage that is not applicable then counts.
      blocked: need (``"data"``, ``"state"``, ``"step"``) -> ``(status, why it failed)``, or None when it works.
      prepared: per stage, what :data:`PREPARE` started for it in the background.
      ahead: per stage, the seconds its work took in the background.
    """

    experiment: Experiment
    adapted: PureExperiment | None
    key: jax.Array
    batch: Any
    eval_batch: Any
    opts: dict[str, Any]
    chosen: list[str]
    requested: bool
    diagnosis: DoctorDiagnosis
    triage: Triage
    blocked: dict[str, tuple[str, str] | None]
    progress: bool
    log: _CompileLog
    prepared: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    ahead: dict[str, float] = dataclasses.field(default_factory=dict)

    def context(self, name: str) -> StageContext:
        """The :class:`StageContext` of stage ``name``."""
        return StageContext(
            self.experiment,
            self.adapted,
            self.key,
            self.batch,
            self.eval_batch,
            self.opts[name],
            self.diagnosis.artifacts,
            self.prepared.get(name, {}),
        )

    def prepare_ahead(self, pool: concurrent.futures.Executor) -> None:
        """Start each chosen stage's :data:`PREPARE` work on ``pool``."""
        for name, prepare in PREPARE.items():
            if name in self.chosen:
                self.prepared[name] = prepare(self.context(name), _TimedPool(pool, name, self.ahead))


def _run_stages(plan: RunPlan) -> None:
    """Run the chosen stages (``RUN_ORDER``), recording each one's status and seconds, the records in checklist
    order. Not jit-safe."""
    experiment, diagnosis, chosen, progress, log = plan.experiment, plan.diagnosis, plan.chosen, plan.progress, plan.log
    records, timings = diagnosis.artifacts["stages"], diagnosis.artifacts["timings"]
    show = Progress(progress, experiment.name)
    release = Releaser()
    for stage in RUN_ORDER:
        if stage.name not in chosen:
            continue
        start = time.perf_counter()
        show.start(stage.name, stage.description)
        log.stage = stage.name
        diagnosis.artifacts["current_stage"] = stage.name
        status, reason = FAILED, INTERRUPTED
        try:
            status, reason = _run_stage(plan, stage)
            release()  # what the stage's compiles and runs freed, back to the OS, once grown (_core/host_memory.py)
        finally:  # also on Ctrl-C: stop the spinner, keep what was recorded
            if status != FAILED or reason != INTERRUPTED:
                diagnosis.artifacts.pop("current_stage", None)
            timings[stage.name] = time.perf_counter() - start
            compiles, compile_seconds = log.of(stage.name)
            record = {
                "name": stage.name,
                "status": status,
                "reason": reason,
                "seconds": timings[stage.name],
                "requested": plan.requested,
                "compiles": compiles,
                "compile_seconds": compile_seconds,
                "background_seconds": plan.ahead.get(stage.name, 0.0),
            }
            records.append(record)
            show.end(record)
    order = [s.name for s in STAGES]
    records.sort(key=lambda r: order.index(r["name"]))


def _run_stage(plan: RunPlan, stage: Stage) -> tuple[str, str]:
    """Run one stage unless a need of it failed: ``(status, reason)``, its findings added to the diagnosis. A stage
    whose findings are all ``doctor.skipped`` did not apply, unless one is marked ``extra["partial"]``
    (``ran_beside``): the rest of its stage ran."""
    blocked = plan.blocked
    if "step" in stage.needs and "step" not in blocked and plan.adapted is not None and "data" not in blocked:
        blocked["step"] = step_output_problem(plan.adapted, plan.batch, plan.triage)
    failed_need = next((blocked[n] for n in ("data", *stage.needs) if blocked.get(n)), None)
    if failed_need is not None:
        return failed_need
    try:
        found = list(stage.run(plan.context(stage.name)))
    except Exception as e:  # triage: the user's crash, a missing handle, or a jaxsane bug
        return plan.triage.stage(stage.name, e, blocked.get("step"))
    plan.diagnosis.add(found)
    partial = any((f.extra or {}).get("partial") for f in found)
    if found and all(f.code == "doctor.skipped" for f in found) and not partial:
        status = NOT_APPLICABLE if all(f.severity == "info" for f in found) else SKIPPED
        return status, "; ".join(f.message for f in found)
    return RAN, ""
