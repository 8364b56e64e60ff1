"""A wrong custom_vjp: a hand-written swish backward that forgot the product rule.

swish(x) = x * sigmoid(x), so swish'(x) = s + x * s * (1 - s). The rule below returns only s:
training still runs and the loss still falls, but every gradient through the activation is wrong.
Fix: the full derivative, or ``jax.nn.swish`` with autodiff.
"""

import jax
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, digits, optax_step, xent

EXPECTED = ["grad.mismatch"]
STYLE = "optax"
STAGES = ["grads"]
tx = optax.adam(3e-3)


@jax.custom_vjp
def swish(x):
    return x * jax.nn.sigmoid(x)


def _fwd(x):
    return swish(x), x


def _bwd(x, g):
    return (g * jax.nn.sigmoid(x),)  # FAULT: missing x * s * (1 - s)


swish.defvjp(_fwd, _bwd)


def apply(params, x):
    for layer in params[:-1]:
        x = swish(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss(params, batch):
    return xent(apply(params, batch["x"]), batch["y"])


def init(key):
    params = dense_params(key, (64, 32, NUM_CLASSES))
    return params, tx.init(params)


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=train, eval=eval_, loss=loss, apply=apply,
                              num_classes=NUM_CLASSES, name="f11_custom_vjp_wrong")
