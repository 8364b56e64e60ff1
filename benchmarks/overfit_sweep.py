"""Overfit sweep over K = 16 configurations, three ways, on the same step and the same batch:

  vmapped     jaxsane.overfit: 3 seeds x 5 learning rates + the constant-input baseline, vmapped,
              one compiled while_loop of scanned chunks (early exit off, so every way runs all steps);
              on CPU, one equal group of configurations per core runs that program in its own thread,
              and the program compiles in a background thread while the initial states are built
              (so its "compile s" overlaps other work, and "wall - compile" understates its run);
  one group   the same with groups=1: one vmapped program of all 16 configurations, no threads;
  sequential  one jitted lax.scan over the steps, compiled once and called once per configuration;
  loop        a typical Python loop calling a jitted step per step (losses kept on device, no per-step
              host sync; the loop with float(loss) per step is shown too).

Every way starts from fresh init states and ends with the losses on the host; times include
compilation, as a user running the sweep once sees them (the compile part is also shown on its own).
One untimed warm-up of every way first; then medians over interleaved repetitions.
Prints a table; asserts nothing about time.

    .venv/bin/python benchmarks/overfit_sweep.py [--steps 2000] [--hidden 32] [--reps 3]
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxsane
from jaxsane._experiment.contract import PureExperiment
from jaxsane._overfit.setup import constant_input_batch, learning_rate_paths, set_learning_rate
from jaxsane.examples._digits import load_digits_split

SEEDS = (0, 1, 2)
LRS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)


def make_experiment(hidden: int, batch_size: int) -> jaxsane.Experiment:
    """A 64-hidden-hidden-10 MLP on 16 digits, pure optax with an injectable learning rate."""
    x, y, _, _ = load_digits_split()
    batch = {"x": x[:batch_size], "y": y[:batch_size]}
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    sizes = (64, hidden, hidden, 10)

    def init(key):
        params = []
        for n_in, n_out in zip(sizes[:-1], sizes[1:]):
            key, sub = jax.random.split(key)
            params.append({"w": jax.random.normal(sub, (n_in, n_out)) * math.sqrt(2.0 / n_in), "b": jnp.zeros(n_out)})
        return params, tx.init(params)

    def apply(params, x):
        for layer in params[:-1]:
            x = jax.nn.relu(x @ layer["w"] + layer["b"])
        return x @ params[-1]["w"] + params[-1]["b"]

    def loss(params, batch):
        logits = apply(params, batch["x"])  # one-hot cross-entropy: no gather/scatter in the step
        return optax.softmax_cross_entropy(logits, jax.nn.one_hot(batch["y"], logits.shape[-1])).mean()

    @jax.jit
    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    return jaxsane.Experiment(init=init, step=step, train=batch, loss=loss, apply=apply, name="bench_mlp")


def configurations(adapted: PureExperiment, batch):
    """The same 16 (state, batch) pairs the vmapped sweep builds: 15 real + the constant-input one."""
    const = constant_input_batch(adapted.experiment, batch)
    out = []
    for seed in SEEDS:
        for lr in LRS:
            out.append((seed, lr, batch))
    out.append((SEEDS[0], 1e-3, const))
    return out


def init_state(adapted, seed, lr):
    state = adapted.init(jax.random.key(seed))
    return set_learning_rate(state, set(learning_rate_paths(state)), jnp.float32(lr))


GROUPS = {}


def run_vmapped(exp, batch, steps, groups=None):
    result = jaxsane.overfit(exp, batch, seeds=len(SEEDS), learning_rates=LRS, steps=steps, early_exit=False,
                             groups=groups)
    assert len(result.configs) == 16 and result.losses.shape == (16, steps)
    GROUPS[groups] = result.groups
    return result.losses, result.compiles, result.compile_seconds


def run_sequential(exp, batch, steps):
    adapted = PureExperiment(exp)
    traces = [0]

    def scan(state, b):
        traces[0] += 1
        def body(s, _):
            s, m = adapted.step(s, b)
            return s, m["loss"]
        return jax.lax.scan(body, state, None, length=steps)[1]

    configs = configurations(adapted, batch)
    start = time.perf_counter()
    first = init_state(adapted, *configs[0][:2])
    scan = jax.jit(scan, donate_argnums=(0,)).lower(first, configs[0][2]).compile()
    compile_s = time.perf_counter() - start
    losses = [scan(init_state(adapted, seed, lr), b) for seed, lr, b in configs]
    return np.stack([np.asarray(l) for l in losses]), traces[0], compile_s


def run_loop(exp, batch, steps, sync=False):
    adapted = PureExperiment(exp)
    traces = [0]

    def step(state, b):
        traces[0] += 1
        return adapted.step(state, b)

    configs = configurations(adapted, batch)
    start = time.perf_counter()
    step = jax.jit(step, donate_argnums=(0,)).lower(init_state(adapted, *configs[0][:2]), configs[0][2]).compile()
    compile_s = time.perf_counter() - start
    all_losses = []
    for seed, lr, b in configs:
        state = init_state(adapted, seed, lr)
        b = jax.tree_util.tree_map(jnp.asarray, b)
        losses = []
        for _ in range(steps):
            state, metrics = step(state, b)
            losses.append(float(metrics["loss"]) if sync else metrics["loss"])
        all_losses.append(np.asarray(jnp.stack(losses)) if not sync else np.asarray(losses))
    return np.stack(all_losses), traces[0], compile_s


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    exp = make_experiment(args.hidden, args.batch)
    batch = exp.train
    ways = {"vmapped": lambda: run_vmapped(exp, batch, args.steps),
            "vmapped, one group": lambda: run_vmapped(exp, batch, args.steps, groups=1),
            "sequential scans": lambda: run_sequential(exp, batch, args.steps),
            "python loop": lambda: run_loop(exp, batch, args.steps),
            "python loop + float(loss)": lambda: run_loop(exp, batch, args.steps, sync=True)}
    times = {k: [] for k in ways}
    compile_times = {k: [] for k in ways}
    compiles = {}
    losses = {}
    run_vmapped(exp, batch, 25), run_sequential(exp, batch, 25), run_loop(exp, batch, 2)  # warm eager ops (init)
    for _ in range(args.reps):  # interleaved: A, B, C, D, A, B, C, D, ...
        for name, fn in ways.items():
            start = time.perf_counter()
            losses[name], compiles[name], compile_s = fn()
            times[name].append(time.perf_counter() - start)
            compile_times[name].append(compile_s)
    ref = losses["sequential scans"]
    print(f"overfit sweep, K=16 configurations x {args.steps} steps, MLP 64-{args.hidden}-{args.hidden}-10, "
          f"batch {args.batch}, {jax.default_backend()} ({jax.devices()[0].device_kind}), "
          f"{platform.python_version()}, jax {jax.__version__}; median of {args.reps} interleaved runs; "
          f"vmapped ran {GROUPS[None]} group(s) side by side")
    print(f"{'way':28} {'wall s':>8} {'compiles':>9} {'compile s':>10} {'wall - compile':>15} "
          f"{'vmapped speed-up':>17} {'(excl. compile)':>16} {'max |loss - seq|':>17}")
    vm = statistics.median(times["vmapped"])
    vm_run = statistics.median([t - c for t, c in zip(times["vmapped"], compile_times["vmapped"])])
    for name in ways:
        t = statistics.median(times[name])
        c = statistics.median(compile_times[name])
        run = statistics.median([a - b for a, b in zip(times[name], compile_times[name])])
        diff = float(np.nanmax(np.abs(losses[name] - ref)))
        print(f"{name:28} {t:8.2f} {compiles[name]:9d} {c:10.2f} {run:15.2f} {t / vm:16.2f}x {run / vm_run:15.2f}x "
              f"{diff:17.2e}")
    print("all runs (s): " + "; ".join(f"{k}: {', '.join(f'{t:.2f}' for t in v)}" for k, v in times.items()))


if __name__ == "__main__":
    main()
