"""Softmax over the batch axis: ``log_softmax(logits, axis=0)`` normalises each class over the
examples of the batch instead of each example over the classes. Predictions depend on the other
examples in the batch (and on the batch size). Fix: ``axis=-1``.
"""

import jax
import jax.numpy as jnp
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, digits, mlp_apply, optax_step

EXPECTED = ["batch.cross_talk"]
STYLE = "optax"
STAGES = ["batch"]
tx = optax.adam(3e-3)


def apply(params, x):
    return jax.nn.log_softmax(mlp_apply(params, x), axis=0)  # FAULT: axis 0 is the batch axis


def loss(params, batch):
    log_probs = apply(params, batch["x"])
    return -jnp.mean(jnp.take_along_axis(log_probs, batch["y"][:, None], axis=-1))


def init(key):
    params = dense_params(key, (64, 32, NUM_CLASSES))
    return params, tx.init(params)


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=train, eval=eval_, loss=loss, apply=apply,
                              num_classes=NUM_CLASSES, name="f27_softmax_batch_axis")
