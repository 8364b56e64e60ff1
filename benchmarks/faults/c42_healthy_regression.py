"""Correct: a regression MLP with 3 outputs and a mean squared error (no classes anywhere).

``init.loss`` must not compare the MSE with ln 3, and no stage may read the float targets as
class labels.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxsane
from benchmarks.faults._common import dense_params, mlp_apply, optax_step

EXPECTED = []
STYLE = "optax"
STAGES = ["data", "init", "grads", "step", "batch", "overfit", "run"]
OPTIONS = {"run_steps": 30, "overfit_steps": 150}
tx = optax.adam(3e-3)


def make_data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 8)).astype(np.float32)
    w = np.random.default_rng(123).standard_normal((8, 3)).astype(np.float32) / np.sqrt(8)
    y = np.tanh(x @ w) + 0.05 * rng.standard_normal((n, 3)).astype(np.float32)
    return {"x": x, "y": y.astype(np.float32)}


def batches(data, batch_size=64):
    def stream():
        n, i = len(data["x"]), 0
        while True:
            idx = np.arange(i, i + batch_size) % n
            yield {k: v[idx] for k, v in data.items()}
            i += batch_size
    return stream


def apply(params, x):
    return mlp_apply(params, x)


def loss(params, batch):
    return jnp.mean((apply(params, batch["x"]) - batch["y"]) ** 2)


def init(key):
    params = dense_params(key, (8, 64, 64, 3))
    return params, tx.init(params)


def experiment():
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=batches(make_data(2048, 0)),
                              eval=make_data(256, 1), loss=loss, apply=apply, name="c42_healthy_regression")
