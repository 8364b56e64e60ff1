"""std without eps: per-patch normalisation divides by ``std + eps``, the eps outside the sqrt.

Blank 2x2 patches have zero variance; the forward value 0 / eps is finite but the derivative of
the std (a sqrt) at 0 is inf, and the gradient of the learned gain becomes NaN. Fix: put the eps
inside the sqrt, ``jnp.sqrt(jnp.var(p, -1, keepdims=True) + eps)`` (as LayerNorm does).
"""

import jax.numpy as jnp
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, digits, mlp_apply, optax_step, xent

EXPECTED = ["nonfinite.backward"]
STYLE = "optax"
STAGES = ["run"]
OPTIONS = {"run_steps": 5}
tx = optax.adam(3e-3)


def apply(params, x):
    patches = (x.reshape(-1, 4, 2, 4, 2).transpose(0, 1, 3, 2, 4).reshape(-1, 16, 4)) * params["gain"]
    mean = jnp.mean(patches, axis=-1, keepdims=True)
    std = jnp.std(patches, axis=-1, keepdims=True)  # FAULT: sqrt of a zero variance, eps added outside
    normed = (patches - mean) / (std + 1e-5)
    return mlp_apply(params["mlp"], normed.reshape(-1, 64))


def loss(params, batch):
    return xent(apply(params, batch["x"]), batch["y"])


def init(key):
    params = {"gain": jnp.ones(4), "mlp": dense_params(key, (64, 32, NUM_CLASSES))}
    return params, tx.init(params)


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=train, eval=eval_, loss=loss, apply=apply,
                              num_classes=NUM_CLASSES, name="f04_std_no_eps")
