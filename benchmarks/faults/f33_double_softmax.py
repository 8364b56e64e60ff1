"""Softmax applied twice: the model ends in a softmax and the loss applies another one.

The cross-entropy then sees "logits" in [0, 1], its minimum is far above 0, gradients are tiny and
even one small batch cannot be fitted. Fix: return logits from the model (no final softmax).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits, xent

EXPECTED = ["overfit.failed"]
STYLE = "linen"
STAGES = ["overfit"]
OPTIONS = {"overfit_steps": 150}


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        logits = nn.Dense(NUM_CLASSES)(nn.relu(nn.Dense(32)(x)))
        return jax.nn.softmax(logits)  # FAULT: the loss applies softmax again


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
                              num_classes=NUM_CLASSES, name="f33_double_softmax")
