"""dist.hang: a watchdog that names the process of a ``jax.distributed`` job that stopped entering the step.

``guard(step, hang_timeout=T)`` gives the guarded step a :class:`HangWatch`. On the hot path the main
thread only writes a few attributes per call (the step it entered, the step it finished, their
wall-clock times). A daemon thread per process publishes that record to the key-value store of the
``jax.distributed`` coordination service (no new server; ``global_state.client``) when it changed, at most
once per check period, and looks for a hang:

* locally: the main thread has been inside one guarded call for more than ``T`` seconds (blocked in a
  collective, or in the flag read of an earlier step that waits on one), except the first call, which
  compiles;
* globally (process 0 only, one directory read per check): some process has not entered the newest
  step any process entered, and that step was entered more than ``T`` seconds ago.

The first process to see a hang posts a request; every process that is still alive then posts the
Python stacks of all its threads (``sys._current_frames``), and each builds the same ``dist.hang``
finding from the records and stacks: which processes did not enter the step, the last step each
reached and when, and where the missing processes' threads are. Then the job fails fast: a process
whose main thread is blocked inside the guarded call (raising cannot unblock a collective) prints the
report to stderr and leaves with ``os._exit(EXIT_CODE)``; a process whose main thread runs Python gets a
:class:`~jaxsane.DistHangError` raised in it, and leaves the same way ``GRACE_S`` later, or at exit,
without waiting in ``jax.distributed``'s shutdown barrier. Process 0 (which hosts the coordination
service) leaves last, once the others said they are leaving. A step that raises while a peer is behind
(gloo's "connection closed by peer" when a process died) is reported as ``dist.hang`` the same way and
raised from the original error.

Keys live under ``jaxsane/hang/<n>/`` (``n`` counts watches in the order their first call came, the
same on every process): ``rec/<pid>``, ``hang``, ``stacks/<pid>``, ``exiting/<pid>``.

Host-side only: nothing here is jit-safe. Records of a process that died are as of its last publish
(at most one check period old); times are wall-clock, so hosts are compared through their clocks.
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from .._core.errors import DistHangError, JaxsaneError
from .._core.finding import Finding
from .._core.frames import is_library_file

EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): the job failed on a hang, a restart may succeed
DEFAULT_FIT_TIMEOUT = 600.0  # PyTorch's default NCCL process-group timeout (torch.distributed, 10 minutes)
GRACE_S = 1.0  # how long a process whose main thread runs Python gets to raise before it exits
_WATCHES = itertools.count()  # key namespace per watch, in first-call order


def check_hang_timeout(value: Any, where: str, error: type) -> float | None:
    """``None`` or a positive number of seconds, as a float; else ``error`` naming the argument. Not jit-safe.

    Example:
      >>> check_hang_timeout(3, "guard", ValueError)
      3.0
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < float(value) < float("inf"):
        raise error(
            f"[jaxsane] {where}(hang_timeout=...) must be None (off) or a number of seconds > 0; got "
            f"{value!r} ({type(value).__name__}). Fix: pass e.g. hang_timeout=600 (seconds a step may "
            f"take, compile and any host-side pause between steps included)."
        )
    return float(value)


def check_period(timeout: float) -> float:
    """Seconds between two checks (and at most between two publishes) of the watchdog. Not jit-safe."""
    return min(max(timeout / 10.0, 0.05), 2.0)


def _client():
    """``(client, process_id, num_processes)`` of ``jax.distributed`` (client None when not initialised)."""
    from jax._src.distributed import global_state

    return global_state.client, global_state.process_id, global_state.num_processes


