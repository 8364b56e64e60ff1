"""Correct: a multi-label MLP with 8 sigmoid outputs and a binary cross-entropy (labels of frequency ~10-40%).

``init.loss`` must compare the BCE with the best constant prediction (the labels' entropy), not with
ln 8, and no stage may read the 0/1 label matrix as class ids.
"""

import jax
import numpy as np
import optax

import jaxsane
from benchmarks.faults._common import dense_params, mlp_apply, optax_step
from benchmarks.faults.c42_healthy_regression import batches

EXPECTED = []
STYLE = "optax"
STAGES = ["data", "init", "grads", "step", "batch", "overfit", "run"]
OPTIONS = {"run_steps": 30, "overfit_steps": 150}
LABELS = 8
tx = optax.adam(3e-3)


def make_data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 16)).astype(np.float32)
    w = np.random.default_rng(7).standard_normal((16, LABELS)).astype(np.float32) / 4.0
    offset = np.linspace(0.3, 1.2, LABELS, dtype=np.float32)  # rarer and rarer labels, 40% down to ~10%
    return {"x": x, "y": (x @ w > offset).astype(np.float32)}


def apply(params, x):
    return mlp_apply(params, x)  # one logit per label


def loss(params, batch):
    return optax.sigmoid_binary_cross_entropy(apply(params, batch["x"]), batch["y"]).mean()


def init(key):
    params = dense_params(key, (16, 64, 64, LABELS))
    return params, tx.init(params)


def experiment():
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=batches(make_data(2048, 0)),
                              eval=make_data(256, 1), loss=loss, apply=apply, name="c44_healthy_multilabel")
