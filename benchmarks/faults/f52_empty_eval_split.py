"""An evaluation split with no rows: the split fraction rounds down to zero examples.

``len(x) - int(len(x) * 0.0001)`` is ``len(x)`` for this data set, so ``x[n_train:]`` is empty:
every evaluation metric is the mean of nothing. Fix: a fraction that leaves rows,
or a fixed number of evaluation examples.
"""

import jax
import numpy as np
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, mlp_apply, optax_step, xent
from jaxsane.examples._digits import load_digits_split

EXPECTED = ["data.empty"]
STYLE = "optax"
STAGES = ["data"]

tx = optax.adam(1e-3)


def loss(params, batch):
    return xent(mlp_apply(params, batch["x"]), batch["y"])


def init(key):
    params = dense_params(key, [64, 32, NUM_CLASSES])
    return params, tx.init(params)


def experiment():
    x, y, _, _ = load_digits_split()
    n_train = len(x) - int(len(x) * 0.0001)  # FAULT: the held-out fraction rounds to 0 rows
    train = {"x": x[:n_train], "y": y[:n_train]}
    eval_ = {"x": x[n_train:], "y": y[n_train:]}
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=train, eval=eval_, loss=loss,
                              apply=mlp_apply, num_classes=NUM_CLASSES, name="f52_empty_eval_split")
