"""Benchmark: jaxsane.check_data on MNIST-size-times-16 data with planted leaks and duplicates.

1,000,000 x 784 uint8 train rows and 100,000 eval rows (random pixels, 10 classes), with
``--leaks`` eval rows copied from train and ``--dups`` train rows copied from other train rows.
Prints the time and peak extra memory of check_data (all checks), checks that every planted
row is found, and compares with two references measured the same way and interleaved:
one plain pass over the data (``x.max()``) and ``np.unique(x, axis=0)`` (sort-based exact
deduplication) on the eval split. Asserts nothing about time.

Run: .venv/bin/python benchmarks/data_checks.py [--rows 1000000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
import tracemalloc

import numpy as np

import jaxsane
from jaxsane._data.row_hash import hash_rows


def make_data(rows: int, eval_rows: int, features: int, leaks: int, dups: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (rows, features), dtype=np.uint8)
    y = rng.integers(0, 10, rows).astype(np.int32)
    xe = rng.integers(0, 256, (eval_rows, features), dtype=np.uint8)
    ye = rng.integers(0, 10, eval_rows).astype(np.int32)
    # leaked: eval rows that are copies of train rows
    leak_eval = np.sort(rng.choice(eval_rows, leaks, replace=False))
    leak_train = rng.choice(rows, leaks, replace=False)
    xe[leak_eval] = x[leak_train]
    # duplicates inside train: copies of earlier rows at later positions
    dup_at = np.sort(rng.choice(np.arange(rows // 2, rows), dups, replace=False))
    dup_of = rng.choice(rows // 2, dups, replace=False)
    x[dup_at] = x[dup_of]
    return x, y, xe, ye, set(leak_eval.tolist()), set(dup_at.tolist())


def batches(x, y, size):
    """A single-pass generator, as a data loader would yield."""
    for s in range(0, len(x), size):
        yield {"x": x[s:s + size], "y": y[s:s + size]}


def timed(fn, trace: bool = False):
    if trace:
        tracemalloc.start()
        tracemalloc.reset_peak()
    t = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t
    peak = 0
    if trace:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return out, dt, peak


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--eval-rows", type=int, default=100_000)
    ap.add_argument("--features", type=int, default=784)
    ap.add_argument("--leaks", type=int, default=500)
    ap.add_argument("--dups", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    x, y, xe, ye, leaked, duplicated = make_data(args.rows, args.eval_rows, args.features, args.leaks, args.dups)
    data_bytes = x.nbytes + y.nbytes + xe.nbytes + ye.nbytes
    rss_data = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    times = {"check_data (all checks)": [], "hash_rows(train) only": [], "one pass x.max()": [],
             "np.unique(eval, axis=0)": [], "check_data dedup of eval": [],
             "check_data, 1000-row batch stream": []}
    peaks = []
    diagnosis = stream_codes = None
    for _ in range(args.repeats):  # interleaved A, B, C, ... per repeat; medians below
        diagnosis, dt, peak = timed(lambda: jaxsane.check_data((x, y), (xe, ye), num_classes=10), trace=True)
        times["check_data (all checks)"].append(dt)
        peaks.append(peak)
        times["hash_rows(train) only"].append(timed(lambda: hash_rows(x))[1])
        times["one pass x.max()"].append(timed(lambda: x.max())[1])
        times["np.unique(eval, axis=0)"].append(timed(lambda: np.unique(xe, axis=0))[1])
        times["check_data dedup of eval"].append(timed(lambda: jaxsane.check_data(xe))[1])
        stream, dt, _ = timed(lambda: jaxsane.check_data(batches(x, y, 1000), batches(xe, ye, 1000), num_classes=10))
        times["check_data, 1000-row batch stream"].append(dt)
        stream_codes = stream.codes
    rss_end = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    leak = diagnosis.by_code("data.leakage")
    dup = diagnosis.by_code("data.duplicates")
    leak_count = leak[0].extra["count"] if leak else 0
    dup_count = dup[0].extra["count"] if dup else 0
    # every planted row found: counts equal (random rows never collide) and first indices are planted ones
    leak_ok = leak_count == len(leaked) and set(leak[0].extra["eval_indices"]) <= leaked
    dup_ok = dup_count == len(duplicated) and set(dup[0].extra["indices"]) <= duplicated

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"data: train {x.shape} {x.dtype} + eval {xe.shape}, {data_bytes / 2**20:.0f} MiB; "
          f"{args.leaks} leaked and {args.dups} duplicated rows planted; median of {args.repeats}")
    print(f"{'measurement':32} {'seconds':>9} {'ratio':>24}")
    base = med["one pass x.max()"]
    for k, v in med.items():
        print(f"{k:32} {v:9.3f} {v / base:10.1f}x one data pass")
    print(f"{'np.unique / hash dedup (eval)':32} {'':9} "
          f"{med['np.unique(eval, axis=0)'] / med['check_data dedup of eval']:10.1f}x")
    peak = statistics.median(peaks)
    print(f"peak extra memory of check_data (tracemalloc): {peak / 2**20:.1f} MiB = "
          f"{peak / data_bytes:.3f}x the data size")
    print(f"process max RSS: before data {rss0 / 2**20:.0f} MiB, with data {rss_data / 2**20:.0f} MiB, "
          f"after checks {rss_end / 2**20:.0f} MiB; (max RSS - RSS before data) / data = "
          f"{(rss_end - rss0) / data_bytes:.2f}x")
    print(f"leakage: found {leak_count} of {len(leaked)} planted ({'all' if leak_ok else 'MISSING'}); "
          f"duplicates: found {dup_count} of {len(duplicated)} planted ({'all' if dup_ok else 'MISSING'})")
    print("findings:", diagnosis.codes, "| stream findings:", stream_codes)
    for f in diagnosis:
        print("  ", str(f).splitlines()[0][:160])


if __name__ == "__main__":
    main()
