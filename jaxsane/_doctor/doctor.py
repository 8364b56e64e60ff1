"""doctor: run the pipeline (:data:`jaxsane._doctor.pipeline.STAGES`) on one Experiment and say what it found.

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
import dataclasses
import re
import time
import traceback
from collections.abc import Iterable
from typing import Any

import jax

from .._core.diagnosis import Diagnosis
from .._core.errors import DoctorOptionError, JaxsaneError
from .._core.finding import Finding
from .._core.frames import is_library_file, source_text
from .._experiment.batches import first_batch, replayable
from .._experiment.contract import Experiment, PureExperiment
from .._jaxpr.compile_cache import enable_compilation_cache
from .._render.progress import Progress
from .options import resolve, select_stages
from .pipeline import PREPARE, STAGES, StageContext, check_options

RAN, SKIPPED, CRASHED, FAILED = "ran", "skipped", "crashed", "failed"
# a stage that needs a handle the Experiment does not give (apply, loss, ...): listed, with the reason; it
# stops doctor from passing only when the stage was asked for by name (stages=[...] / --stages)
NOT_APPLICABLE = "not applicable"


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
        return d

    def stage_lines(self) -> list[str]:
        """The stage summary: what ran and how long it took, what did not run and why."""
        ran = [s for s in self.stages if s["status"] == RAN]
        lines = []
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
                s["status"] != RAN and (s["status"] != NOT_APPLICABLE or s.get("requested")) for s in self.stages
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
            style = "dim" if line.startswith(("stages run", "compiles per stage")) else "yellow"
            console.print(f"[{style}]{escape(line)}[/]")


# ----------------------------------------------------------------------------- crash triage


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes, outermost first (explicit ``from`` causes, else unsuppressed context)."""
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out.append(exc)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return out


_EQX_ERROR = re.compile(r"EquinoxRuntimeError: ([^\n]+)")


class _ErrorIf(RuntimeError):
    """An ``eqx.error_if`` in the user's program fired (its message is the error's)."""


_ErrorIf.__name__ = _ErrorIf.__qualname__ = "EquinoxRuntimeError"


def user_crash(exc: BaseException) -> tuple[BaseException, str, int] | None:
    """``(exception, file, line)`` when ``exc`` was raised in (or through) the user's own code.

    Walks the exception and its causes from the innermost outwards and returns the first one whose
    traceback passes through a frame outside jax/flax/optax/jaxsane/the stdlib, with the innermost
    such frame. None for a crash entirely inside libraries (a jaxsane bug or a bad argument).
    """
    for e in reversed(_chain(exc)):
        if type(e).__name__ == "UnfilteredStackTrace":  # jax's copy of the traceback, not an error
            continue
        fired = _EQX_ERROR.search(str(e)) if "EquinoxRuntimeError" in str(e) else None
        if fired:  # the user's eqx.error_if, raised at run time from a callback: no user frame in the traceback
            return _ErrorIf(fired.group(1).strip()), None, None
        for frame in reversed(traceback.extract_tb(e.__traceback__)):
            if not is_library_file(frame.filename):
                return e, frame.filename, frame.lineno
    return None


