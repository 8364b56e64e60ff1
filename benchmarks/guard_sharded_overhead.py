"""Guard overhead on an 8-device sharded train step vs the bare step, side by side in one process.

MLP 784-512-512-10 (about 0.67M parameters), Adam, global batch 2048 sharded over 8 CPU devices
(``--xla_force_host_platform_device_count=8``, set here before jax is imported). Variants:

* data parallel: ``jax.jit`` over NamedSharding inputs (params replicated, batch split on "data");
* FSDP: the same step with the weight matrices sharded on their first axis over "data";
* shard_map data parallel: per-device gradients, ``pmean``, update;

each bare, under ``jaxsane.guard`` (default options), under ``guard(check_replicas=True)``, and bare
again as a second, independently compiled copy (its ratio shows the measurement noise).
Steps are interleaved (bare, guarded, ...) and timed to completion; the median of ``--steps``
samples is reported with its ratio to the bare step of the same variant. Nothing is asserted.

    python benchmarks/guard_sharded_overhead.py [--steps 40] [--devices 8]
"""

import argparse
import os
import sys


def _parse():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2048)
    return parser.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None and "jax" not in sys.modules:  # must happen before jax is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={ARGS.devices}").strip()

import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxsane  # noqa: E402

SIZES = (784, 512, 512, 10)
tx = optax.adam(1e-3)


def init(key):
    params = []
    for n_in, n_out in zip(SIZES[:-1], SIZES[1:]):
        key, sub = jax.random.split(key)
        params.append({"w": jax.random.normal(sub, (n_in, n_out)) / jnp.sqrt(n_in), "b": jnp.zeros(n_out)})
    return params


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


def shard_map_step(mesh):
    def local(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, batch)
        grads, value = jax.lax.pmean((grads, value), "data")
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=False)


def place(tree, mesh, spec_of):
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec_of(x))), tree)


def main(args):
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    key = jax.random.key(0)
    batch = {"x": jax.random.normal(key, (args.batch, SIZES[0])), "y": jax.random.randint(key, (args.batch,), 0, 10)}
    batch = place(batch, mesh, lambda x: P("data"))
    replicated = lambda x: P()  # noqa: E731
    n_dev = len(jax.devices())
    fsdp = lambda x: P("data") if x.ndim == 2 and x.shape[0] % n_dev == 0 else P()  # noqa: E731
    params = init(key)
    setups = {
        "data parallel (jit)": (step, place((params, tx.init(params)), mesh, replicated)),
        "FSDP (jit)": (step, place((params, tx.init(params)), mesh, fsdp)),
        "data parallel (shard_map)": (shard_map_step(mesh), place((params, tx.init(params)), mesh, replicated)),
    }
    variants = []
    for name, (raw, state) in setups.items():
        fn = jax.jit(raw)
        variants += [(name, "bare", fn, state), (name, "guard", jaxsane.guard(fn), state),
                     (name, "guard(check_replicas)", jaxsane.guard(fn, check_replicas=True), state),
                     (name, "bare again (noise floor)", jax.jit(raw), state)]
    states = {i: v[3] for i, v in enumerate(variants)}
    for i, (_, _, fn, _) in enumerate(variants):  # compile and warm up (outputs may re-shard once)
        for _ in range(3):
            states[i], m = fn(states[i], batch)
        jax.block_until_ready((states[i], m))
    times = {i: [] for i in range(len(variants))}
    for _ in range(args.steps):
        for i, (_, _, fn, _) in enumerate(variants):
            t = time.perf_counter()
            states[i], m = fn(states[i], batch)
            jax.block_until_ready((states[i], m))
            times[i].append(time.perf_counter() - t)
    for _, _, fn, _ in variants:
        if isinstance(fn, jaxsane.Guarded):
            fn.flush()
            assert not fn.failures, fn.failures  # a healthy run: the checks must stay silent
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"guard overhead on a sharded step: {n_dev} {jax.devices()[0].platform} devices, MLP {SIZES} "
          f"({n_params / 1e6:.1f}M params), Adam, global batch {args.batch}, median of {args.steps} interleaved steps")
    print("ratio: median time / the bare step's; paired: median over rounds of (time / the bare step's time in the "
          "same round)")
    print(f"{'step':28s} {'variant':26s} {'median ms':>10s} {'ratio':>7s} {'paired':>7s}")
    bare = {}
    for i, (name, variant, _, _) in enumerate(variants):
        med = statistics.median(times[i])
        j = bare.setdefault(name, i)
        paired = statistics.median(t / b for t, b in zip(times[i], times[j]))
        print(f"{name:28s} {variant:26s} {med * 1e3:10.2f} {med / statistics.median(times[j]):7.3f}x {paired:6.3f}x")


if __name__ == "__main__":
    main(ARGS)
