"""The one progress display of jaxsane's long host-side jobs, on stderr: rich on a terminal, plain
``[jaxsane] name: ...`` lines otherwise (CI logs), nothing when turned off. Not jit-safe.

:class:`Progress` shows messages (``say``: the sweeps) and stages (``start``/``end``: the doctor);
:class:`StepProgress` adds a counted bar with rate and ETA (fit's steps).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from typing import Any


def _clock(seconds: float) -> str:
    seconds = int(round(max(0.0, seconds)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _text(info: str | Callable[[], str]) -> str:
    return info() if callable(info) else info


class Progress:
    """Progress of a job named ``name``; on a terminal a rich spinner shows the latest message. Not jit-safe.

    Messages: ``with Progress(enabled, "overfit") as p: p.say("compiling ...")``; each :meth:`say` replaces
    the spinner's text on a terminal, or writes one line with the seconds elapsed otherwise.

    Stages: ``p.start(stage, description)`` then ``p.end(record)``: the spinner shows the description on a
    terminal; otherwise one line ``[jaxsane] name: stage ... 1.2 s`` (or ``... skipped (why)``) per stage.
    """

    def __init__(self, enabled: bool, name: str, stream: Any = None):
        self.enabled, self.name = bool(enabled), name
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self._status: Any = None
        self._start = time.perf_counter()

    def __enter__(self) -> Progress:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop_spinner()

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def _spin(self, text: str) -> None:
        """Show ``text`` in the spinner, starting it when none runs."""
        if self._status is None:
            from rich.console import Console

            self._status = Console(file=self.stream).status(text)
            self._status.__enter__()
        else:
            self._status.update(text)

    def _stop_spinner(self) -> None:
        if self._status is not None:
            self._status.__exit__(None, None, None)
            self._status = None

    def say(self, message: str) -> None:
        """A message: the spinner's text on a terminal, else a line with the seconds since the start."""
        if not self.enabled:
            return
        if self.tty:
            self._spin(f"[jaxsane] {self.name}: {message}")
        else:
            self._write(f"[jaxsane] {self.name}: {message} ({time.perf_counter() - self._start:.1f} s)\n")

    def start(self, stage: str, description: str) -> None:
        """A stage begins: a fresh spinner with ``description`` on a terminal, else ``[jaxsane] name: stage ...``."""
        if not self.enabled:
            return
        if self.tty:
            self._stop_spinner()
            self._spin(f"[jaxsane] {self.name}: {description}")
        else:
            self._write(f"[jaxsane] {self.name}: {stage} ...")

    def end(self, record: Mapping[str, Any]) -> None:
        """A stage ends; ``record`` is its stage record (``status``, ``reason``, ``seconds``): the line ends
        with the seconds when it ran (status ``"ran"``), else with the status and why."""
        self._stop_spinner()
        if self.enabled and not self.tty:
            ran = record["status"] == "ran"
            tail = f"{record['seconds']:.1f} s" if ran else f"{record['status']} ({record['reason']})"
            self._write(f" {tail}\n")


class StepProgress(Progress):
    """Counted steps (fit's): steps done, steps per second and the time left (both measured from the end of
    the first step, so compiling does not count), and the latest loss.

    On a terminal, a rich bar redrawn at most 10 times a second (fed every step, so it is never more than
    a second old); otherwise (CI logs) plain lines ``[jaxsane] fit NAME: step 40/200 (20%), 85.3 steps/s,
    ETA 0:00:02, loss 0.41``: after the first step, then every ``every_seconds`` or each tenth of the run
    (at most one a second), and a last one at the end. Nothing when disabled. Not jit-safe.
    """

    def __init__(
        self, enabled: bool, total: int, start: int, name: str, stream: Any = None, every_seconds: float = 30.0
    ):
        super().__init__(enabled, name, stream)
        self.total, self.begin = int(total), int(start)
        self.every = float(every_seconds)
        self.started = time.perf_counter()
        self.first: tuple[float, int] | None = None  # (time, steps) at the end of the first step
        self.drawn, self.completed = -1.0, int(start)
        self.info: str | Callable[[], str] = ""
        self.bar: Any = None
        self.lines = 0
        if self.tty:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn

            self.bar = Bar(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"),
                TextColumn("{task.fields[info]}"),
                console=Console(file=self.stream),
                transient=False,
                refresh_per_second=10,
            )
            self.task = self.bar.add_task(
                f"[jaxsane] fit {name}", total=total, completed=start, rate="compiling", info=""
            )
            self.bar.start()

    def rate(self, now: float | None = None) -> str:
        """``12.3 steps/s, ETA 0:01:05`` (after two steps; before that what is being waited for)."""
        now = time.perf_counter() if now is None else now
        if self.first is None:
            return "compiling the first step"
        t0, n0 = self.first
        if self.completed <= n0 or now <= t0:
            return f"first step {t0 - self.started:.1f} s"
        per = (self.completed - n0) / (now - t0)
        return f"{per:.3g} steps/s, ETA {_clock((self.total - self.completed) / per)}"

    def update(self, completed: int, info: str | Callable[[], str] = "") -> None:
        """Steps done so far; ``info`` a string or a callable returning one (called only when drawn)."""
        if not self.enabled:
            return
        now = time.perf_counter()
        previous, self.completed = self.completed, int(completed)
        if self.first is None and self.completed > self.begin:
            self.first = (now, self.completed)
        if self.tty:
            if now - self.drawn >= 0.1 or self.completed >= self.total:
                self.drawn = now
                self.bar.update(self.task, completed=self.completed, rate=self.rate(now), info=_text(info))
            return
        tenth = max(1, self.total // 10)
        crossed = self.completed // tenth != previous // tenth and now - self.drawn >= 1.0
        if self.drawn < 0 or now - self.drawn >= self.every or crossed:
            self.drawn = now
            self._line(now, _text(info))
        else:
            self.info = info

    def _line(self, now: float, info: str) -> None:
        pct = f" ({self.completed / self.total:.0%})" if self.total else ""
        extra = f", {info}" if info else ""
        self._write(f"[jaxsane] fit {self.name}: step {self.completed}/{self.total}{pct}, {self.rate(now)}{extra}\n")
        self.lines += 1

    def close(self, info: str | Callable[[], str] = "") -> None:
        if self.bar is not None:
            self.bar.stop()
        elif self.enabled and not self.tty and self.lines:
            info = info() if callable(info) else (info or _text(self.info))
            wall = time.perf_counter() - self.started
            self._write(
                f"[jaxsane] fit {self.name}: stopped at step {self.completed}/{self.total} after "
                f"{_clock(wall)}, {self.rate()}{', ' + info if info else ''}\n"
            )