def thread_stacks(skip: int | None = None) -> list[dict]:
    """Every thread's Python stack as ``{"name", "main", "frames": [[file, line, function, text], ...]}``
    (outermost first), except thread ``skip``. Not jit-safe."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == skip:
            continue
        frames = [[f.filename, f.lineno, f.name, (f.line or "").strip()] for f in traceback.extract_stack(frame)]
        out.append({"name": names.get(ident, str(ident)), "main": ident == main, "frames": frames})
    out.sort(key=lambda t: not t["main"])
    return out


def user_frame(stack: dict) -> list | None:
    """The innermost frame of a thread's stack that is the user's code (not jax, jaxsane or the stdlib), else
    the innermost frame. Not jit-safe."""
    for frame in reversed(stack["frames"]):
        if not is_library_file(frame[0]):
            return frame
    return stack["frames"][-1] if stack["frames"] else None


def detect(records: dict[int, dict], num_processes: int, timeout: float, now: float) -> dict | None:
    """The global rule: a process has not entered the newest step some process entered more than
    ``timeout`` seconds ago (a process with no record has entered no step). Returns the request to
    post, or None. Pure, not jit-safe.

    Example:
      >>> recs = {0: {"entered": 5, "entered_at": 0.0}, 1: {"entered": 4, "entered_at": 0.0}}
      >>> detect(recs, 2, timeout=3.0, now=4.0)["missing"]
      [1]
    """
    top = max((r["entered"] for r in records.values()), default=-1)
    if top < 0:
        return None
    missing = [p for p in range(num_processes) if records.get(p, {}).get("entered", -1) < top]
    since = min(r["entered_at"] for r in records.values() if r["entered"] == top)
    if missing and now - since > timeout:
        return {
            "step": top,
            "missing": missing,
            "reason": f"step {top} was entered {now - since:.1f}s ago and "
            f"process(es) {_names(missing)} have not entered it",
        }
    return None


def _names(pids) -> str:
    return ", ".join(str(p) for p in pids)


def _clock(t: float | None) -> str:
    if not t:
        return "never"
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 10)}"


def _process_report(
    p: int, rec: dict, ans: dict | None, missing: bool, now: float
) -> tuple[list[str], dict, list | None]:
    """Process ``p`` in the hang report: its lines (with its threads' stacks when it is ``missing``), its entry in
    ``extra["processes"]`` and its main thread's user frame (None when unknown). ``ans``: its stack answer."""
    entered, finished = rec.get("entered", -1), rec.get("finished", -1)
    main = next((t for t in (ans or {}).get("threads", []) if t["main"]), None)
    frame = user_frame(main) if main else None
    at = f"{frame[0]}:{frame[1]}" if frame else None
    state = (
        "has exited"
        if rec.get("exited")
        else "waits inside the guarded call"
        if rec.get("in_call")
        else "is outside the guarded step"
    )
    if ans is None:
        state += "; it did not answer the stack request (exited, died, or holds the GIL)"
    last = (
        f"last entered step {entered} at {_clock(rec.get('entered_at'))} ({now - rec['entered_at']:.1f}s ago)"
        if entered >= 0
        else "entered no step"
    )
    lines = [
        f"  process {p}{' (missing)' if missing else ''}: {last}, finished step {finished}; "
        f"{state}" + (f"; main thread at {at} in {frame[2]}: {frame[3]}" if frame else "")
    ]
    entry = {
        "entered": entered,
        "entered_at": rec.get("entered_at"),
        "finished": finished,
        "finished_at": rec.get("finished_at"),
        "in_call": bool(rec.get("in_call")),
        "exited": bool(rec.get("exited")),
        "answered": ans is not None,
        "where": at,
    }
    if missing and ans is not None:
        for t in ans["threads"]:
            lines.append(f"    thread {t['name']}{' (main)' if t['main'] else ''} of process {p}:")
            lines.extend(
                f'      File "{f[0]}", line {f[1]}, in {f[2]}' + (f"\n        {f[3]}" if f[3] else "")
                for f in t["frames"]
            )
        entry["stacks"] = ans["threads"]
    return lines, entry, frame


def _what_and_hint(request: dict, missing: list[int], silent: list[int], step: int, timeout: float) -> tuple[str, str]:
    """The hang's message and hint: processes that never entered the step (``silent``: those of them that did
    not answer the stack request either), or a step every process entered that never finished."""
    if not missing:
        what = (
            f"step {step} did not finish within hang_timeout={timeout:g}s although every process entered it: "
            f"a collective inside it never completes"
        )
        hint = (
            "the processes run different collectives (a branch or shape that differs by process), or a "
            "device is stuck; if the step is legitimately this slow, raise hang_timeout=."
        )
        return what, hint
    cause = request.get("cause")
    if cause:
        what = (
            f"process(es) {_names(missing)} did not enter step {step}, and the step failed on process "
            f"{request.get('by')} in a collective (it raised {cause})"
        )
    else:
        what = (
            f"process(es) {_names(missing)} did not enter step {step} within hang_timeout={timeout:g}s; the "
            f"others wait for them in a collective"
        )
    hint = (
        f"see where process(es) {_names(missing)} are (their stacks above): a data loader that blocks, a "
        f"branch only some processes take, a host that died. If steps are legitimately this slow "
        f"(compile, checkpoint, evaluation on one process), raise hang_timeout=."
    )
    if silent:
        hint = (
            f"process(es) {_names(silent)} did not answer: they most likely died (read their own log and "
            f"the scheduler's events: out of memory, preemption, a crash). " + hint.replace("see", "Else see", 1)
        )
    return what, hint


def hang_finding(
    request: dict, records: dict[int, dict], stacks: dict[int, dict], num_processes: int, timeout: float, now: float
) -> Finding:
    """The ``dist.hang`` finding from the request, every process's record and the stacks that came. Pure,
    not jit-safe."""
    entered_by = [records.get(p, {}).get("entered", -1) for p in range(num_processes)]
    low, high = min(entered_by), max(entered_by)
    # the step that hangs is the first one some process has not entered (the others block in it or later)
    step = low + 1 if low < high else max(high, int(request["step"]))
    missing = [p for p in range(num_processes) if entered_by[p] == low] if low < high else []
    lines: list[str] = []
    per_process: dict[int, dict] = {}
    where = None
    for p in range(num_processes):
        more, per_process[p], frame = _process_report(p, records.get(p, {}), stacks.get(p), p in missing, now)
        lines += more
        if p in missing and where is None and frame:
            where = frame
    what, hint = _what_and_hint(request, missing, [p for p in missing if p not in stacks], step, timeout)
    return Finding(
        "dist.hang",
        what,
        hint=hint,
        step=step,
        file=where[0] if where else None,
        line=where[1] if where else None,
        extra={
            "missing": missing,
            "timeout": timeout,
            "detected_by": request.get("by"),
            "reason": request.get("reason"),
            "processes": per_process,
            "report": "\n".join(lines),
        },
    )


def report_text(finding: Finding) -> str:
    """The text printed to stderr and carried by :class:`DistHangError`. Not jit-safe."""
    return (
        f"[jaxsane] {finding.headline()}\n{finding.extra['report']}\n  fix: {finding.hint}\n"
        f"  (jaxsane ends this process with exit code {EXIT_CODE} so the job fails fast)"
    )


def _raise_in_main(error: type) -> None:
    """Raise ``error`` (a class built with no arguments) in the main thread at its next Python bytecode."""
    ident = threading.main_thread().ident
    assert ident is not None  # (the main thread has started: it runs this program)
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(error))


