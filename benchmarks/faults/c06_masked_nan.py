"""Correct: NaNs created on purpose and masked away. Each example's "ink fraction" per column is
``col / col.sum()``, which is 0/0 = NaN for blank columns (a quarter of all digit columns);
``jnp.where`` replaces them before use.

The NaN is computed from the inputs only (no gradient flows through it), never reaches the loss,
the gradients or the state: training is correct. (checkify's float_checks flags the division.)
"""

import jax.numpy as jnp
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, digits, mlp_apply, optax_step, xent

EXPECTED = []
STYLE = "optax"
STAGES = ["data", "init", "grads", "step", "batch", "overfit", "run"]
OPTIONS = {"run_steps": 30, "overfit_steps": 150}
tx = optax.adam(3e-3)


def features(x):
    image = x.reshape(-1, 8, 8)
    total = image.sum(-2, keepdims=True)            # ink per column
    fraction = image / total                        # NaN for blank columns: 0 / 0
    fraction = jnp.where(total > 0, fraction, 0.0)  # masked on purpose
    return jnp.concatenate([x, fraction.reshape(-1, 64)], axis=-1)


def apply(params, x):
    return mlp_apply(params, features(x))


def loss(params, batch):
    return xent(apply(params, batch["x"]), batch["y"])


def init(key):
    params = dense_params(key, (128, 32, NUM_CLASSES))
    return params, tx.init(params)


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=train, eval=eval_, loss=loss, apply=apply,
                              num_classes=NUM_CLASSES, name="c06_masked_nan")
