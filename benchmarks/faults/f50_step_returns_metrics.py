"""A step that returns only its metrics: the new parameters are computed and thrown away.

Written as ``return {"loss": value}`` after the update, so every call starts again from the initial
state and nothing trains. Fix: ``return (new_params, opt_state), {"loss": value}``.
"""

import jax
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, digits, mlp_apply, xent

EXPECTED = ["doctor.step_output"]
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
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return {"loss": value}  # FAULT: the new state is dropped


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=train_step, train=train, eval=eval_, loss=loss,
                              apply=mlp_apply, num_classes=NUM_CLASSES, name="f50_step_returns_metrics")
