"""Gradient ascent: the hand-written SGD update adds the gradient instead of subtracting it.

The loss rises at every step, without bound. Fix: ``p - lr * g`` (or an optax optimizer).
"""

import jax
from flax import nnx

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits, xent

EXPECTED = ["train.diverging"]
STYLE = "nnx"
STAGES = ["run"]
OPTIONS = {"run_steps": 30}
LR = 0.5


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(64, 32, rngs=rngs)
        self.out = nnx.Linear(32, NUM_CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def loss(model, batch):
    return xent(model(batch["x"]), batch["y"])


def init(key):
    return MLP(nnx.Rngs(params=key))


@nnx.jit
def train_step(model, batch):
    value, grads = nnx.value_and_grad(loss)(model, batch)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p + LR * g, params, grads))  # FAULT: + instead of -
    return value


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=train_step, train=train, eval=eval_, loss=loss,
                              apply=lambda model, x: model(x), num_classes=NUM_CLASSES, name="f24_gradient_ascent")
