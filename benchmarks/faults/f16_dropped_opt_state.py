"""A dropped optimizer state: the step applies the updates but keeps the old optimizer state.

A hand-rolled ``state.replace(params=...)`` instead of ``state.apply_gradients`` throws away the
new Adam moments and step count, so Adam stays at its first step forever (bias correction and
momentum never progress). Fix: ``state.replace(params=..., opt_state=new_opt_state, step=state.step + 1)``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits, xent

EXPECTED = ["step.opt_state_frozen"]
STYLE = "linen"
STAGES = ["step"]


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(NUM_CLASSES)(nn.relu(nn.Dense(32)(x)))


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
    updates, new_opt_state = state.tx.update(grads, state.opt_state, state.params)
    new_state = state.replace(params=optax.apply_updates(state.params, updates), step=state.step + 1)  # FAULT
    return new_state, {"loss": value}


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=train_step, train=train, eval=eval_, loss=loss, apply=apply,
                              num_classes=NUM_CLASSES, name="f16_dropped_opt_state")
