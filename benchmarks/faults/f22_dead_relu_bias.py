"""Dead ReLUs: the hidden biases are initialised to -4 "to make activations sparse".

Inputs are in [0, 1] and the weights are small, so almost every pre-activation is negative and
almost every ReLU unit outputs 0 on every example; those units never get a gradient again.
Fix: zero (or small positive) bias init.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits, xent

EXPECTED = ["train.dead_units"]
STYLE = "linen"
STAGES = ["run"]
OPTIONS = {"run_steps": 20}


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(64, bias_init=nn.initializers.constant(-4.0))(x))  # FAULT
        h = nn.relu(nn.Dense(64)(h))
        return nn.Dense(NUM_CLASSES)(h)


model = MLP()


def apply(params, x):
    return model.apply({"params": params}, x)


def loss(params, batch):
    return xent(apply(params, batch["x"]), batch["y"])


def init(key):
    params = model.init(key, jnp.zeros((1, 64)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))


@jax.jit
def train_step(state, batch):
    value, grads = jax.value_and_grad(loss)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": value}


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=train_step, train=train, eval=eval_, loss=loss, apply=apply,
                              num_classes=NUM_CLASSES, name="f22_dead_relu_bias")
