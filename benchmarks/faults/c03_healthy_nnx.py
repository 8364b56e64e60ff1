"""Correct: an NNX MLP with LayerNorm, trained in place by an ``nnx.jit`` step."""

import optax
from flax import nnx

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits, xent

EXPECTED = []
STYLE = "nnx"
STAGES = ["data", "init", "grads", "step", "batch", "overfit", "run"]
OPTIONS = {"run_steps": 30, "overfit_steps": 150}


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(64, 64, rngs=rngs)
        self.norm = nnx.LayerNorm(64, rngs=rngs)
        self.out = nnx.Linear(64, NUM_CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.norm(self.hidden(x))))


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
                              apply=lambda model, x: model(x), num_classes=NUM_CLASSES, name="c03_healthy_nnx")
