"""Binary cross-entropy written by hand in bf16: log(1 - sigmoid(z)).

For confident logits (z of 4..10) sigmoid(z) rounds to within an ulp of 1 in bfloat16, so 1 - p keeps at
most a couple of bits (or is 0, and the loss of a negative example becomes -log(0) = inf or a clipped
constant): the loss and its gradient for the confident negatives are wrong. Fix: jax.nn.log_sigmoid(-z)
(optax.sigmoid_binary_cross_entropy) (c95).
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


def loss(params, batch):
    z = (batch["x"].astype(jnp.bfloat16) @ params["w"]).squeeze(-1)
    p = jax.nn.sigmoid(z)
    y = batch["y"].astype(jnp.bfloat16)
    nll = -(y * jnp.log(p + 1e-3) + (1 - y) * jnp.log(1 - p + 1e-3))  # FAULT: 1 - p cancels for p near 1
    return jnp.mean(nll.astype(jnp.float32))


def init(key):
    params = {"w": (0.8 * jax.random.normal(key, (16, 1))).astype(jnp.bfloat16)}
    return params, tx.init(params)


def data(batches=20, n=64, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(n, 16)).astype(np.float32), "y": rng.integers(0, 2, n).astype(np.float32)}
            for _ in range(batches)]


def experiment(loss_fn=loss, name="f95_one_minus_sigmoid"):
    return jaxsane.Experiment(init=init, step=optax_step(loss_fn, tx), train=data(), loss=loss_fn, name=name)


def check(loss_fn=loss):
    exp = experiment(loss_fn)
    params, _ = exp.init(jax.random.key(0))
    return jaxsane.compare_precision(exp.loss, params, exp.train[0])
