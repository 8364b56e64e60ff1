"""A fixed dropout key: the step builds its dropout key from a constant, so every step drops the
same units. Dropout becomes a fixed sub-network instead of a regulariser.

Fix: keep a key in the state and split it every step (``jax.random.fold_in(key, state.step)``).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits, xent

EXPECTED = ["step.rng_reused"]
STYLE = "linen"
STAGES = ["step"]


class DropoutMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.relu(nn.Dense(64)(x))
        h = nn.Dropout(0.5, deterministic=not train)(h)
        return nn.Dense(NUM_CLASSES)(h)


model = DropoutMLP()


def apply(params, x):
    return model.apply({"params": params}, x)


def init(key):
    params = model.init(key, jnp.zeros((1, 64)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(3e-3))


@jax.jit
def train_step(state, batch):
    dropout_key = jax.random.key(0)  # FAULT: the same key every step

    def loss(params):
        logits = model.apply({"params": params}, batch["x"], train=True, rngs={"dropout": dropout_key})
        return xent(logits, batch["y"])

    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), {"loss": value}


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=train_step, train=train, eval=eval_, apply=apply,
                              loss=lambda p, b: xent(apply(p, b["x"]), b["y"]), num_classes=NUM_CLASSES,
                              name="f17_fixed_dropout_key")
