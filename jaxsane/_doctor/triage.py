"""The stages' statuses, and the triage that turns an exception into a finding and a status.

A crash that passes through the user's own code (init, step, loss, apply) is a
``doctor.user_code_crashed`` error naming the user's ``file:line`` (once per distinct crash); a
stage that cannot run (a :class:`~jaxsane.JaxsaneError`) is ``doctor.skipped``; a crash inside
jaxsane itself is a ``doctor.skipped`` warning that says "jaxsane bug". Not jit-safe.
"""

from __future__ import annotations

import re
import traceback
from typing import Any

from .._core.diagnosis import Diagnosis
from .._core.errors import JaxsaneError
from .._core.finding import Finding
from .._core.frames import is_library_file, source_text
from .._experiment.contract import PureExperiment

RAN, SKIPPED, CRASHED, FAILED = "ran", "skipped", "crashed", "failed"
# a stage that needs a handle the Experiment does not give (apply, loss, ...): listed, with the reason; it
# stops doctor from passing only when the stage was asked for by name (stages=[...] / --stages)
NOT_APPLICABLE = "not applicable"


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes, outermost first (explicit ``from`` causes, else unsuppressed context)."""
    out: list[BaseException] = []
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out.append(e)
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return out


_EQX_ERROR = re.compile(r"EquinoxRuntimeError: ([^\n]+)")


class _ErrorIf(RuntimeError):
    """An ``eqx.error_if`` in the user's program fired (its message is the error's)."""


_ErrorIf.__name__ = _ErrorIf.__qualname__ = "EquinoxRuntimeError"


# (the exception, the user's file, its line); file and line are None for an eqx.error_if that fired
Crash = tuple[BaseException, str | None, int | None]


def user_crash(exc: BaseException) -> Crash | None:
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


def _crash_finding(crash: Crash, during: str) -> Finding:
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


class Triage:
    """Turns exceptions into findings, reporting each distinct crash of the user's code once."""

    def __init__(self, diagnosis: Diagnosis):
        self.diagnosis = diagnosis
        self.seen: dict[tuple, Finding] = {}

    def user(self, crash: Crash, during: str) -> str:
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


def step_output_problem(adapted: PureExperiment, batch: Any, triage: Triage) -> tuple[str, str] | None:
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
