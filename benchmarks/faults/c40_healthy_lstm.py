"""Correct: a linen LSTM classifier (``nn.RNN(nn.LSTMCell)``) reading each digit as 8 rows of 8 pixels.

Its ``apply`` holds a ``lax.scan`` (the RNN over time) with a float32 initial carry from
``LSTMCell.initialize_carry``: every stage must run through it (the float64 gradient check too).
"""

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


class LSTMClassifier(nn.Module):
    hidden: int = 32

    @nn.compact
    def __call__(self, x):
        rows = x.reshape(x.shape[0], 8, 8)             # [B, T=8, F=8]
        h = nn.RNN(nn.LSTMCell(self.hidden))(rows)      # [B, T, H]
        return nn.Dense(NUM_CLASSES)(h[:, -1])


model = LSTMClassifier()


def apply(params, x):
    return model.apply({"params": params}, x)


def loss(params, batch):
    return xent(apply(params, batch["x"]), batch["y"])


def init(key):
    params = model.init(key, jnp.zeros((1, 64)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))


@jax.jit
def train_step(state, batch):
    value, grads = jax.value_and_grad(loss)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": value}


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=train_step, train=train, eval=eval_, loss=loss, apply=apply,
                              num_classes=NUM_CLASSES, name="c40_healthy_lstm")
