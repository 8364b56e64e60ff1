"""jnp.where over sqrt: a row-energy feature whose forward is finite and whose gradient is NaN.

The left column of most digits is blank, so its energy is exactly 0; sqrt'(0) = inf and the where
multiplies it by a zero cotangent: 0 * inf = NaN in the backward pass. Fix: the double where,
``jnp.sqrt(jnp.where(e > 0, e, 1.0))`` inside the outer where.
"""

import jax
import jax.numpy as jnp
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, digits, optax_step, xent

EXPECTED = ["nonfinite.backward"]
STYLE = "optax"
STAGES = ["run"]
OPTIONS = {"run_steps": 5}
tx = optax.adam(3e-3)


def apply(params, x):
    left = x.reshape(-1, 8, 8)[:, :, 0] * params["gain"]
    energy = jnp.sum(left * left, axis=-1, keepdims=True)
    rms = jnp.where(energy > 0, jnp.sqrt(energy), 0.0)  # FAULT: sqrt'(0) = inf under the where
    h = jnp.concatenate([x, rms], axis=-1)
    for layer in params["mlp"][:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    return h @ params["mlp"][-1]["w"] + params["mlp"][-1]["b"]


def loss(params, batch):
    return xent(apply(params, batch["x"]), batch["y"])


def init(key):
    params = {"gain": jnp.ones(8), "mlp": dense_params(key, (65, 32, NUM_CLASSES))}
    return params, tx.init(params)


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=train, eval=eval_, loss=loss, apply=apply,
                              num_classes=NUM_CLASSES, name="f01_where_sqrt")
