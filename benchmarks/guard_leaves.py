"""Guard's first call on a train state with many leaves: bare jit vs guard in each policy.

The state is ``(params, adam_state)`` where ``params`` is a dict of N small arrays of mixed shapes
((8,), (4, 4), (16,), (2, 3, 4), ()) and dtypes (every fourth one bfloat16), so the state has about 3N
leaves. The step computes a loss that touches every parameter, its gradient and an Adam update.

Each (N, way) runs in its own subprocess, which reports the first call's wall time (trace +
compile + run, flags read) in wall and CPU seconds (CPU time is steadier on a shared machine), the
median of the next calls, and its peak RSS
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``). The table puts guard / bare side by side.
Asserts nothing about time.

    python benchmarks/guard_leaves.py [--leaves 250,1000] [--ways bare,raise,skip,warn] [--timeout 900]
"""

import argparse
import json
import os
import subprocess
import sys
import time

WAYS = ("bare", "raise", "skip", "warn")
SHAPES = ((8,), (4, 4), (16,), (2, 3, 4), ())


def child(n: int, way: str, calls: int) -> dict:
    import resource
    import warnings

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxsane

    rng = np.random.default_rng(0)
    params = {}
    for i in range(n):
        dtype = jnp.bfloat16 if i % 4 == 3 else jnp.float32
        params[f"p{i:05d}"] = jnp.asarray(rng.normal(size=SHAPES[i % len(SHAPES)]), dtype)
    tx = optax.adam(1e-3)
    state = (params, tx.init(params))  # eager: a jitted init of 10,000 leaves alone compiles for minutes
    batch = {"x": jnp.asarray(rng.normal(size=(4,)), jnp.float32)}
    n_leaves = len(jax.tree.leaves(state))

    def loss(params, batch):
        total = jnp.float32(0)
        for i, p in enumerate(params.values()):
            total = total + jnp.sum(jnp.tanh(p.astype(jnp.float32) * batch["x"][i % 4]))
        return total

    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    jax.block_until_ready(state)
    if way == "bare":
        fn, flush = jax.jit(step), (lambda: None)
    else:
        fn = jaxsane.guard(jax.jit(step), on_nonfinite=way, locate=False)
        flush = fn.flush
    warnings.simplefilter("ignore")
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn(state, batch)
    jax.block_until_ready(out)
    flush()
    first, first_cpu = time.perf_counter() - t0, time.process_time() - c0
    rss_first = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        out = fn(out[0], batch)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    flush()
    compiles = getattr(fn, "compiles", 1)
    return {"n": n, "way": way, "leaves": n_leaves, "first_s": first, "cpu_s": first_cpu, "rss_mb": rss_first,
            "next_ms": float(np.median(times)) * 1e3 if times else None, "compiles": compiles}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--leaves", default="250,1000,10000", help="comma-separated parameter counts N")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated subset of {','.join(WAYS)}")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per (N, way) subprocess")
    parser.add_argument("--calls", type=int, default=5, help="calls after the first, timed (median)")
    parser.add_argument("--child", nargs=2, metavar=("N", "WAY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(int(args.child[0]), args.child[1], args.calls)), flush=True)
        return
    ways = [w for w in args.ways.split(",") if w]
    if "bare" not in ways:
        ways.insert(0, "bare")
    unknown = set(ways) - set(WAYS)
    if unknown:
        parser.error(f"unknown ways {sorted(unknown)}; choose from {WAYS}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")])}
    print(f"guard first call vs bare jax.jit, Adam state (~3N leaves), per-(N, way) subprocess, "
          f"timeout {args.timeout:.0f} s, load {os.getloadavg()[0]:.2f}")
    print(f"{'N':>6} {'leaves':>7} {'way':<6}{'first s':>9}{'cpu s':>8}{'peak MB':>9}{'next ms':>9}{'x time':>8}"
          f"{'x cpu':>7}{'x mem':>7}{'compiles':>9}")
    for n in [int(v) for v in args.leaves.split(",") if v]:
        base = None
        for way in ways:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", str(n), way, "--calls", str(args.calls)]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
            except subprocess.TimeoutExpired:
                print(f"{n:>6} {'':>7} {way:<6}  over {args.timeout:.0f} s (killed)", flush=True)
                continue
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(f"{n:>6} {'':>7} {way:<6}  failed (rc {proc.returncode}): {proc.stderr.strip()[-300:]}",
                      flush=True)
                continue
            r = json.loads(lines[-1][len("RESULT "):])
            if way == "bare":
                base = r
            ratio_t = f"{r['first_s'] / base['first_s']:.2f}" if base else "-"
            ratio_c = f"{r['cpu_s'] / base['cpu_s']:.2f}" if base else "-"
            ratio_m = f"{r['rss_mb'] / base['rss_mb']:.2f}" if base else "-"
            next_ms = f"{r['next_ms']:.2f}" if r["next_ms"] is not None else "-"
            print(f"{n:>6} {r['leaves']:>7} {way:<6}{r['first_s']:>9.2f}{r['cpu_s']:>8.2f}{r['rss_mb']:>9.0f}"
                  f"{next_ms:>9}{ratio_t:>8}{ratio_c:>7}{ratio_m:>7}{r['compiles']:>9}", flush=True)


if __name__ == "__main__":
    main()
