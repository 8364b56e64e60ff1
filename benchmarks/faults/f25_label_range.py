"""Labels out of range: the loader shifts the digit labels to 1..10 ("class 0 is background"),
but the model has 10 outputs. One-hot of label 10 is all zeros, so those examples silently
contribute a zero loss and digit 9 is never learned.

Fix: labels 0..num_classes-1 (or num_classes=11).
"""

import jax
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, mlp_apply, optax_step
from jaxsane.examples._digits import Batches, load_digits_split

EXPECTED = ["data.label_range"]
STYLE = "optax"
STAGES = ["data"]
tx = optax.adam(3e-3)


def loss(params, batch):
    logits = mlp_apply(params, batch["x"])
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(batch["y"], NUM_CLASSES)).mean()


def init(key):
    params = dense_params(key, (64, 32, NUM_CLASSES))
    return params, tx.init(params)


def experiment():
    x, y, xe, ye = load_digits_split()
    y, ye = y + 1, ye + 1  # FAULT: 1-based labels
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=Batches(x, y, 64),
                              eval={"x": xe, "y": ye}, loss=loss, apply=mlp_apply, num_classes=NUM_CLASSES,
                              name="f25_label_range")
