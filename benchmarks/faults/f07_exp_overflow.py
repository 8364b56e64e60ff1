"""exp overflow: a hand-written softmax without the max subtraction, on raw 0..16 pixel values.

``exp(logits)`` overflows float32 once a logit exceeds ~88, and inf / inf is NaN. Fix:
``jax.nn.softmax`` / ``log_softmax`` (they subtract the max), and scale the inputs to [0, 1].
"""

import jax.numpy as jnp
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, digits, mlp_apply, optax_step

EXPECTED = ["nonfinite.forward"]
STYLE = "optax"
STAGES = ["run"]
OPTIONS = {"run_steps": 10}
tx = optax.sgd(0.05)


def loss(params, batch):
    logits = mlp_apply(params, batch["x"])
    unnormalized = jnp.exp(logits)  # FAULT: overflows to inf for logits > 88
    probs = unnormalized / jnp.sum(unnormalized, axis=-1, keepdims=True)
    return -jnp.mean(jnp.log(jnp.take_along_axis(probs, batch["y"][:, None], axis=-1) + 1e-9))


def init(key):
    params = dense_params(key, (64, 64, 64, NUM_CLASSES))
    return params, tx.init(params)


def experiment():
    train, eval_ = digits(scale=16.0)
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=train, eval=eval_, loss=loss,
                              apply=mlp_apply, num_classes=NUM_CLASSES, name="f07_exp_overflow")
