"""Correct: causal self-attention over the 8 rows of a digit, masked with ``-inf``.

Every query row sees at least itself, so each softmax row has a finite maximum: ``-inf`` entries
become exactly 0 and nothing is NaN, in the forward or the backward pass.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits, xent

EXPECTED = []
STYLE = "nnx"
STAGES = ["data", "init", "grads", "step", "batch", "overfit", "run"]
OPTIONS = {"run_steps": 30, "overfit_steps": 150}


class RowAttention(nnx.Module):
    def __init__(self, rngs, dim=16):
        self.embed = nnx.Linear(8, dim, rngs=rngs)
        self.qkv = nnx.Linear(dim, 3 * dim, rngs=rngs)
        self.out = nnx.Linear(8 * dim, NUM_CLASSES, rngs=rngs)

    def __call__(self, x):
        h = self.embed(x.reshape(-1, 8, 8))
        q, k, v = jnp.split(self.qkv(h), 3, axis=-1)
        scores = q @ k.swapaxes(-1, -2) / jnp.sqrt(q.shape[-1])
        causal = jnp.tril(jnp.ones((8, 8), bool))
        scores = jnp.where(causal, scores, -jnp.inf)
        h = h + jax.nn.softmax(scores, axis=-1) @ v
        return self.out(h.reshape(h.shape[0], -1))


def loss(model, batch):
    return xent(model(batch["x"]), batch["y"])


def init(key):
    model = RowAttention(nnx.Rngs(params=key))
    return model, nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, batch):
    value, grads = nnx.value_and_grad(loss)(model, batch)
    optimizer.update(model, grads)
    return value


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=train_step, train=train, eval=eval_, loss=loss,
                              apply=lambda model, x: model(x), num_classes=NUM_CLASSES, name="c04_masked_attention")
