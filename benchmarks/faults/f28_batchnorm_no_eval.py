"""BatchNorm left in train mode at evaluation: NNX ``BatchNorm`` uses batch statistics until
``model.eval()`` is called, and the eval function never calls it. Each prediction then depends on
the other examples of the eval batch. Fix: ``model.eval()`` before evaluating (``model.train()`` after).
"""

import optax
from flax import nnx

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits, xent

EXPECTED = ["batch.cross_talk"]
STYLE = "nnx"
STAGES = ["batch"]


class BNMLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(64, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.out = nnx.Linear(32, NUM_CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.bn(self.hidden(x))))


def loss(model, batch):
    return xent(model(batch["x"]), batch["y"])


def init(key):
    model = BNMLP(nnx.Rngs(params=key))
    return model, nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, batch):
    value, grads = nnx.value_and_grad(loss)(model, batch)
    optimizer.update(model, grads)
    return value


def evaluate(model, x):
    return model(x)  # FAULT: model.eval() never called, BatchNorm uses this batch's statistics


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=train_step, train=train, eval=eval_, loss=loss, apply=evaluate,
                              num_classes=NUM_CLASSES, name="f28_batchnorm_no_eval")
