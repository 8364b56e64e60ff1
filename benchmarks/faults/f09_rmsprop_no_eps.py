"""A hand-written RMSProp without eps: g / sqrt(v) is 0 / 0 for a parameter whose gradient is 0.

Weights fed by always-blank pixels never get a gradient, their second moment stays 0 and the
update is NaN although the loss and the gradients are finite. Fix: ``g / (jnp.sqrt(v) + eps)``
(or ``optax.rmsprop``).
"""

import jax
import jax.numpy as jnp

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, digits, mlp_apply, xent

EXPECTED = ["nonfinite.update"]
STYLE = "optax"
STAGES = ["run"]
OPTIONS = {"run_steps": 5}
LR, DECAY = 1e-3, 0.9


def loss(params, batch):
    return xent(mlp_apply(params, batch["x"]), batch["y"])


def init(key):
    params = dense_params(key, (64, 32, NUM_CLASSES))
    return params, jax.tree.map(jnp.zeros_like, params)


@jax.jit
def train_step(state, batch):
    params, nu = state
    value, grads = jax.value_and_grad(loss)(params, batch)
    nu = jax.tree.map(lambda v, g: DECAY * v + (1 - DECAY) * g * g, nu, grads)
    params = jax.tree.map(lambda p, g, v: p - LR * g / jnp.sqrt(v), params, grads, nu)  # FAULT: no eps
    return (params, nu), {"loss": value}


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=train_step, train=train, eval=eval_, loss=loss, apply=mlp_apply,
                              num_classes=NUM_CLASSES, name="f09_rmsprop_no_eps")
