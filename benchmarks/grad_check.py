#!/usr/bin/env python
"""jaxsane.check_grads on a ~2M-parameter MLP (784-1024-1024-10, batch 128) on CPU.

Side by side, interleaved (A, B, C, A, B, C...), medians of ``--repeats`` runs, wall clock:
  * one jitted float32 value_and_grad of the loss (the unit),
  * ``jax.test_util.check_grads`` on the whole parameter tree in float64 (one random direction for
    all 2M parameters at once: it cannot say which leaf is wrong),
  * ``jaxsane.check_grads`` (float64, every leaf on its own, fwd + rev, compile included),
  * the projected cost of per-parameter central differences (2 float64 forward passes each).
Prints a table; asserts nothing about time.

    python benchmarks/grad_check.py [--repeats 3] [--batch 128]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.test_util  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxsane  # noqa: E402

SIZES = (784, 1024, 1024, 10)


def init(key):
    params = []
    for n_in, n_out in zip(SIZES[:-1], SIZES[1:]):
        key, sub = jax.random.split(key)
        params.append({"w": jax.random.normal(sub, (n_in, n_out)) * np.sqrt(2.0 / n_in), "b": jnp.zeros(n_out)})
    return params


def loss(params, batch):
    x = batch["x"]
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    logits = x @ params[-1]["w"] + params[-1]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(args.batch, SIZES[0])).astype(np.float32),
             "y": rng.integers(0, SIZES[-1], size=args.batch).astype(np.int32)}
    params = init(jax.random.key(0))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    n_leaves = len(jax.tree.leaves(params))

    grad_fn = jax.jit(jax.value_and_grad(loss))
    jax.block_until_ready(grad_fn(params, batch))

    def unit():
        jax.block_until_ready(grad_fn(params, batch))

    def whole_tree():
        with jax.enable_x64(True):
            p64 = jax.tree.map(lambda x: jax.device_put(np.asarray(x, np.float64)), params)
            b64 = {"x": jax.device_put(batch["x"].astype(np.float64)), "y": batch["y"]}
            jitted = jax.jit(loss)
            try:
                jax.test_util.check_grads(lambda p: jitted(p, b64), (p64,), order=1, modes=("fwd", "rev"),
                                          atol=1e-5, rtol=1e-5, eps=1e-6)
            except AssertionError:
                return "FAILS on a correct model"
            return "passes"

    def per_leaf():
        findings = jaxsane.check_grads(loss, params, batch)
        return "passes" if not findings else f"FAILS on a correct model: {[f.path for f in findings]}"

    with jax.enable_x64(True):  # one float64 forward pass, for the per-parameter projection
        p64 = jax.tree.map(lambda x: jax.device_put(np.asarray(x, np.float64)), params)
        b64 = {"x": jax.device_put(batch["x"].astype(np.float64)), "y": batch["y"]}
        fwd64 = jax.jit(loss)
        jax.block_until_ready(fwd64(p64, b64))
        start = time.perf_counter()
        for _ in range(5):
            jax.block_until_ready(fwd64(p64, b64))
        one_forward64 = (time.perf_counter() - start) / 5

    methods = {"value_and_grad f32 (unit)": unit, "jax.test_util.check_grads, whole tree f64": whole_tree,
               "jaxsane.check_grads, per leaf f64": per_leaf}
    times = {name: [] for name in methods}
    outcome = {}
    for _ in range(args.repeats):
        for name, fn in methods.items():
            start = time.perf_counter()
            outcome[name] = fn() or "-"
            times[name].append(time.perf_counter() - start)
    outcome["per-parameter central differences (projected)"] = "-"
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    medians["per-parameter central differences (projected)"] = 2 * n_params * one_forward64
    unit_time = medians["value_and_grad f32 (unit)"]

    print(f"MLP {'-'.join(map(str, SIZES))}: {n_params:,} parameters in {n_leaves} leaves, batch {args.batch}, "
          f"{jax.devices()[0].platform}, median of {args.repeats} (interleaved)")
    print(f"{'method':48s} {'seconds':>12s} {'x unit':>12s}  {'names the leaf?':22s} result on this correct model")
    names_leaf = {"value_and_grad f32 (unit)": "-", "jax.test_util.check_grads, whole tree f64": "no",
                  "jaxsane.check_grads, per leaf f64": "yes",
                  "per-parameter central differences (projected)": "yes (each parameter)"}
    for name, t in medians.items():
        print(f"{name:48s} {t:12.3f} {t / unit_time:12.1f}  {names_leaf[name]:22s} {outcome[name]}")


if __name__ == "__main__":
    main()
