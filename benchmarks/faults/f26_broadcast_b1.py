"""(B, 1) vs (B,) broadcast: a regression head outputs (B, 1), the targets are (B,).

``pred - target`` broadcasts to (B, B), so the loss compares every prediction with every target:
it trains towards the mean target and the loss never gets small. Fix: ``pred[:, 0]`` or
``target[:, None]``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import jaxsane
from jaxsane.examples._digits import Batches, load_digits_split

EXPECTED = ["data.shape"]
STYLE = "linen"
STAGES = ["data"]


class Regressor(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.relu(nn.Dense(32)(x)))


model = Regressor()


def apply(params, x):
    return model.apply({"params": params}, x)


def loss(params, batch):
    pred = apply(params, batch["x"])
    return jnp.mean((pred - batch["y"]) ** 2)  # FAULT: (B, 1) - (B,) broadcasts to (B, B)


def init(key):
    params = model.init(key, jnp.zeros((1, 64)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(3e-3))


@jax.jit
def train_step(state, batch):
    value, grads = jax.value_and_grad(loss)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": value}


def experiment():
    x, y, xe, ye = load_digits_split()
    y, ye = y.astype("float32") / 9.0, ye.astype("float32") / 9.0  # regress the digit value in [0, 1]
    return jaxsane.Experiment(init=init, step=train_step, train=Batches(x, y, 64), eval={"x": xe, "y": ye},
                              loss=loss, apply=apply, name="f26_broadcast_b1")
