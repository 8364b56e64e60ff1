"""A custom_vjp whose backward rule is still a stub that returns a NaN constant.

A gradient-scaling layer (scale the gradient flowing into the feature extractor, identity forward) was
written forward-first; its backward rule returns ``jnp.full_like(g, jnp.nan)`` as a "not written yet"
marker, so every gradient below it is NaN from the first step. No computation makes the NaN: it is a
constant of the program (nonfinite.literal). Fix: write the rule (``(g * scale,)``).
"""

import jax
import jax.numpy as jnp
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, digits, mlp_apply, optax_step, xent

EXPECTED = ["nonfinite.literal"]
STYLE = "optax"
STAGES = ["run"]
OPTIONS = {"run_steps": 5}
tx = optax.adam(3e-3)


@jax.custom_vjp
def scale_grad(x):
    return x


def _fwd(x):
    return x, None


def _bwd(_, g):
    return (jnp.full_like(g, jnp.nan),)  # FAULT: a stub left in the backward rule


scale_grad.defvjp(_fwd, _bwd)


def apply(params, x):
    h = scale_grad(x * params["gain"])
    return mlp_apply(params["mlp"], h)


def loss(params, batch):
    return xent(apply(params, batch["x"]), batch["y"])


def init(key):
    params = {"gain": jnp.ones(64), "mlp": dense_params(key, (64, 32, NUM_CLASSES))}
    return params, tx.init(params)


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=train, eval=eval_, loss=loss, apply=apply,
                              num_classes=NUM_CLASSES, name="f80_custom_vjp_nan_stub")
