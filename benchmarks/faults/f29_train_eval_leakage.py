"""Train/eval leakage: the data set is augmented by duplication *before* the split, so copies of
eval images sit in the train split and the eval accuracy is inflated.

Fix: split first, then augment/oversample the train split only.
"""

import numpy as np
import optax
from flax import nnx

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, xent
from jaxsane.examples._digits import Batches, load_digits_split

EXPECTED = ["data.leakage"]
STYLE = "nnx"
STAGES = ["data"]


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(64, 32, rngs=rngs)
        self.out = nnx.Linear(32, NUM_CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


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


def split(x, y, eval_fraction=0.2, seed=0):
    x, y = np.concatenate([x, x]), np.concatenate([y, y])  # FAULT: oversampling by copy before the split
    order = np.random.default_rng(seed).permutation(len(x))
    n_eval = int(len(x) * eval_fraction)
    return x[order[n_eval:]], y[order[n_eval:]], x[order[:n_eval]], y[order[:n_eval]]


def experiment():
    x, y, _, _ = load_digits_split()
    xt, yt, xe, ye = split(x, y)
    return jaxsane.Experiment(init=init, step=train_step, train=Batches(xt, yt, 64), eval={"x": xe, "y": ye},
                              loss=loss, apply=lambda model, x: model(x), num_classes=NUM_CLASSES,
                              name="f29_train_eval_leakage")
