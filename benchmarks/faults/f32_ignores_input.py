"""The model ignores its input: the forward pass starts from a stale example batch captured at
construction time instead of from ``x``. The model can only learn the label prior.

Fix: use the argument ``x``.
"""

import jax
import jax.numpy as jnp
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, digits, optax_step, xent

EXPECTED = ["model.ignores_input"]
STYLE = "optax"
STAGES = ["overfit"]
OPTIONS = {"overfit_steps": 150}
tx = optax.adam(3e-3)
EXAMPLE_INPUT = jnp.full((1, 64), 0.5)  # used for shape inference at init


def apply(params, x):
    h = jnp.broadcast_to(EXAMPLE_INPUT, x.shape)  # FAULT: the stale example input, not x
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    return h @ params[-1]["w"] + params[-1]["b"]


def loss(params, batch):
    return xent(apply(params, batch["x"]), batch["y"])


def init(key):
    params = dense_params(key, (64, 32, NUM_CLASSES))
    return params, tx.init(params)


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=train, eval=eval_, loss=loss, apply=apply,
                              num_classes=NUM_CLASSES, name="f32_ignores_input")
