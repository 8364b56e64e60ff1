"""release_free_memory and Releaser: the allocator's free pages go back to the OS (doctor's calls: tests/doctor)."""

import ctypes
import os
import sys

import pytest

from jaxsane._core import host_memory
from jaxsane._core.host_memory import GROWTH, Releaser, release_free_memory, resident_bytes

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


def test_the_releaser_releases_only_once_the_process_grew(monkeypatch):
    released, resident = [], [10 * GROWTH]
    monkeypatch.setattr(host_memory, "release_free_memory", lambda: released.append(resident[0]) or True)
    monkeypatch.setattr(host_memory, "resident_bytes", lambda: resident[0])
    release = Releaser()
    assert release() is True  # the first time: nothing known yet
    assert release() is False  # not grown: nothing new to return, and a release costs as much
    resident[0] += GROWTH - 1
    assert release() is False
    resident[0] += 1  # grown by GROWTH since the last release
    assert release() is True and len(released) == 2
    resident[0] -= 5 * GROWTH  # the release returned memory: the next one waits for growth from there
    assert release() is False


def test_the_releaser_always_releases_where_the_resident_memory_cannot_be_read(monkeypatch):
    released = []
    monkeypatch.setattr(host_memory, "release_free_memory", lambda: released.append(1) or True)
    monkeypatch.setattr(host_memory, "resident_bytes", lambda: None)
    release = Releaser()
    assert release() and release() and len(released) == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/statm")
def test_resident_bytes_reads_this_process():
    assert abs(resident_bytes() / 2**20 - _rss_mb()) < 64
