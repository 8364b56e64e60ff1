"""Update-underflow telemetry cost: the Monitor with and without the float32 shadow step, on a pure-bf16 model.

  .venv/bin/python benchmarks/underflow_overhead.py [--rounds 5] [--steps 200] [--every 50]

Variants, each a loop of ``--steps`` steps per round (interleaved rounds, per-step medians):
  bare                 jax.jit(adapted.step)
  monitor              Monitor(every=E, underflow=False): norms + grads every E steps (the existing telemetry)
  monitor+underflow    Monitor(every=E, underflow=True): plus the float32 shadow step on telemetry steps (what
                       Monitor and fit do by default for a model with bf16/fp16 parameters)

Prints per-step medians and their ratios to ``bare`` side by side. A float32 model pays nothing for the
underflow measure (no shadow is traced). Asserts nothing; the goal is monitor+underflow within the
monitor's 1.05x on long runs (every=50).
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


def bf16_mlp(sizes=(784, 512, 512, 10), batch=128, steps=64):
    tx = optax.adam(1e-4)

    def init(key):
        params = []
        for n_in, n_out in zip(sizes[:-1], sizes[1:]):
            key, sub = jax.random.split(key)
            w = jax.random.normal(sub, (n_in, n_out)) * jnp.sqrt(2.0 / n_in)
            params.append({"w": w.astype(jnp.bfloat16), "b": jnp.zeros(n_out, jnp.bfloat16)})
        return params, tx.init(params)

    def loss(params, b):
        x = b["x"].astype(jnp.bfloat16)
        for layer in params[:-1]:
            x = jax.nn.relu(x @ layer["w"] + layer["b"])
        logits = (x @ params[-1]["w"] + params[-1]["b"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    def step(state, b):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, b)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    rng = np.random.default_rng(0)
    data = [{"x": rng.normal(size=(batch, sizes[0])).astype(np.float32), "y": rng.integers(0, 10, batch)}
            for _ in range(steps)]
    return jaxsane.Experiment(init=init, step=step, train=data, loss=loss, name="bf16_mlp")


BARE: dict = {}


def run(variant: str, pure: PureExperiment, data: list, steps: int, every: int, monitors: dict) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) per step of one loop of ``variant``."""
    state = pure.init(jax.random.key(0))
    start, cpu = time.perf_counter(), time.process_time()
    if variant == "bare":
        fn = BARE.setdefault("fn", jax.jit(pure.step))
        out = None
        for i in range(steps):
            state, out = fn(state, data[i % len(data)])
        jax.block_until_ready((state, out))
    else:
        mon = monitors[variant]
        mon.history = jaxsane.History()
        for i in range(steps):
            batch = data[i % len(data)]
            state, metrics = mon.step(state, batch, mon.mode_for(i))
            mon.record(i, metrics)
        mon.pull()
        jax.block_until_ready(state)
    return (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=50)
    args = ap.parse_args()
    exp = bf16_mlp()
    pure = PureExperiment(exp)
    monitors = {
        "monitor": Monitor(pure, every=args.every, dead_every=0, underflow=False),
        "monitor+underflow": Monitor(pure, every=args.every, dead_every=0, underflow=True),
    }
    variants = ["bare", "monitor", "monitor+underflow"]
    for v in variants:  # warm up: compile every program once
        run(v, pure, exp.train, max(2, args.every + 1), args.every, monitors)
    times: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            times[v].append(run(v, pure, exp.train, args.steps, args.every, monitors))

    def paired(v: str, ref: str, k: int) -> float:  # median over rounds of the per-round ratio
        return statistics.median(a[k] / b[k] for a, b in zip(times[v], times[ref]))

    print(f"bf16 MLP 784-512-512-10, batch 128, Adam; {args.steps} steps x {args.rounds} rounds, every={args.every}")
    print("ratios: median of per-round paired ratios, wall clock / process CPU time")
    print(f"{'variant':<20}{'ms/step':>10}{'x bare (wall/cpu)':>22}{'x monitor (wall/cpu)':>24}")
    for v in variants:
        t = statistics.median(w for w, _ in times[v])
        xb = f"{paired(v, 'bare', 0):.3f} / {paired(v, 'bare', 1):.3f}"
        xm = f"{paired(v, 'monitor', 0):.3f} / {paired(v, 'monitor', 1):.3f}"
        print(f"{v:<20}{1e3 * t:>10.3f}{xb:>22}{xm:>24}")
    h = monitors["monitor+underflow"].history
    print(f"update_lost rows recorded: {len(h.update_lost)} (per leaf, first row: {np.round(h.update_lost[0], 2)})")


if __name__ == "__main__":
    main()
