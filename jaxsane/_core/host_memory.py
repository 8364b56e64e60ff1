"""Giving the host memory that the process has freed back to the operating system.

XLA:CPU and the compiler allocate and free large host buffers (a program's temporaries, a compile's working
memory) from several threads, and glibc's allocator keeps what they freed in per-thread arenas instead of
returning it: the process's resident memory then grows with every stage that compiles or runs something new,
though its live arrays do not. doctor calls :func:`release_free_memory` after each stage and every few steps of
its run; on the 10M-parameter LM that took its peak RSS from 2.4-2.7 GB to 1.9-2.1 GB, on the 50M from 7.9 GB to
5.0 GB, for about 0.4 s and 1.1 s in all (``docs/benchmarks.md``). A release walks every arena's free memory,
0.05-0.3 s on a heap of a gigabyte whether or not there is anything new to return, so doctor asks
:class:`Releaser`, which releases only once the resident memory has grown since its last release: on the 1M LM
the fourteen releases of a run cost 1.4 s under load and changed its peak by nothing. Host-side; not jit-safe
(and nothing to do with jax's own buffers, which stay as they are).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from typing import Any

GROWTH = 64 * 2**20
"""Resident bytes the process must have gained since :class:`Releaser`'s last release before it releases again."""


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None where the C library has none (macOS, musl, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_memory() -> bool:
    """Return the pages the C allocator holds free, in every arena, to the operating system (glibc's
    ``malloc_trim(0)``); True when that ran, False where the C library has no such call. Safe while other
    threads allocate (glibc locks each arena it trims); takes milliseconds to a few tenths of a second on a
    heap of gigabytes. Host-side; not jit-safe."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def resident_bytes() -> int | None:
    """This process's resident memory in bytes (``/proc/self/statm``), or None where there is no such file.
    Host-side; not jit-safe."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class Releaser:
    """:func:`release_free_memory`, called only when it can matter: the resident memory grew by :data:`GROWTH`
    or more since the last release (always where it cannot be read). What the process freed and kept since then
    is then at most what it gained; a release that finds nothing new costs as much as one that does. Host-side;
    not jit-safe."""

    def __init__(self) -> None:
        self.after_last: int | None = None  # resident bytes right after the last release

    def __call__(self) -> bool:
        """Release when grown; True when a release ran."""
        now = resident_bytes()
        if now is not None and self.after_last is not None and now < self.after_last + GROWTH:
            return False
        released = release_free_memory()
        self.after_last = resident_bytes()
        return released
