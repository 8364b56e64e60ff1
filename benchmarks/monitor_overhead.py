"""Monitor overhead: the monitored step against the bare jitted step (interleaved rounds, medians).

  .venv/bin/python benchmarks/monitor_overhead.py [--rounds 15] [--steps 500] [--only digits|mlp]

Variants, each a full training loop of ``--steps`` steps per round:
  bare            jax.jit(adapted.step)
  monitor         Monitor defaults, as fit uses them on long runs (norms + grads every 50 steps, dead
                  ReLUs every 250, host-side queueing and batched pulls every 100 steps)
  monitor/every=10  norms + grads every 10 steps, dead ReLUs every 50
  monitor/every=1 telemetry on every step (what doctor's short run uses), for reference
  guard           guard(jax.jit(adapted.step))
  guard+monitor   guard(Monitor.step): what jaxsane.fit runs

Prints per-step wall-clock medians, their ratio to ``bare``, the median of per-round paired ratios
(wall and process CPU time: on a shared, overloaded machine the CPU-time ratio is the steadier one).
Asserts nothing about time; the target for ``monitor`` is <= 1.05x on CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxsane
from jaxsane._experiment.contract import PureExperiment
from jaxsane._monitor.monitor import Monitor


def mlp_experiment(sizes=(784, 1024, 1024, 10), batch=256):
    """The DESIGN.md reference: MLP 784-1024-1024-10, batch 256, Adam."""
    tx = optax.adam(1e-3)

    def init(key):
        params = []
        for n_in, n_out in zip(sizes[:-1], sizes[1:]):
            key, sub = jax.random.split(key)
            params.append({"w": jax.random.normal(sub, (n_in, n_out)) * jnp.sqrt(2.0 / n_in), "b": jnp.zeros(n_out)})
        return params, tx.init(params)

    def apply(params, x):
        for layer in params[:-1]:
            x = jax.nn.relu(x @ layer["w"] + layer["b"])
        return x @ params[-1]["w"] + params[-1]["b"]

    def loss(params, b):
        return optax.softmax_cross_entropy_with_integer_labels(apply(params, b["x"]), b["y"]).mean()

    @jax.jit
    def step(state, b):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, b)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(batch, sizes[0])).astype(np.float32),
            "y": rng.integers(0, sizes[-1], batch).astype(np.int32)}
    return jaxsane.Experiment(init=init, step=step, train=data, loss=loss, apply=apply, name="mlp")


def digits_experiment():
    from jaxsane.examples import load
    exp = load("digits_optax")
    batch = next(iter(exp.train))
    return jaxsane.Experiment(init=exp.init, step=exp.step, train=batch, loss=exp.loss, apply=exp.apply,
                              name="digits_optax")


def make_loops(exp):
    adapted = PureExperiment(exp)
    state0 = adapted.init(jax.random.key(0))
    batch = jax.device_put(exp.train)
    bare = jax.jit(adapted.step)

    def loop_bare(n):
        s = state0
        for _ in range(n):
            s, m = bare(s, batch)
        return s

    def loop_monitor(mon):
        def run(n):
            mon.history = type(mon.history)()
            mon._pending = []
            s = state0
            for i in range(n):
                s, m = mon.step(s, batch, mon.mode_for(i))
                mon.record(i, m)
            mon.pull()
            return s
        return run

    def loop_guard(n):
        s = state0
        for _ in range(n):
            s, m = guarded(s, batch)
        guarded.flush()
        return s

    guarded = jaxsane.guard(bare)
    default = Monitor(adapted)                    # fit defaults on long runs
    every10 = Monitor(adapted, every=10, dead_every=50)
    dense = Monitor(adapted, every=1, dead_every=5, log_every=50)
    fit_mon = Monitor(adapted)
    for mon in (default, every10, dense, fit_mon):
        mon._layout(state0, batch)
    return {
        "bare": loop_bare,
        "monitor": loop_monitor(default),
        "monitor/every=10": loop_monitor(every10),
        "monitor/every=1": loop_monitor(dense),
        "guard": loop_guard,
        "guard+monitor": _guard_monitor(fit_mon, state0, batch),
    }


def _guard_monitor(mon, state0, batch):
    g = jaxsane.guard(mon.compiled_step)

    def run(n):
        mon.history = type(mon.history)()
        mon._pending = []
        s = state0
        for i in range(n):
            s, m = g(s, batch, mon.mode_for(i))
            mon.record(i, m)
        g.flush()
        mon.pull()
        return s
    return run


def measure(loops, rounds, steps):
    """Interleaved rounds (bare, monitor, ..., bare, monitor, ...): per-step medians, and the median of
    each variant's per-round ratio to the bare run of the same round (paired, robust to load drift)."""
    for run in loops.values():              # compile every variant (and every mode) first
        jax.block_until_ready(run(min(steps, 60)))
    times = {k: [] for k in loops}
    cpu = {k: [] for k in loops}
    for _ in range(rounds):
        for name, run in loops.items():
            t, c = time.perf_counter(), time.process_time()
            jax.block_until_ready(run(steps))
            times[name].append((time.perf_counter() - t) / steps)
            cpu[name].append((time.process_time() - c) / steps)
    med = {k: statistics.median(v) for k, v in times.items()}
    paired = {k: statistics.median(a / b for a, b in zip(v, times["bare"])) for k, v in times.items()}
    paired_cpu = {k: statistics.median(a / b for a, b in zip(v, cpu["bare"])) for k, v in cpu.items()}
    paired_guard = (statistics.median(a / b for a, b in zip(times["guard+monitor"], times["guard"])),
                    statistics.median(a / b for a, b in zip(cpu["guard+monitor"], cpu["guard"])))
    return med, paired, paired_cpu, paired_guard


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--only", choices=["digits", "mlp"])
    args = p.parse_args()
    cases = {"digits": digits_experiment, "mlp": mlp_experiment}
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {args.rounds} interleaved rounds of "
          f"{args.steps} steps; per-step medians")
    print(f"{'model':14s} {'variant':17s} {'ms/step':>9s} {'x bare':>8s} {'paired':>8s} {'cpu':>8s}")
    for name, factory in cases.items():
        if args.only and args.only != name:
            continue
        loops = make_loops(factory())
        med, paired, paired_cpu, paired_guard = measure(loops, args.rounds, args.steps)
        for variant, t in med.items():
            print(f"{name:14s} {variant:17s} {t * 1e3:9.3f} {t / med['bare']:8.3f} {paired[variant]:8.3f} "
                  f"{paired_cpu[variant]:8.3f}")
        print(f"{name:14s} {'guard+monitor':17s} {'':9s} {med['guard+monitor'] / med['guard']:8.3f} "
              f"{paired_guard[0]:8.3f} {paired_guard[1]:8.3f}  (x guard)")

if __name__ == "__main__":
    main()
