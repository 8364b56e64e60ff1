"""NaN inputs: the pipeline normalises each image by its own maximum, and blank images (all 0)
become 0 / 0 = NaN rows in the batch.

Fix: guard the division (``x / np.maximum(x.max(1, keepdims=True), eps)``) or drop blank images.
"""

import numpy as np
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, mlp_apply, optax_step, xent
from jaxsane.examples._digits import Batches, load_digits_split

EXPECTED = ["nonfinite.input"]
STYLE = "optax"
STAGES = ["data"]
tx = optax.adam(3e-3)


def loss(params, batch):
    return xent(mlp_apply(params, batch["x"]), batch["y"])


def init(key):
    params = dense_params(key, (64, 32, NUM_CLASSES))
    return params, tx.init(params)


def load():
    x, y, xe, ye = load_digits_split()
    x = x.copy()
    x[::50] = 0.0  # the scanner's blank pages
    with np.errstate(invalid="ignore"):
        x = x / x.max(axis=1, keepdims=True)  # FAULT: 0 / 0 for blank images
    return x, y, xe, ye


def experiment():
    x, y, xe, ye = load()
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=Batches(x, y, 64),
                              eval={"x": xe, "y": ye}, loss=loss, apply=mlp_apply, num_classes=NUM_CLASSES,
                              name="f31_nan_input")
