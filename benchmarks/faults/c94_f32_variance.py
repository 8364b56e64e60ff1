"""Correct: f94's bf16 layer norm with its statistics computed in float32 (mean of squared deviations)."""

import jax
import jax.numpy as jnp

from benchmarks.faults import f94_bf16_variance_by_moments as f94

EXPECTED = []
STYLE = "optax"


def layer_norm(x):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.var(x32, axis=-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype)


def loss(params, batch):
    h = (batch["x"] @ params["w"]).astype(jnp.bfloat16) + params["b"]
    return jnp.mean((layer_norm(h).astype(jnp.float32) @ params["v"] - batch["y"]) ** 2)


def experiment():
    return f94.experiment(loss, "c94_f32_variance")


def check():
    return f94.check(loss)
