"""An unused layer: ``__call__`` skips the second hidden layer that ``__init__`` creates.

The model was refactored and ``self.hidden2`` is no longer called; its parameters are counted,
saved and "trained", but get an identically zero gradient. Fix: call the layer, or delete it.
"""

import optax
from flax import nnx

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits, xent

EXPECTED = ["grad.missing"]
STYLE = "nnx"
STAGES = ["grads"]


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden1 = nnx.Linear(64, 32, rngs=rngs)
        self.hidden2 = nnx.Linear(32, 32, rngs=rngs)
        self.out = nnx.Linear(32, NUM_CLASSES, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.hidden1(x))
        return self.out(h)  # FAULT: self.hidden2 is never applied


def loss(model, batch):
    return xent(model(batch["x"]), batch["y"])


def init(key):
    model = MLP(nnx.Rngs(params=key))
    return model, nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, batch):
    value, grads = nnx.value_and_grad(loss)(model, batch)
    optimizer.update(model, grads)
    return value


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=train_step, train=train, eval=eval_, loss=loss,
                              apply=lambda model, x: model(x), num_classes=NUM_CLASSES, name="f13_unused_layer")
