"""A layer norm written by hand in bf16 with the variance as E[x^2] - E[x]^2.

Activations with a large common offset (mean ~8, spread ~0.1) give E[x^2] ~ 64 and E[x]^2 ~ 64 in bfloat16,
whose ulp at 64 is 0.5: the difference, the true variance ~0.01, is lost to cancellation (often 0 or
negative, then rsqrt of it). Nothing may be NaN for many steps; the normalisation is simply wrong.
Fix: compute the variance in float32 as the mean of squared deviations (jnp.var of a float32 copy) (c94).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxsane
from benchmarks.faults._common import optax_step

EXPECTED = ["precision.lost"]
STYLE = "optax"
tx = optax.adam(1e-3)
FEATURES = 256


def layer_norm(x):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(x * x, axis=-1, keepdims=True) - mean**2  # FAULT: E[x^2] - E[x]^2 in bf16 cancels
    return (x - mean) * jax.lax.rsqrt(jnp.maximum(var, 0.0) + 1e-5)


def loss(params, batch):
    h = (batch["x"] @ params["w"]).astype(jnp.bfloat16) + params["b"]
    return jnp.mean((layer_norm(h).astype(jnp.float32) @ params["v"] - batch["y"]) ** 2)


def init(key):
    k1, k2 = jax.random.split(key)
    params = {"w": 0.1 * jax.random.normal(k1, (16, FEATURES)), "b": jnp.full((FEATURES,), 8.0, jnp.bfloat16),
              "v": 0.1 * jax.random.normal(k2, (FEATURES, 1))}
    return params, tx.init(params)


def data(batches=20, n=32, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(n, 16)).astype(np.float32), "y": rng.normal(size=(n, 1)).astype(np.float32)}
            for _ in range(batches)]


def experiment(loss_fn=loss, name="f94_bf16_variance_by_moments"):
    return jaxsane.Experiment(init=init, step=optax_step(loss_fn, tx), train=data(), loss=loss_fn, name=name)


def check(loss_fn=loss):
    exp = experiment(loss_fn)
    params, _ = exp.init(jax.random.key(0))
    return jaxsane.compare_precision(exp.loss, params, exp.train[0])
