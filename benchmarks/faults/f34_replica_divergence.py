"""Replica divergence: a data-parallel ``shard_map`` step forgets to all-reduce the gradients.

Each device applies the gradient of its own shard of the batch to its copy of the "replicated"
parameters, so the copies silently drift apart (``check_vma=False`` lets it compile). Fix:
``grads = jax.lax.pmean(grads, "data")`` before the update.

Needs several devices: ``check()`` runs 3 steps and returns ``jaxsane.check_replicas(params)``.
"""

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, digits, mlp_apply, xent

EXPECTED = ["dist.replica_divergence"]
STYLE = "optax"
LR = 0.1


def loss(params, x, y):
    return xent(mlp_apply(params, x), y)


def local_step(params, x, y):
    value, grads = jax.value_and_grad(loss)(params, x, y)  # FAULT: no jax.lax.pmean(grads, "data")
    params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
    return params, jax.lax.pmean(value, "data")


def check(steps: int = 3):
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                                 out_specs=(P(), P()), check_vma=False))
    params = jax.device_put(dense_params(jax.random.key(0), (64, 32, NUM_CLASSES)), NamedSharding(mesh, P()))
    train, _ = digits(batch_size=8 * len(jax.devices()))
    for i, batch in zip(range(steps), train):
        x, y = jax.device_put((batch["x"], batch["y"]), NamedSharding(mesh, P("data")))
        params, _ = step(params, x, y)
    return jaxsane.check_replicas(params, root="params", step=steps)
