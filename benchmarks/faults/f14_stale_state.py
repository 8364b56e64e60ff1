"""A stale returned state: the step computes the new state and returns the old one.

Training "runs", the loss is printed every step and never moves. Fix: return the new state.
"""

import jax
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, digits, mlp_apply, xent

EXPECTED = ["step.no_update"]
STYLE = "optax"
STAGES = ["step"]
tx = optax.adam(3e-3)


def loss(params, batch):
    return xent(mlp_apply(params, batch["x"]), batch["y"])


def init(key):
    params = dense_params(key, (64, 32, NUM_CLASSES))
    return params, tx.init(params)


@jax.jit
def train_step(state, batch):
    params, opt_state = state
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)  # noqa: F841
    return state, {"loss": value}  # FAULT: should be (new_params, new_opt_state)


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=train_step, train=train, eval=eval_, loss=loss, apply=mlp_apply,
                              num_classes=NUM_CLASSES, name="f14_stale_state")
