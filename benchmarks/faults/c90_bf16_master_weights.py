"""Correct: f90's bf16 model with float32 master weights (compute in bf16, parameters and Adam in float32)."""

import jax.numpy as jnp
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, digits, optax_step, xent

EXPECTED = []
STYLE = "optax"
STAGES = ["step", "run"]
OPTIONS = {"run_steps": 80}
tx = optax.adam(3e-4)


def apply(params, x):
    x = x.astype(jnp.bfloat16)
    for layer in params[:-1]:
        x = jnp.maximum(x @ layer["w"].astype(jnp.bfloat16) + layer["b"].astype(jnp.bfloat16), 0)
    return x @ params[-1]["w"].astype(jnp.bfloat16) + params[-1]["b"].astype(jnp.bfloat16)


def loss(params, batch):
    return xent(apply(params, batch["x"]).astype(jnp.float32), batch["y"])


def init(key):
    params = dense_params(key, (64, 64, NUM_CLASSES))  # float32 master weights
    return params, tx.init(params)


def experiment():
    train, eval_ = digits(scale=1 / 16)
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=train, eval=eval_, loss=loss,
                              num_classes=NUM_CLASSES, name="c90_bf16_master_weights")
