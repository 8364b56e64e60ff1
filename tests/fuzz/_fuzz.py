"""Shared settings of the fuzz tier (tests/fuzz): hypothesis profiles, a per-example time limit, and a
recorder of how many cases ran.

Every fuzz test is ``slow`` and reproducible: ``derandomize=True`` draws the same cases on every run (CI
sees what a developer sees), ``database=None`` keeps no state between runs, ``deadline=None`` because one
example's time depends on jax's compile cache, not on the code under test (the per-example time limit
below is the hang check instead). ``JAXSANE_FUZZ_EXAMPLES=N`` scales every test's example count (e.g. 10
for a longer local hunt); the defaults keep the whole tier near two minutes on two cores.
"""

import contextlib
import os
import signal
import time

import pytest

hypothesis = pytest.importorskip("hypothesis")  # the `test` extra installs it; without it the tier skips
from hypothesis import HealthCheck, settings  # noqa: E402

SCALE = float(os.environ.get("JAXSANE_FUZZ_EXAMPLES", "1"))


def fuzz_settings(examples: int, *extra_checks: HealthCheck) -> settings:
    """``examples`` cases (times ``$JAXSANE_FUZZ_EXAMPLES``), derandomized, no deadline, no database.
    ``extra_checks``: health checks suppressed, each justified at its call site."""
    return settings(
        max_examples=max(1, int(examples * SCALE)),
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=True,
        suppress_health_check=list(extra_checks),
    )


class Hang(Exception):
    """An example ran past its time limit."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise :class:`Hang` in the main thread if the body runs longer than ``seconds`` (SIGALRM)."""

    def on_alarm(signum, frame):
        raise Hang(f"the example ran longer than {seconds} s")

    started = time.monotonic()
    old = signal.signal(signal.SIGALRM, on_alarm)
    outer, interval = signal.setitimer(signal.ITIMER_REAL, seconds)  # pytest-timeout's timer, if it set one
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if outer > 0:  # give the outer timer (pytest-timeout's) back what is left of it
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - started), 0.001), interval)


def tree_listing(root: str) -> dict:
    """``{relative path: (size, mtime_ns)}`` of every file and directory under ``root``."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            st = os.lstat(path)
            out[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns)
    return out
