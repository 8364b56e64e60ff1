"""Giving the host memory that the process has freed back to the operating system.

XLA:CPU and the compiler allocate and free large host buffers (a program's temporaries, a compile's working
memory) from several threads, and glibc's allocator keeps what they freed in per-thread arenas instead of
returning it: the process's resident memory then grows with every stage that compiles or runs something new,
though its live arrays do not. doctor calls :func:`release_free_memory` after each stage and every few steps of
its run; on the 10M-parameter LM that took its peak RSS from 2.4-2.7 GB to 1.9-2.1 GB, on the 50M from 7.9 GB to
5.0 GB, for about 0.4 s and 1.1 s in all (``docs/benchmarks.md``). Host-side; not jit-safe (and nothing to do with
jax's own buffers, which stay as they are).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any


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
