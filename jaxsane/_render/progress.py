"""Progress of a long host-side job on stderr: a rich spinner on a terminal, plain
``[jaxsane] name: message`` lines otherwise (CI logs), nothing when turned off. Not jit-safe."""

from __future__ import annotations

import sys
import time
from typing import Any


class Progress:
    """``with Progress(enabled, "overfit") as p: p.say("compiling ...")``; each :meth:`say` replaces the
    spinner's text on a terminal, or writes one line with the seconds elapsed otherwise. Not jit-safe."""

    def __init__(self, enabled: bool, name: str, stream: Any = None):
        self.enabled, self.name = bool(enabled), name
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self._status: Any = None
        self._start = time.perf_counter()

    def __enter__(self) -> Progress:
        self._start = time.perf_counter()
        return self

    def say(self, message: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            text = f"[jaxsane] {self.name}: {message}"
            if self._status is None:
                from rich.console import Console

                self._status = Console(file=self.stream).status(text)
                self._status.__enter__()
            else:
                self._status.update(text)
        else:
            self.stream.write(f"[jaxsane] {self.name}: {message} ({time.perf_counter() - self._start:.1f} s)\n")
            self.stream.flush()

    def __exit__(self, *exc: Any) -> None:
        if self._status is not None:
            self._status.__exit__(None, None, None)
            self._status = None
