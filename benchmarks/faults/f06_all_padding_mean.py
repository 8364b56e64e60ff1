"""All-padding sequences: a masked mean pool divides 0 by 0 for an example with no tokens.

The packing step emits empty sequences (every 8th example has length 0). The mean pool
``sum(h * mask) / sum(mask)`` is then 0/0 = NaN and the loss is NaN. Fix: drop empty sequences in
the pipeline, and divide by ``jnp.maximum(mask.sum(), 1)``.
"""

import jax.numpy as jnp
import optax
from flax import nnx

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, sequences, xent

EXPECTED = ["data.all_padding", "nonfinite.forward"]
STYLE = "nnx"
STAGES = ["data", "run"]
OPTIONS = {"run_steps": 3}


class RowPool(nnx.Module):
    def __init__(self, rngs):
        self.row = nnx.Linear(8, 32, rngs=rngs)
        self.out = nnx.Linear(32, NUM_CLASSES, rngs=rngs)

    def __call__(self, x, mask):
        h = nnx.relu(self.row(x))
        pooled = jnp.sum(h * mask[..., None], axis=1) / jnp.sum(mask, axis=1, keepdims=True)  # FAULT: 0/0
        return self.out(pooled)


def loss(model, batch):
    return xent(model(batch["x"], batch["mask"]), batch["y"])


def init(key):
    model = RowPool(nnx.Rngs(params=key))
    return model, nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, batch):
    value, grads = nnx.value_and_grad(loss)(model, batch)
    optimizer.update(model, grads)
    return value


def experiment():
    return jaxsane.Experiment(init=init, step=train_step, train=sequences(all_padding_every=8), loss=loss,
                              num_classes=NUM_CLASSES, name="f06_all_padding_mean")
