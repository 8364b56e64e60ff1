"""Correct: a causal transformer LM (Flax linen, pure optax state) trained with label smoothing.

Smoothed targets keep the loss above 0 at any fit; the loss is averaged over real positions only,
attention masks the future and padded keys. Declared causal.
"""

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

import jaxsane
from benchmarks.faults._lm import LENGTH, VOCAB, LinenBlock, Stream, causal_mask, linen_state

EXPECTED = []
STYLE = "linen"
STAGES = ["data", "init", "step", "batch", "run"]
OPTIONS = {"run_steps": 10}


class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        h = nn.Embed(VOCAB, 32)(tokens) + self.param("pos", nn.initializers.normal(0.02), (LENGTH - 1, 32))
        return nn.Dense(VOCAB)(LinenBlock()(h, causal_mask(tokens)))


model = LM()
init, tx = linen_state(model)


def loss(params, batch):
    targets = optax.smooth_labels(jax.nn.one_hot(batch["targets"], VOCAB), 0.1)
    per_token = optax.softmax_cross_entropy(model.apply({"params": params}, batch["tokens"]), targets)
    return jnp.sum(per_token * batch["mask"]) / jnp.maximum(jnp.sum(batch["mask"]), 1.0)


@jax.jit
def step(state, batch):
    params, opt_state = state
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), {"loss": value}


def experiment():
    return jaxsane.Experiment(init=init, step=step, train=Stream(), loss=loss,
                              apply=lambda params, tokens: model.apply({"params": params}, tokens),
                              num_classes=VOCAB, causal=True, name="c10_lm_linen_label_smoothing")