def _first_line(exc: BaseException, limit: int = 300) -> str:
    text = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    text = text.removeprefix("[jaxsane] ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _crash_finding(crash: tuple[BaseException, str, int], during: str) -> Finding:
    exc, file, line = crash
    src = source_text(file, line)
    return Finding(
        "doctor.user_code_crashed",
        f"your code raised {type(exc).__name__}: {_first_line(exc)} (during {during})" + (f"   {src}" if src else ""),
        (f"fix the exception at {file}:{line}" if file else "fix what the check in your code (eqx.error_if) reports")
        + "; doctor cannot check a program that crashes "
        "(call that function yourself on the first batch to see the whole traceback)",
        file=file,
        line=line,
        extra={"exception": type(exc).__name__, "during": [during]},
    )


def _at(file: str | None, line: int | None) -> str:
    return f" at {file}:{line}" if file else ""


class _Triage:
    """Turns exceptions into findings, reporting each distinct crash of the user's code once."""

    def __init__(self, diagnosis: Diagnosis):
        self.diagnosis = diagnosis
        self.seen: dict[tuple, Finding] = {}

    def user(self, crash: tuple[BaseException, str, int], during: str) -> str:
        exc, file, line = crash
        ident = (type(exc).__name__, str(exc), file, line)
        if ident in self.seen:
            self.seen[ident].extra["during"].append(during)
            return f"your code raised {type(exc).__name__}{_at(file, line)} (the crash reported above)"
        self.seen[ident] = finding = _crash_finding(crash, during)
        self.diagnosis.add(finding)
        return f"your code raised {type(exc).__name__}: {_first_line(exc, 120)}{_at(file, line)}"

    def stage(self, name: str, exc: Exception, blocked: tuple[str, str] | None) -> tuple[str, str]:
        """(status, reason) for stage ``name`` that raised ``exc``; adds the finding."""
        crash = user_crash(exc)
        if crash is not None:
            return CRASHED, self.user(crash, f"stage {name!r}")
        if blocked:  # the stage fell back on a step already found unusable
            return blocked
        if isinstance(exc, JaxsaneError):
            reason = f"could not run: {_first_line(exc)}"
            self.diagnosis.add(
                Finding(
                    "doctor.skipped",
                    f"stage {name!r} {reason}",
                    "fix the Experiment as the message says, then run doctor again",
                    severity="warning",
                )
            )
            return SKIPPED, reason
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        reason = f"crashed inside jaxsane (a jaxsane bug): {type(exc).__name__}: {_first_line(exc)}{where}"
        self.diagnosis.add(
            Finding(
                "doctor.skipped",
                f"stage {name!r} {reason}",
                f"please report this jaxsane bug with the message; meanwhile skip={name!r} "
                "(CLI: --skip) runs the other stages",
                severity="warning",
            )
        )
        return FAILED, reason


def _step_output_problem(adapted: PureExperiment, batch: Any, triage: _Triage) -> tuple[str, str] | None:
    """Trace the step once (no FLOPs): ``(status, reason)`` when the step is unusable (its finding added)."""
    if adapted.nnx:  # NNX steps update objects in place: any output (or none) is fine
        return None
    try:
        adapted.detect_style(adapted.example_state, batch)
    except Exception as e:
        crash = user_crash(e)
        if crash is not None:
            return CRASHED, triage.user(crash, "the first trace of the step")
        if isinstance(e, JaxsaneError) and e.__cause__ is None:
            triage.diagnosis.add(
                Finding(
                    "doctor.step_output",
                    f"the step cannot train: {_first_line(e, 1000)}",
                    "return the updated state from the step: `return new_state, metrics` (or `return new_state`)",
                    extra={"structure": str(e)},
                )
            )
            return SKIPPED, "the step returns no usable new state (see doctor.step_output)"
        return None  # not the user's code, not the output: let the stages run and report it
    return None


# ----------------------------------------------------------------------------- compile accounting

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_BACKGROUND = "jaxsane-precompile"


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

    def __init__(self):
        self.stage = "setup"
        self.counts: dict[str, list[float]] = {}

    def listener(self, event: str, duration: float, **kwargs: Any) -> None:
        if event != _COMPILE_EVENT:
            return
        import threading

        where = "background" if threading.current_thread().name.startswith(_BACKGROUND) else self.stage
        entry = self.counts.setdefault(where, [0, 0.0])
        entry[0] += 1
        entry[1] += duration

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
    **options: Any,
) -> Diagnosis:
    """Run the sanity checklist on ``experiment`` and return a :class:`DoctorDiagnosis`.

    Args:
      experiment: the :class:`Experiment` to check.
      stages: names of the stages to run (default: all, see ``jaxsane._doctor.pipeline.STAGES``).
      skip: names of stages not to run.
      key: PRNG key for init and the checks (default ``jax.random.key(0)``).
      progress: show progress on stderr (a spinner on a terminal, one line per stage otherwise).
      compile_cache: keep compiled programs in JAX's persistent compilation cache, so a second doctor
        on unchanged code loads them instead of compiling again: True (default) uses
        ``$JAXSANE_CACHE_DIR`` or ``~/.cache/jaxsane/xla`` (``JAXSANE_CACHE=0`` turns it off), a
        string names the directory, False leaves JAX's cache settings as they are (CLI: ``--no-cache``).
        The cache is a process-wide JAX setting: once on, it stays on for the process.
      **options: per-stage settings with flat names (e.g. ``run_steps=20``); see the options
        dataclasses in ``jaxsane._doctor.options`` (each field: name, type, default, meaning).

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
    if not isinstance(experiment, Experiment):
        raise JaxsaneError(
            f"doctor needs a jaxsane.Experiment, got {type(experiment).__name__}. Build one with "
            "jaxsane.Experiment(init=..., step=..., train=...)."
        )
    chosen = select_stages(stages, skip)
    opts = resolve(options)
    check_options(opts)
    if not isinstance(progress, bool):
        raise JaxsaneError(f"doctor: progress must be True or False, got {progress!r}.")
    if not isinstance(compile_cache, (bool, str)) or compile_cache == "":
        raise DoctorOptionError(
            f"doctor: compile_cache must be True, False or a directory path, got "
            f"{compile_cache!r}. Pass compile_cache=False to leave JAX's compilation cache off."
        )
    cache_dir = enable_compilation_cache(None if compile_cache is True else compile_cache)
    key = jax.random.key(0) if key is None else key
    # generators can be read once: cache what the stages read, so each stage starts from the first batch
    experiment = dataclasses.replace(experiment, train=replayable(experiment.train), eval=replayable(experiment.eval))
    diagnosis = DoctorDiagnosis(name=experiment.name)
    records: list[dict[str, Any]] = []
    diagnosis.artifacts["stages"] = records
    timings: dict[str, float] = {}
    diagnosis.artifacts["timings"] = timings
    diagnosis.artifacts["compile_cache"] = cache_dir
    triage = _Triage(diagnosis)
    blocked: dict[str, tuple[str, str]] = {}  # need ("data", "state", "step") -> (status, why it failed)

    log = _CompileLog().__enter__()  # compilations per stage, for the stage summary
    try:
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
            except Exception as e:
                crash = user_crash(e)
                if crash is None:
                    raise  # a clear ExperimentError: init's signature or output cannot be used
                blocked["state"] = (CRASHED, triage.user(crash, "Experiment.init"))
    except BaseException:
        log.__exit__()
        raise

    # run the later stages' work ahead, in two background threads, while the earlier stages run: the gradient
    # check and the overfit sweep's compile at once, then the init-scale sweep and the run stage's telemetry
    # programs; what fails there is left to its stage to report
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix=_BACKGROUND)
    prepared: dict[str, dict[str, Any]] = {}
    ahead: dict[str, float] = {}  # per stage: seconds its work took in the background
    if adapted is not None and not blocked:
        for name, prepare in PREPARE.items():
            if name in chosen:
                prepared[name] = prepare(
                    StageContext(experiment, adapted, key, batch, eval_batch, opts[name], diagnosis.artifacts),
                    _TimedPool(pool, name, ahead),
                )
    try:
        _run_stages(
            experiment,
            adapted,
            key,
            batch,
            eval_batch,
            opts,
            chosen,
            stages,
            prepared,
            diagnosis,
            triage,
            blocked,
            progress,
            log,
            ahead,
        )
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        log.__exit__()
        count, seconds = log.of("background")
        diagnosis.artifacts["compiles"] = {
            "setup": log.of("setup")[0],
            "background": count,
            "background_seconds": seconds,
        }
    return diagnosis


def _run_stages(
    experiment: Experiment,
    adapted: PureExperiment | None,
    key: jax.Array,
    batch: Any,
    eval_batch: Any,
    opts: dict[str, Any],
    chosen: list[str],
    stages: Iterable[str] | None,
    prepared: dict[str, dict[str, Any]],
    diagnosis: DoctorDiagnosis,
    triage: _Triage,
    blocked: dict[str, tuple[str, str]],
    progress: bool,
    log: _CompileLog,
    ahead: dict[str, float],
) -> None:
    """Run the chosen stages in checklist order, recording each one's status and seconds. Not jit-safe."""
    records, timings = diagnosis.artifacts["stages"], diagnosis.artifacts["timings"]
    show = Progress(progress, experiment.name)
    for stage in STAGES:
        if stage.name not in chosen:
            continue
        start = time.perf_counter()
        show.start(stage.name, stage.description)
        log.stage = stage.name
        status, reason = FAILED, "interrupted"
        try:
            if "step" in stage.needs and "step" not in blocked and adapted is not None and "data" not in blocked:
                blocked["step"] = _step_output_problem(adapted, batch, triage)
            failed_need = next((blocked[n] for n in ("data", *stage.needs) if blocked.get(n)), None)
            status, reason = failed_need or (RAN, "")
            if failed_need is None:
                ctx = StageContext(
                    experiment,
                    adapted,
                    key,
                    batch,
                    eval_batch,
                    opts[stage.name],
                    diagnosis.artifacts,
                    prepared.get(stage.name, {}),
                )
                try:
                    found = list(stage.run(ctx))
                except Exception as e:  # triage: the user's crash, a missing handle, or a jaxsane bug
                    status, reason = triage.stage(stage.name, e, blocked.get("step"))
                else:
                    diagnosis.add(found)
                    if found and all(f.code == "doctor.skipped" for f in found):
                        status = NOT_APPLICABLE if all(f.severity == "info" for f in found) else SKIPPED
                        reason = "; ".join(f.message for f in found)
        finally:  # also on Ctrl-C: stop the spinner, keep what was recorded
            timings[stage.name] = time.perf_counter() - start
            compiles, compile_seconds = log.of(stage.name)
            record = {
                "name": stage.name,
                "status": status,
                "reason": reason,
                "seconds": timings[stage.name],
                "requested": stages is not None,
                "compiles": compiles,
                "compile_seconds": compile_seconds,
                "background_seconds": ahead.get(stage.name, 0.0),
            }
            records.append(record)
            show.end(record)
