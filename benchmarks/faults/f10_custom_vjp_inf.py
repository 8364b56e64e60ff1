"""A custom_vjp whose backward returns inf: a "fast" sqrt rule that forgot the clamp at 0.

The forward clamps, the hand-written backward divides by sqrt(x) itself, so x == 0 (blank left
column) gives an infinite cotangent and NaN gradients. Fix: clamp in the backward rule too
(``0.5 / jnp.sqrt(jnp.maximum(x, eps))``) or drop the custom rule.
"""

import jax
import jax.numpy as jnp
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, digits, mlp_apply, optax_step, xent

EXPECTED = ["nonfinite.backward"]
STYLE = "optax"
STAGES = ["run"]
OPTIONS = {"run_steps": 5}
tx = optax.adam(3e-3)


@jax.custom_vjp
def safe_sqrt(x):
    return jnp.sqrt(jnp.maximum(x, 1e-12))


def _fwd(x):
    return safe_sqrt(x), x


def _bwd(x, g):
    return (g * 0.5 / jnp.sqrt(x),)  # FAULT: inf at x == 0


safe_sqrt.defvjp(_fwd, _bwd)


def apply(params, x):
    left = x.reshape(-1, 8, 8)[:, :, 0] * params["gain"]
    rms = safe_sqrt(jnp.sum(left * left, axis=-1, keepdims=True))
    return mlp_apply(params["mlp"], jnp.concatenate([x, rms], axis=-1))


def loss(params, batch):
    return xent(apply(params, batch["x"]), batch["y"])


def init(key):
    params = {"gain": jnp.ones(8), "mlp": dense_params(key, (65, 32, NUM_CLASSES))}
    return params, tx.init(params)


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=train, eval=eval_, loss=loss, apply=apply,
                              num_classes=NUM_CLASSES, name="f10_custom_vjp_inf")
