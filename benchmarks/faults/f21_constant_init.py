"""Constant init: a hidden Dense layer initialised with ``constant(0.01)``, so all its units are
identical at init; only the random output layer sets their gradients apart (doctor: an ``init.symmetric``
warning that says so).

Fix: a random init (the default ``lecun_normal``).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits, xent

EXPECTED = ["init.symmetric"]
STYLE = "linen"
STAGES = ["init"]


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32, kernel_init=nn.initializers.constant(0.01))(x))  # FAULT
        return nn.Dense(NUM_CLASSES)(h)


model = MLP()


def apply(params, x):
    return model.apply({"params": params}, x)


def loss(params, batch):
    return xent(apply(params, batch["x"]), batch["y"])


def init(key):
    params = model.init(key, jnp.zeros((1, 64)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(3e-3))


@jax.jit
def train_step(state, batch):
    value, grads = jax.value_and_grad(loss)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": value}


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=train_step, train=train, eval=eval_, loss=loss, apply=apply,
                              num_classes=NUM_CLASSES, name="f21_constant_init")
