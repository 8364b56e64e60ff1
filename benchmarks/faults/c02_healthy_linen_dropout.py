"""Correct: a linen MLP with dropout, a TrainState and a dropout key folded with the step number."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits, xent

EXPECTED = []
STYLE = "linen"
STAGES = ["data", "init", "grads", "step", "batch", "overfit", "run"]
OPTIONS = {"run_steps": 30, "overfit_steps": 150}


class DropoutMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.relu(nn.Dense(64)(x))
        h = nn.Dropout(0.2, deterministic=not train)(h)
        return nn.Dense(NUM_CLASSES)(h)


model = DropoutMLP()


class State(train_state.TrainState):
    key: jax.Array


def apply(params, x):
    return model.apply({"params": params}, x)


def loss(params, batch):
    return xent(apply(params, batch["x"]), batch["y"])


def init(key):
    params = model.init(key, jnp.zeros((1, 64)))["params"]
    return State.create(apply_fn=model.apply, params=params, tx=optax.adam(3e-3), key=jax.random.fold_in(key, 1))


@jax.jit
def train_step(state, batch):
    dropout_key = jax.random.fold_in(state.key, state.step)

    def train_loss(params):
        logits = model.apply({"params": params}, batch["x"], train=True, rngs={"dropout": dropout_key})
        return xent(logits, batch["y"])

    value, grads = jax.value_and_grad(train_loss)(state.params)
    return state.apply_gradients(grads=grads), {"loss": value}


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=train_step, train=train, eval=eval_, loss=loss, apply=apply,
                              num_classes=NUM_CLASSES, name="c02_healthy_linen_dropout")
