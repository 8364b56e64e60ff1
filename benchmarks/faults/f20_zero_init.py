"""Zero init of a hidden layer: every hidden unit is the same function at init, and only the next layer's
random weights set their gradients apart, so they start out moving along a few directions (doctor: an
``init.symmetric`` warning; with the next layer constant too they would never part: the error).

Fix: a random kernel init (``nnx.initializers.lecun_normal()``, the default).
"""

import optax
from flax import nnx

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits, xent

EXPECTED = ["init.symmetric"]
STYLE = "nnx"
STAGES = ["init"]


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(64, 32, kernel_init=nnx.initializers.zeros_init(), rngs=rngs)  # FAULT
        self.out = nnx.Linear(32, NUM_CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.tanh(self.hidden(x)))


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
                              apply=lambda model, x: model(x), num_classes=NUM_CLASSES, name="f20_zero_init")
