"""A step that raises on every call: the batch key is misspelled.

The model code is fine, but ``batch["lable"]`` raises a KeyError on the first step, so nothing can
train. doctor must fail the program and name the line, not report the stages as skipped.
Fix: ``batch["y"]``.
"""

import jax
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, digits, mlp_apply, xent

EXPECTED = ["doctor.user_code_crashed"]
STYLE = "optax"
STAGES = ["step"]

tx = optax.adam(1e-3)


def loss(params, batch):
    return xent(mlp_apply(params, batch["x"]), batch["y"])


def init(key):
    params = dense_params(key, [64, 32, NUM_CLASSES])
    return params, tx.init(params)


@jax.jit
def train_step(state, batch):
    params, opt_state = state
    labels = batch["lable"]  # FAULT: no such key, KeyError on every call
    value, grads = jax.value_and_grad(loss)(params, {"x": batch["x"], "y": labels})
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), {"loss": value}


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=train_step, train=train, eval=eval_, loss=loss,
                              apply=mlp_apply, num_classes=NUM_CLASSES, name="f51_step_crashes")
