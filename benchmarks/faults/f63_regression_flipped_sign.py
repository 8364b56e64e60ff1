"""Regression whose loss has a flipped sign: it maximises the squared error.

``-mean((pred - y) ** 2)``: every step moves the predictions away from the targets, so the reported
loss falls without bound (towards -inf) while the error grows; no configuration of the overfit sweep
fits one batch (``overfit.failed``: a loss below 0 is not a fit), and ``train.diverging`` does not
apply, as the reported loss never rises. Fix: drop the minus sign.
"""

import jax.numpy as jnp

import jaxsane
from benchmarks.faults._common import optax_step
from benchmarks.faults.c42_healthy_regression import apply, batches, init, make_data, tx

EXPECTED = ["overfit.failed"]
STYLE = "optax"
STAGES = ["data", "init", "grads", "step", "batch", "overfit", "run"]
OPTIONS = {"run_steps": 30, "overfit_steps": 150}


def loss(params, batch):
    return -jnp.mean((apply(params, batch["x"]) - batch["y"]) ** 2)  # FAULT: the sign is flipped


def experiment():
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=batches(make_data(2048, 0)),
                              eval=make_data(256, 1), loss=loss, apply=apply, name="f63_regression_flipped_sign")
