"""norm at 0: pairwise embedding distances include the diagonal, where ||e_i - e_i|| = 0.

A "spread" regulariser pushes embeddings apart with the mean pairwise distance. The diagonal
distance is exactly 0 and the gradient of the norm there is 0/0 = NaN, although the forward value
is finite (and the diagonal is even masked out). Fix: compute the squared distance, mask the
diagonal inside the sqrt (``jnp.sqrt(jnp.where(eye, 1.0, d2))``), or add an eps under the sqrt.
"""

import jax.numpy as jnp
import optax
from flax import nnx

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits, xent

EXPECTED = ["nonfinite.backward"]
STYLE = "nnx"
STAGES = ["run"]
OPTIONS = {"run_steps": 5}


class Embedder(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Linear(64, 16, rngs=rngs)
        self.head = nnx.Linear(16, NUM_CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.embed(x)


def loss(model, batch):
    e = model(batch["x"])
    dist = jnp.linalg.norm(e[:, None, :] - e[None, :, :], axis=-1)  # FAULT: norm of 0 on the diagonal
    off_diagonal = 1.0 - jnp.eye(e.shape[0])
    spread = jnp.sum(dist * off_diagonal) / jnp.sum(off_diagonal)
    return xent(model.head(e), batch["y"]) - 0.01 * spread


def init(key):
    model = Embedder(nnx.Rngs(params=key))
    return model, nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, batch):
    value, grads = nnx.value_and_grad(loss)(model, batch)
    optimizer.update(model, grads)
    return value


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=train_step, train=train, eval=eval_, loss=loss,
                              apply=lambda model, x: model.head(model(x)), num_classes=NUM_CLASSES,
                              name="f03_norm_pairwise")
