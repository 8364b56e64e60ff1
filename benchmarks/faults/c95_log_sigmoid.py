"""Correct: f95's bf16 binary cross-entropy through log_sigmoid (no 1 - p)."""

import jax
import jax.numpy as jnp

from benchmarks.faults import f95_one_minus_sigmoid as f95

EXPECTED = []
STYLE = "optax"


def loss(params, batch):
    z = (batch["x"].astype(jnp.bfloat16) @ params["w"]).squeeze(-1).astype(jnp.float32)
    y = batch["y"]
    return jnp.mean(-(y * jax.nn.log_sigmoid(z) + (1 - y) * jax.nn.log_sigmoid(-z)))


def experiment():
    return f95.experiment(loss, "c95_log_sigmoid")


def check():
    return f95.check(loss)
