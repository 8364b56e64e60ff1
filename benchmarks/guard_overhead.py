"""Guard overhead: a guarded vs a bare jitted train step, side by side in one process.

MLP 784-1024-1024-10 (about 1.9M parameters), Adam, batch 256. Steps are interleaved
(bare, guarded, checkify, debug_nans, ...) and each is timed to completion; the median of
``--steps`` samples is reported per variant, with its ratio to the bare step.

    python benchmarks/guard_overhead.py [--steps 60]
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax
from jax.experimental import checkify

import jaxsane

SIZES = (784, 1024, 1024, 10)


def make_step():
    tx = optax.adam(1e-3)

    def init(key):
        params = []
        for n_in, n_out in zip(SIZES[:-1], SIZES[1:]):
            key, sub = jax.random.split(key)
            params.append({"w": jax.random.normal(sub, (n_in, n_out)) / jnp.sqrt(n_in), "b": jnp.zeros(n_out)})
        return params, tx.init(params)

    def loss(params, batch):
        x = batch["x"]
        for layer in params[:-1]:
            x = jax.nn.relu(x @ layer["w"] + layer["b"])
        logits = x @ params[-1]["w"] + params[-1]["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    return init, step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    init, step = make_step()
    key = jax.random.key(0)
    state = init(key)
    batch = {"x": jax.random.normal(key, (256, 784)), "y": jax.random.randint(key, (256,), 0, 10)}
    n_params = sum(x.size for x in jax.tree.leaves(state[0]))

    bare = jax.jit(step)
    guarded = jaxsane.guard(jax.jit(step))
    checkified = jax.jit(checkify.checkify(step, errors=checkify.float_checks))

    def run_bare(s):
        return bare(s, batch)

    def run_guarded(s):
        return guarded(s, batch)

    def run_checkify(s):
        err, out = checkified(s, batch)
        err.throw()
        return out

    def run_debug_nans(s):
        with jax.debug_nans(True):
            return bare(s, batch)

    variants = {"bare jit": run_bare, "jaxsane.guard": run_guarded, "checkify(float_checks)": run_checkify,
                "jax_debug_nans": run_debug_nans}
    states = {name: state for name in variants}
    times = {name: [] for name in variants}
    for i in range(args.steps + 5):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            new_state, metrics = fn(states[name])
            jax.block_until_ready((new_state, metrics))
            dt = time.perf_counter() - t0
            states[name] = new_state
            if i >= 5:  # warm-up (compilation) excluded
                times[name].append(dt)
    guarded.flush()
    base = statistics.median(times["bare jit"])
    print(f"guard overhead: MLP {'-'.join(map(str, SIZES))} ({n_params / 1e6:.2f}M params), Adam, batch 256, "
          f"{jax.devices()[0].platform}, median of {args.steps} interleaved steps")
    print(f"{'variant':<26}{'median ms':>10}{'ratio':>8}")
    for name in variants:
        med = statistics.median(times[name])
        print(f"{name:<26}{med * 1e3:>10.2f}{med / base:>8.3f}")
    print(f"guarded step compiled {guarded.compiles} time(s)")


if __name__ == "__main__":
    main()
