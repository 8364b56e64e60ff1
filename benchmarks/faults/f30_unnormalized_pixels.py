"""Unnormalised pixels: the images are fed as raw 0..255 intensities (the loader's ``/ 255`` was
dropped), so the first layer's pre-activations are ~100x too large.

Fix: scale the inputs to [0, 1] (or standardise them).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, xent
from jaxsane.examples._digits import Batches, load_digits_split

EXPECTED = ["data.unnormalized"]
STYLE = "linen"
STAGES = ["data"]


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
    return state.apply_gradients(grads=grads), {"loss": value}


def load_pixels():
    x, y, xe, ye = load_digits_split()
    to_bytes = lambda a: np.round(a * 255).astype(np.float32)  # the 8-bit images as stored on disk
    return to_bytes(x), y, to_bytes(xe), ye  # FAULT: raw 0..255 pixels, the / 255 is missing


def experiment():
    x, y, xe, ye = load_pixels()
    return jaxsane.Experiment(init=init, step=train_step, train=Batches(x, y, 64), eval={"x": xe, "y": ye},
                              loss=loss, apply=apply, num_classes=NUM_CLASSES, name="f30_unnormalized_pixels")
