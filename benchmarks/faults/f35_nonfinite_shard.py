"""A non-finite shard: one data-loading worker (the one feeding the last device) normalises with a
corrupt statistic, so only that device's rows of the global batch are NaN.

The guarded data-parallel step stops; the shard check names the device and the rows. Fix the
worker's preprocessing (here: a zero standard deviation).

Needs several devices: ``check()`` runs the guarded step and returns the guard's findings.
"""

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, digits, mlp_apply, optax_step, xent

EXPECTED = ["dist.nonfinite_shard", "nonfinite.input"]  # the NaN rows are in the batch itself
STYLE = "optax"
tx = optax.sgd(0.1)


def loss(params, batch):
    return xent(mlp_apply(params, batch["x"]), batch["y"])


def worker_batch(x, worker, n_workers):
    """The rows of one loading worker, standardised with the worker's own statistics."""
    rows = np.array_split(x, n_workers)[worker]
    std = rows.std() if worker < n_workers - 1 else np.float32(0.0)  # FAULT: the last worker's std is 0
    with np.errstate(invalid="ignore", divide="ignore"):
        return (rows - rows.mean()) / std


def check(steps: int = 3):
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("data",))
    rows, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    params = dense_params(jax.random.key(0), (64, 32, NUM_CLASSES))
    state = jax.device_put((params, tx.init(params)), replicated)
    guarded = jaxsane.guard(optax_step(loss, tx), on_nonfinite="raise")
    train, _ = digits(batch_size=8 * n)
    try:
        for i, batch in zip(range(steps), train):
            x = np.concatenate([worker_batch(batch["x"], w, n) for w in range(n)]).astype(np.float32)
            batch = jax.device_put({"x": x, "y": batch["y"]}, rows)
            state, _ = guarded(state, batch)
        guarded.flush()
    except jaxsane.NonFiniteError:
        pass
    return list(guarded.failures)
