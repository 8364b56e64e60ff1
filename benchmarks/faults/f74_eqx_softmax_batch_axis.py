"""Equinox: a softmax over the batch axis. The model is per-example, as Equinox models are, but the
batched forward normalises the vmapped logits with ``axis=0``, over the examples of the batch instead
of over the classes: each prediction depends on the rest of the batch. Fix: ``axis=-1``.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits
from benchmarks.faults._eqx import eqx_step, init_opt

EXPECTED = ["batch.cross_talk"]
STYLE = "equinox"
STAGES = ["batch"]
tx = optax.adam(3e-3)


def apply(model, x):
    return jax.nn.log_softmax(jax.vmap(model)(x), axis=0)  # FAULT: axis 0 is the batch axis


def loss(model, batch):
    log_probs = apply(model, batch["x"])
    return -jnp.mean(jnp.take_along_axis(log_probs, batch["y"][:, None], axis=-1))


def init(key):
    model = eqx.nn.MLP(64, NUM_CLASSES, width_size=32, depth=1, key=key)
    return model, init_opt(model, tx)


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=eqx_step(loss, tx), train=train, eval=eval_, loss=loss,
                              apply=apply, num_classes=NUM_CLASSES, name="f74_eqx_softmax_batch_axis")
