"""Guard overhead with ``hang_timeout`` on vs off, on the 8-device data-parallel step, several processes.

Starts ``--processes`` real processes on 127.0.0.1 (``jax.distributed``, gloo CPU collectives), each
with ``8 // processes`` CPU devices, so the mesh has 8 devices over all processes. Each runs the
data-parallel MLP step of ``guard_sharded_overhead.py`` (784-512-512-10, Adam, global batch 2048, params
replicated, batch split on "data") bare, under ``jaxsane.guard`` and under ``guard(hang_timeout=600)``
(watchdog thread and key-value records live), interleaved, and process 0 prints the medians side by
side. Then the hot path alone: the per-call cost of the watch (``HangWatch.run`` around a no-op
function) against calling the no-op directly, in the same process (its watchdog running). Nothing is
asserted.

    python benchmarks/guard_hang_overhead.py [--steps 40] [--processes 2]
"""

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def child(pid: int, n: int, port: str, steps: int) -> None:
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid, initialization_timeout=120)
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxsane
    from jaxsane._dist.hang import HangWatch
    sys.path.insert(0, HERE)
    import guard_sharded_overhead as base

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    local = 2048 // n
    rng = np.random.default_rng(pid)
    batch = {"x": jax.make_array_from_process_local_data(rows, rng.normal(size=(local, 784)).astype(np.float32)),
             "y": jax.make_array_from_process_local_data(rows, rng.integers(0, 10, size=(local,)).astype(np.int32))}
    params = base.init(jax.random.key(0))
    state = jax.tree.map(lambda a: jax.make_array_from_process_local_data(rep, np.asarray(a)),
                         (params, base.tx.init(params)))
    fn = jax.jit(base.step)
    variants = [("bare", fn), ("guard", jaxsane.guard(fn)), ("guard(hang_timeout=600)",
                                                            jaxsane.guard(fn, hang_timeout=600))]
    states = [state] * len(variants)
    for i, (_, f) in enumerate(variants):
        for _ in range(3):
            states[i], m = f(states[i], batch)
        jax.block_until_ready((states[i], m))
    times = [[] for _ in variants]
    for _ in range(steps):
        for i, (_, f) in enumerate(variants):
            t = time.perf_counter()
            states[i], m = f(states[i], batch)
            jax.block_until_ready((states[i], m))
            times[i].append(time.perf_counter() - t)
    for _, f in variants[1:]:
        f.flush()
        assert not f.failures, f.failures
    # the hot path alone: a live watch (its thread publishing to the key-value store) around a no-op
    watch = HangWatch(600.0)
    noop = lambda: None  # noqa: E731
    watch.run(0, noop)
    reps, hot, plain = 20000, [], []
    for k in range(5):
        t = time.perf_counter()
        for i in range(reps):
            watch.run(i, noop)
        hot.append((time.perf_counter() - t) / reps)
        t = time.perf_counter()
        for i in range(reps):
            noop()
        plain.append((time.perf_counter() - t) / reps)
    if pid == 0:
        print(f"guard with hang_timeout on vs off: {n} processes on 127.0.0.1 (gloo), {jax.device_count()} CPU "
              f"devices in all, data-parallel MLP {base.SIZES}, Adam, global batch 2048, median of {steps} "
              f"interleaved steps (process 0's times)")
        print(f"{'variant':26s} {'median ms':>10s} {'ratio':>7s} {'paired':>7s}")
        for i, (name, _) in enumerate(variants):
            med = statistics.median(times[i])
            paired = statistics.median(t / b for t, b in zip(times[i], times[0]))
            print(f"{name:26s} {med * 1e3:10.2f} {med / statistics.median(times[0]):7.3f}x {paired:6.3f}x")
        print(f"hot path per call: HangWatch.run(no-op) {statistics.median(hot) * 1e6:.2f} us, the no-op alone "
              f"{statistics.median(plain) * 1e6:.2f} us: the watch adds "
              f"{(statistics.median(hot) - statistics.median(plain)) * 1e6:.2f} us per guarded call")
    sys.stdout.flush()
    jax.distributed.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--processes", type=int, default=2, choices=(1, 2, 4, 8))
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        pid, n, port = args.child
        child(int(pid), int(n), port, args.steps)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    n = args.processes
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={8 // n}",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen([sys.executable, __file__, "--steps", str(args.steps), "--child", str(i), str(n), port],
                              env=env, stderr=subprocess.DEVNULL) for i in range(n)]
    try:
        for p in procs:
            p.wait(timeout=900)
    finally:
        for p in procs:  # only the processes started here
            if p.poll() is None:
                p.kill()


if __name__ == "__main__":
    main()
