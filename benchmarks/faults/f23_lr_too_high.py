"""Learning rate too high: plain SGD with lr=0.2 on a least-squares regression of the digit value.

The curvature of the squared loss on 64 pixel features is ~10x larger than 2 / lr allows, so every
step overshoots the minimum further than the last: the loss grows geometrically, step after step.
Fix: lower the learning rate 10-100x (or standardise the features / use an adaptive optimizer).
"""

import jax.numpy as jnp
import numpy as np
import optax

import jaxsane
from benchmarks.faults._common import optax_step
from jaxsane.examples._digits import Batches, load_digits_split

EXPECTED = ["train.diverging"]
STYLE = "optax"
STAGES = ["run"]
OPTIONS = {"run_steps": 30}
tx = optax.sgd(learning_rate=0.2)  # FAULT: above 2 / curvature


def apply(params, x):
    return x @ params["w"] + params["b"]


def loss(params, batch):
    return jnp.mean((apply(params, batch["x"]) - batch["y"]) ** 2)


def init(key):
    params = {"w": jnp.zeros(64), "b": jnp.zeros(())}
    return params, tx.init(params)


def experiment():
    x, y, xe, ye = load_digits_split()
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=Batches(x, y.astype(np.float32), 64),
                              eval={"x": xe, "y": ye.astype(np.float32)}, loss=loss, apply=apply,
                              name="f23_lr_too_high")
