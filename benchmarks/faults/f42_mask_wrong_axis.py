"""Attention mask on the wrong axis: the causal mask is built over (keys, queries), not (queries, keys).

``jnp.tril`` indexed [key, query] lets query t see keys s >= t: every position attends to the
future (and not to its past). Fix: the mask is ``[..., query, key]``, i.e. ``tril`` without the
transpose, as ``nnx.make_causal_mask`` builds it.
"""

import jax
import jax.numpy as jnp
from flax import nnx

import jaxsane
from benchmarks.faults._lm import PAD, VOCAB, NnxLM, Stream, masked_mean, nnx_init, nnx_step, token_xent

EXPECTED = ["seq.future_leakage"]
STYLE = "nnx"
STAGES = ["batch"]


class LM(NnxLM):
    def __call__(self, tokens):
        T = tokens.shape[1]
        causal = jnp.tril(jnp.ones((T, T), bool)).T  # FAULT: [key, query] order
        mask = causal[None, None] & (tokens != PAD)[:, None, None, :]
        h = self.embed(tokens) + self.pos[...][:T]
        h = h + self.attn(self.ln1(h), mask=mask)
        h = h + self.mlp2(nnx.gelu(self.mlp1(self.ln2(h))))
        return self.out(h)


def loss(model, batch):
    return masked_mean(token_xent(model(batch["tokens"]), batch["targets"]), batch["mask"])


def experiment():
    return jaxsane.Experiment(init=nnx_init(LM), step=nnx_step(loss), train=Stream(), loss=loss,
                              apply=lambda model, tokens: model(tokens), num_classes=VOCAB, causal=True,
                              name="f42_mask_wrong_axis")
