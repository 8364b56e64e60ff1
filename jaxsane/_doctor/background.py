"""doctor's background pool: the threads that compile and check ahead of the stages that need the results.

:class:`BackgroundPool` is an executor whose threads are daemons and whose futures, waited for from a stage's
thread, let that thread run the queued jobs meanwhile (:class:`_PoolFuture`); :func:`in_background` tells the
compile accounting whether a compile is background work. Host-side; not jit-safe.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

BACKGROUND = "jaxsane-precompile"  # the name prefix of the pool's threads in doctor


class _PoolFuture(concurrent.futures.Future):
    """A :class:`BackgroundPool` job's future. Waited for from outside the pool (:meth:`result`,
    :meth:`exception`), the waiting thread first runs the pool's jobs that have not started: this one first when
    it is still queued, else the oldest. So a stage that waits for work ahead keeps its core busy instead of
    idling while the background thread compiles (doctor needs every queued job's result later anyway)."""

    def __init__(self, pool: BackgroundPool):
        super().__init__()
        self._pool = pool

    def result(self, timeout: float | None = None) -> Any:
        self._pool.help_until(self)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._pool.help_until(self)
        return super().exception(timeout)


_HELPING = threading.local()  # .active: this thread is running a BackgroundPool job while it waits for another


def in_background() -> bool:
    """Whether this thread is doing doctor's work ahead: one of :class:`BackgroundPool`'s threads, or a stage's
    thread running one of its jobs while it waits (:class:`_PoolFuture`). Host-side; not jit-safe."""
    return threading.current_thread().name.startswith(BACKGROUND) or getattr(_HELPING, "active", False)


class BackgroundPool(concurrent.futures.Executor):
    """doctor's background threads. Unlike a ``ThreadPoolExecutor``: its threads are daemons (Python joins a
    ``ThreadPoolExecutor``'s threads at exit, so a Ctrl-C during doctor would wait for a compile nobody wants any
    more; these are never joined, and :meth:`shutdown` cancels what has not started), and a thread outside the
    pool that waits for one of its futures runs the queued jobs meanwhile (:class:`_PoolFuture`). Host-side; not
    jit-safe."""

    def __init__(self, workers: int, name: str):
        self._jobs: collections.deque = collections.deque()
        self._ready = threading.Condition()
        self._closed = False
        self._held = False  # held(): jobs queue up, none starts
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError("[jaxsane] doctor's background pool is shut down")
        future = _PoolFuture(self)
        with self._ready:
            self._jobs.append((future, fn, args, kwargs))
            self._ready.notify()
        return future

    def _take(self, wanted: concurrent.futures.Future | None = None) -> tuple | None:
        """The job of ``wanted`` when it is queued, else the oldest queued job; None when none is queued."""
        with self._ready:
            for job in self._jobs:
                if job[0] is wanted:
                    self._jobs.remove(job)
                    return job
            return self._jobs.popleft() if self._jobs else None

    @staticmethod
    def _run(job: tuple) -> None:
        future, fn, args, kwargs = job
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:  # the future carries it to the stage that waits for it
            future.set_exception(e)
            if isinstance(e, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
                raise  # a Ctrl-C on the main thread while it helped: it stops doctor, not only this job
        else:
            future.set_result(result)

    def _work(self) -> None:
        while True:
            with self._ready:
                while (not self._jobs or self._held) and not self._closed:
                    self._ready.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            self._run(job)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Queue the jobs submitted inside, and start them only on leaving: jobs that read what later submissions
        make first (the gradient check takes the run's telemetry program, which preparing the run makes) find it
        made, whichever thread starts them."""
        with self._ready:
            self._held = True
        try:
            yield
        finally:
            with self._ready:
                self._held = False
                self._ready.notify_all()

    def help_until(self, future: concurrent.futures.Future) -> None:
        """Run queued jobs on this thread until ``future`` is done or none is left to start (then the caller
        blocks on it as usual). A pool thread never helps: it would only reorder its own queue."""
        if threading.current_thread() in self._threads:
            return
        while not future.done():
            job = self._take(future)
            if job is None:
                return
            _HELPING.active = True
            try:
                self._run(job)
            finally:
                _HELPING.active = False

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking work; ``cancel_futures`` cancels the jobs not started; ``wait`` joins the threads."""
        with self._ready:
            self._closed = True
            if cancel_futures:
                while self._jobs:
                    self._jobs.popleft()[0].cancel()
            self._ready.notify_all()
        if wait:
            for thread in self._threads:
                thread.join()
