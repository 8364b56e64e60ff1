"""Shared, fault-free scaffolding for the low-precision programs (f91-f95, c91-c95): a tiny bigram language
model over a large vocabulary, random token batches, and the ``check()`` that runs
``jaxsane.compare_precision`` on a program's loss at its initial parameters and first batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxsane
from benchmarks.faults._common import optax_step

VOCAB, DIM, BATCH, SEQ = 4096, 16, 8, 256


def tokens(seed: int = 0, batches: int = 64):
    """A finite list of {"x", "y"} batches of random tokens [BATCH, SEQ] (targets: the next token)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(batches):
        t = rng.integers(0, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)
        out.append({"x": t[:, :-1], "y": t[:, 1:]})
    return out


def bigram_init(dtype):
    def init(key):
        k1, k2 = jax.random.split(key)
        params = {"emb": 0.02 * jax.random.normal(k1, (VOCAB, DIM)), "out": 0.02 * jax.random.normal(k2, (DIM, VOCAB))}
        params = jax.tree.map(lambda p: p.astype(dtype), params)
        return params, TX.init(params)

    return init


TX = optax.adam(1e-3)


def experiment_of(loss, init, name, data=None):
    data = tokens() if data is None else data
    return jaxsane.Experiment(init=init, step=optax_step(loss, TX), train=data, loss=loss, name=name)


def check_loss(module):
    """compare_precision of the module's loss on its initial parameters and first batch."""
    exp = module.experiment()
    params, _ = exp.init(jax.random.key(0))
    return jaxsane.compare_precision(exp.loss, params, exp.train[0])


def per_token_xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
