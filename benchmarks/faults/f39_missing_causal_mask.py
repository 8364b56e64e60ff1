"""Missing causal mask: a linen LM declared causal masks only the padded keys.

Every position attends to the whole sequence, including the tokens it is asked to predict: the
training loss falls to near 0 by reading the answer, and generation fails. Fix: combine the
padding mask with ``nn.make_causal_mask(tokens)``.
"""

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

import jaxsane
from benchmarks.faults._lm import LENGTH, PAD, VOCAB, LinenBlock, Stream, linen_state, token_xent

EXPECTED = ["seq.future_leakage"]
STYLE = "linen"
STAGES = ["batch"]


class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        h = nn.Embed(VOCAB, 32)(tokens) + self.param("pos", nn.initializers.normal(0.02), (LENGTH - 1, 32))
        mask = nn.make_attention_mask(tokens != PAD, tokens != PAD)  # FAULT: no causal mask
        return nn.Dense(VOCAB)(LinenBlock()(h, mask))


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
    return jaxsane.Experiment(init=init, step=step, train=Stream(), loss=loss,
                              apply=lambda params, tokens: model.apply({"params": params}, tokens),
                              num_classes=VOCAB, causal=True, name="f39_missing_causal_mask")
