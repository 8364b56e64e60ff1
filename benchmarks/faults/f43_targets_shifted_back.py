"""Next-token targets shifted the wrong way: each target is the previous input token.

The pipeline pairs ``inputs = tokens[:, 1:]`` with ``targets = tokens[:, :-1]``, so position t is
asked for the token it has already seen at t - 1. Fix: ``inputs = tokens[:, :-1]``,
``targets = tokens[:, 1:]``.
"""

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

import jaxsane
from benchmarks.faults._lm import LENGTH, VOCAB, LinenBlock, Stream, causal_mask, linen_state, token_xent

EXPECTED = ["data.unshifted_targets"]
STYLE = "linen"
STAGES = ["data"]


def make_batch(tokens, mask):
    return {"tokens": tokens[:, 1:], "targets": tokens[:, :-1], "mask": mask[:, 1:]}  # FAULT: shifted backwards


class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        h = nn.Embed(VOCAB, 32)(tokens) + self.param("pos", nn.initializers.normal(0.02), (LENGTH - 1, 32))
        return nn.Dense(VOCAB)(LinenBlock()(h, causal_mask(tokens)))


model = LM()
init, tx = linen_state(model)


def loss(params, batch):
    per_token = token_xent(model.apply({"params": params}, batch["tokens"]), batch["targets"])
    return jnp.sum(per_token * batch["mask"]) / jnp.maximum(jnp.sum(batch["mask"]), 1.0)


@jax.jit
def step(state, batch):
    params, opt_state = state
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), {"loss": value}


def experiment():
    return jaxsane.Experiment(init=init, step=step, train=Stream(make=make_batch), loss=loss,
                              apply=lambda params, tokens: model.apply({"params": params}, tokens),
                              num_classes=VOCAB, causal=True, name="f43_targets_shifted_back")
