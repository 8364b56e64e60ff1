"""release_free_memory: the allocator's free pages go back to the OS (doctor's calls: tests/doctor)."""

import ctypes
import os
import sys

import pytest

from jaxsane._core import host_memory
from jaxsane._core.host_memory import release_free_memory

glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or host_memory._malloc_trim() is None, reason="glibc's malloc_trim"
)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@glibc
def test_freed_fragmented_heap_memory_goes_back_to_the_os():
    # 24k blocks of 8 KB from malloc (below its mmap threshold, so from the heap), every 16th kept: the freed ones
    # sit between live blocks, where free() alone cannot give them back
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(8192) for _ in range(24_000)]
    for p in blocks:
        ctypes.memset(p, 1, 8192)  # touched: resident
    kept = blocks[::16]
    for i, p in enumerate(blocks):
        if i % 16:
            libc.free(p)
    before = _rss_mb()
    assert release_free_memory() is True
    after = _rss_mb()
    for p in kept:
        libc.free(p)
    assert before - after > 100, (before, after)  # ~175 MB of free pages between the kept blocks


def test_without_malloc_trim_it_says_it_did_nothing(monkeypatch):
    monkeypatch.setattr(host_memory, "_malloc_trim", lambda: None)
    assert release_free_memory() is False