class HangWatch:
    """One guarded step's hang watchdog (see the module docstring). Not jit-safe; :meth:`run` is the hot path.

    Attributes:
      timeout: seconds a step may take before it is a hang.
      finding: the ``dist.hang`` :class:`Finding` once one was reported, else None.
    """

    def __init__(self, timeout: float, on_finding: Callable[[Finding], Any] | None = None):
        self.timeout = timeout
        self.period = check_period(timeout)
        self.on_finding = on_finding
        self.finding: Finding | None = None
        self.entered, self.entered_at, self.finished, self.finished_at = -1, 0.0, -1, 0.0
        self.in_call = False
        self.exited = False  # the interpreter is exiting (atexit ran)
        self._version = 0  # bumped by the main thread on every change; the publisher compares it
        self._active: bool | None = None  # None: not started; False: single process (a no-op)
        self._respond_lock = threading.Lock()
        self._exit_lock = threading.Lock()
        self._main_raises = False
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- main thread (hot path)
    def run(self, step: int, fn: Callable, *args, **kwargs):
        """Call ``fn(*args, **kwargs)`` as guarded call ``step``, recording entry and return. Not jit-safe."""
        if self._active is None:
            self._start()
        if not self._active:
            return fn(*args, **kwargs)
        if self.finding is not None:
            raise DistHangError(report_text(self.finding), self.finding)
        self.entered, self.entered_at, self.in_call = step, time.time(), True
        self._version += 1
        try:
            out = fn(*args, **kwargs)
        except BaseException as e:  # KeyboardInterrupt too: the call is over either way
            self.in_call = False
            self._version += 1
            if isinstance(e, Exception) and not isinstance(e, JaxsaneError):  # ours (NonFiniteError) are no hang
                self._failed(step, e)
            raise
        self.finished, self.finished_at, self.in_call = step, time.time(), False
        self._version += 1
        return out

    def _start(self) -> None:
        import jax

        client, pid, n = _client()
        self._active = client is not None and jax.process_count() > 1
        if not self._active:
            return
        self.pid, self.n, self.client = pid, n, client
        self.prefix = f"jaxsane/hang/{next(_WATCHES)}/"
        self._thread = threading.Thread(target=self._loop, name="jaxsane-hang-watch", daemon=True)
        atexit.register(self._at_exit)  # after jax's own atexit: runs before its distributed shutdown
        self._thread.start()

    def _failed(self, step: int, error: Exception) -> None:
        """The step raised: if a peer has not entered it, report ``dist.hang`` and raise it from ``error``.
        Waits two check periods first, so that every live peer's record is fresh (failure path only)."""
        try:
            self._publish()
            time.sleep(2 * self.period)
            records = self._records()
        except Exception:  # the coordination service is gone too: nothing to add
            return
        missing = [p for p in range(self.n) if records.get(p, {}).get("entered", -1) < step]
        if not missing:
            return
        self._main_raises = True
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        try:
            self._post_request(
                {
                    "step": step,
                    "by": self.pid,
                    "at": time.time(),
                    "missing": missing,
                    "cause": f"{type(error).__name__}: {first}",
                    "reason": f"step {step} raised on process {self.pid} while process(es) "
                    f"{_names(missing)} had not entered it",
                }
            )
            finding = self._respond(self._request() or {"step": step, "by": self.pid})
        except Exception:  # the service went away meanwhile: the step's own error is all there is
            self._main_raises = False
            return
        raise DistHangError(report_text(finding), finding) from error

    # ---------------------------------------------------------------- the watchdog thread
    def _loop(self) -> None:
        published = -1
        while True:
            time.sleep(self.period)
            try:
                if self._version != published:
                    published = self._version
                    self._publish()
                request = self._request()
                now = time.time()
                # the first call (compile, gloo's connections) is not timed here: only the global rule
                # (a process that has not entered it) watches it
                if request is None and self.in_call and self.finished >= 0 and now - self.entered_at > self.timeout:
                    request = {
                        "step": self.entered,
                        "by": self.pid,
                        "at": now,
                        "reason": f"process {self.pid} waited {now - self.entered_at:.1f}s inside step {self.entered}",
                    }
                    self._post_request(request)
                    request = self._request() or request
                elif request is None and self.pid == 0:
                    request = detect(self._records(), self.n, self.timeout, now)
                    if request is not None:
                        self._post_request({**request, "by": self.pid, "at": now})
                        request = self._request() or request
                if request is not None:
                    self._act(self._respond(request))
                    return
            except Exception:  # the client was shut down (normal exit) or the service is gone
                if _client()[0] is None:
                    return

    def _record(self) -> dict:
        return {
            "entered": self.entered,
            "entered_at": self.entered_at,
            "finished": self.finished,
            "finished_at": self.finished_at,
            "in_call": self.in_call,
            "exited": self.exited,
        }

    def _publish(self) -> None:
        self.client.key_value_set(f"{self.prefix}rec/{self.pid}", json.dumps(self._record()), allow_overwrite=True)

    def _request(self) -> dict | None:
        try:
            return json.loads(self.client.key_value_try_get(f"{self.prefix}hang"))
        except Exception:  # NOT_FOUND: no hang so far
            return None

    def _post_request(self, request: dict) -> None:
        try:  # the first request wins; a second one is refused by the store
            self.client.key_value_set(f"{self.prefix}hang", json.dumps(request), allow_overwrite=False)
        except Exception:
            pass

    def _dir(self, sub: str) -> dict[int, dict]:
        return {int(k.rsplit("/", 1)[-1]): json.loads(v) for k, v in self.client.key_value_dir_get(self.prefix + sub)}

    def _records(self) -> dict[int, dict]:
        records = self._dir("rec/")
        records[self.pid] = {**records.get(self.pid, {}), **self._record()}  # our own, fresher than published
        return records

    def _respond(self, request: dict) -> Finding:
        """Post our stacks, wait for the others' (bounded), build, keep and print the finding; returns it (or the
        one kept before)."""
        with self._respond_lock:
            if self.finding is not None:
                return self.finding
            self._publish()
            me = threading.current_thread().ident
            self.client.key_value_set(
                f"{self.prefix}stacks/{self.pid}",
                json.dumps({"threads": thread_stacks(skip=me if me != threading.main_thread().ident else None)}),
                allow_overwrite=True,
            )
            deadline = time.monotonic() + 2 * self.period + GRACE_S
            stacks = self._dir("stacks/")
            while len(stacks) < self.n and time.monotonic() < deadline:
                time.sleep(self.period / 2)
                stacks = self._dir("stacks/")
            finding = hang_finding(request, self._records(), stacks, self.n, self.timeout, time.time())
            self.finding = finding
            print(report_text(finding), file=sys.stderr, flush=True)
            if self.on_finding is not None:
                self.on_finding(finding)
            return finding

    def _act(self, finding: Finding) -> None:
        """After the report (``finding``): raise in the main thread where it runs Python, then leave the process."""
        if not self.in_call and not self._main_raises and not self.exited:  # (exited: main is in atexit)
            _raise_in_main(
                type(
                    "DistHangError",
                    (DistHangError,),
                    {"__init__": lambda e: DistHangError.__init__(e, report_text(finding), finding)},
                )
            )
            time.sleep(GRACE_S)
        elif self._main_raises:
            time.sleep(GRACE_S)
        self._exit()

    def _exit(self) -> None:
        """Leave with EXIT_CODE; process 0 (the coordination service) after the others said they leave."""
        with self._exit_lock:
            try:
                self.client.key_value_set(f"{self.prefix}exiting/{self.pid}", "1", allow_overwrite=True)
                if self.pid == 0:
                    answered = set(self._dir("stacks/"))
                    deadline = time.monotonic() + 2 * self.period + 2 * GRACE_S
                    while time.monotonic() < deadline and not answered <= set(self._dir("exiting/")):
                        time.sleep(self.period / 2)
            except Exception:
                pass
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_CODE)

    def _at_exit(self) -> None:
        """Interpreter exit: after a hang, leave now (not in the shutdown barrier); else say we exited. The
        watchdog keeps answering while ``jax.distributed``'s shutdown waits for the other processes."""
        if self.finding is not None:
            self._exit()
        self.exited = True
        self._version += 1
        try:
            self._publish()
        except Exception:
            pass
