"""Regression with outputs at 100x the targets' scale: the last layer is initialised with std 100x He.

The targets are ~unit (tanh of a projection); the network's outputs at init spread ~100x wider, so the
MSE at init is ~10^4 times the targets' variance (the loss of the best constant prediction). Training
spends its first steps undoing the scale, or diverges with a learning rate tuned for unit outputs.
Fix: the default init (or 0.01x) for the output layer, its bias at the mean target.
"""

import jaxsane
from benchmarks.faults._common import dense_params, optax_step
from benchmarks.faults.c42_healthy_regression import apply, batches, loss, make_data, tx

EXPECTED = ["init.loss"]
STYLE = "optax"
STAGES = ["data", "init", "grads", "step", "batch"]


def init(key):
    params = dense_params(key, (8, 64, 64, 3))
    params[-1]["w"] = params[-1]["w"] * 100.0  # FAULT: output layer 100x the scale of the targets
    return params, tx.init(params)


def experiment():
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=batches(make_data(2048, 0)),
                              eval=make_data(256, 1), loss=loss, apply=apply, name="f62_regression_output_scale")
