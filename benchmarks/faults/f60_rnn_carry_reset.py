"""A hand-written ``lax.scan`` RNN whose body hands the initial carry on instead of the new one.

Each step starts again from ``h0``: the recurrent kernel multiplies zeros, gets an identically
zero gradient and never trains; the model sees only the last row. Fix: return the new carry.
"""

import jax
import jax.numpy as jnp
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits, optax_step, xent

EXPECTED = ["grad.missing"]
STYLE = "optax"
STAGES = ["grads"]
HIDDEN = 32
tx = optax.adam(1e-2)


def apply(params, x):
    rows = jnp.swapaxes(x.reshape(x.shape[0], 8, 8), 0, 1)    # [T, B, F]
    h0 = jnp.zeros((x.shape[0], HIDDEN), jnp.float32)

    def cell(h, row):
        h_new = jnp.tanh(row @ params["w_in"] + h @ params["w_hh"] + params["b"])
        return h0, h_new  # FAULT: the carry is reset each step (should be `return h_new, h_new`)

    _, hs = jax.lax.scan(cell, h0, rows)
    return hs[-1] @ params["w_out"] + params["b_out"]


def loss(params, batch):
    return xent(apply(params, batch["x"]), batch["y"])


def init(key):
    k1, k2, k3 = jax.random.split(key, 3)
    params = {"w_in": jax.random.normal(k1, (8, HIDDEN)) / jnp.sqrt(8.0),
              "w_hh": jax.random.normal(k2, (HIDDEN, HIDDEN)) / jnp.sqrt(HIDDEN),
              "b": jnp.zeros(HIDDEN),
              "w_out": jax.random.normal(k3, (HIDDEN, NUM_CLASSES)) / jnp.sqrt(HIDDEN),
              "b_out": jnp.zeros(NUM_CLASSES)}
    return params, tx.init(params)


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=train, eval=eval_, loss=loss,
                              apply=apply, num_classes=NUM_CLASSES, name="f60_rnn_carry_reset")
