"""Huge init: weights drawn from N(0, 1) with no fan-in scaling in a deep tanh MLP.

With 64-wide layers each pre-activation has std ~8, every tanh saturates at +-1 from the first
layer on and the output logits are ~8x too large: activations blow up through depth at init.
Fix: scale by 1/sqrt(fan_in) (LeCun/Glorot for tanh, He for ReLU).
"""

import jax
import jax.numpy as jnp
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits, optax_step, xent

EXPECTED = ["init.scale"]
STYLE = "optax"
STAGES = ["init"]
SIZES = (64, 64, 64, 64, 64, NUM_CLASSES)
tx = optax.adam(1e-3)


def init_params(key):
    params = []
    for n_in, n_out in zip(SIZES[:-1], SIZES[1:]):
        key, sub = jax.random.split(key)
        params.append({"w": jax.random.normal(sub, (n_in, n_out)), "b": jnp.zeros(n_out)})  # FAULT: std 1
    return params


def apply(params, x):
    for layer in params[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss(params, batch):
    return xent(apply(params, batch["x"]), batch["y"])


def init(key):
    params = init_params(key)
    return params, tx.init(params)


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=train, eval=eval_, loss=loss, apply=apply,
                              num_classes=NUM_CLASSES, name="f19_huge_init")
