"""Correct: f92's fp16 model on normalised inputs, its log-softmax computed in float32."""

import jax
import jax.numpy as jnp
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, digits, mlp_apply, optax_step

EXPECTED = []
STYLE = "optax"
tx = optax.sgd(1e-3)


def loss(params, batch):
    logits = mlp_apply(params, batch["x"].astype(jnp.float16)).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))


def init(key):
    params = jax.tree.map(lambda p: p.astype(jnp.float16), dense_params(key, (64, 64, NUM_CLASSES)))
    return params, tx.init(params)


def experiment():
    train, eval_ = digits(scale=1 / 16)
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=train, eval=eval_, loss=loss,
                              num_classes=NUM_CLASSES, name="c92_fp16_stable_softmax")


def check():
    exp = experiment()
    params, _ = exp.init(jax.random.key(0))
    return jaxsane.compare_precision(exp.loss, params, next(iter(exp.train)))
