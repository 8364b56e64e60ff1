"""Learning rate zero: the linear scaling rule with integer division.

``base_lr * (batch_size // 256)`` is 0 for any batch smaller than 256, so every update is 0.
Fix: ``base_lr * batch_size / 256``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits, xent

EXPECTED = ["step.no_update"]
STYLE = "linen"
STAGES = ["step"]
BATCH_SIZE, BASE_LR = 64, 0.1


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
    learning_rate = BASE_LR * (BATCH_SIZE // 256)  # FAULT: integer division, 0 for batches < 256
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(learning_rate, 0.9))


@jax.jit
def train_step(state, batch):
    value, grads = jax.value_and_grad(loss)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": value}


def experiment():
    train, eval_ = digits(batch_size=BATCH_SIZE)
    return jaxsane.Experiment(init=init, step=train_step, train=train, eval=eval_, loss=loss, apply=apply,
                              num_classes=NUM_CLASSES, name="f15_lr_zero")
