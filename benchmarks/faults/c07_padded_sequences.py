"""Correct: padded sequences (lengths 4..8 of 8 rows, with a learned position embedding) and a masked
mean pool whose denominator is never 0; no example is all padding."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, sequences, xent

EXPECTED = []
STYLE = "nnx"
STAGES = ["data", "init", "grads", "step", "batch", "overfit", "run"]
OPTIONS = {"run_steps": 30, "overfit_steps": 150}


class RowPool(nnx.Module):
    def __init__(self, rngs, hidden=64):
        self.row = nnx.Linear(8, hidden, rngs=rngs)
        self.position = nnx.Param(0.1 * jax.random.normal(rngs.params(), (8, hidden)))
        self.out = nnx.Linear(hidden, NUM_CLASSES, rngs=rngs)

    def __call__(self, x, mask):
        h = nnx.relu(self.row(x) + self.position[...])
        count = jnp.maximum(jnp.sum(mask, axis=1, keepdims=True), 1.0)
        return self.out(jnp.sum(h * mask[..., None], axis=1) / count)


def loss(model, batch):
    return xent(model(batch["x"], batch["mask"]), batch["y"])


def init(key):
    model = RowPool(nnx.Rngs(params=key))
    return model, nnx.Optimizer(model, optax.inject_hyperparams(optax.adam)(learning_rate=3e-3), wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, batch):
    value, grads = nnx.value_and_grad(loss)(model, batch)
    optimizer.update(model, grads)
    return value


def experiment():
    return jaxsane.Experiment(init=init, step=train_step, train=sequences(), loss=loss,
                              num_classes=NUM_CLASSES, name="c07_padded_sequences")
