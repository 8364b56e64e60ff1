"""Correct: a Flax lm1b-style LM (NNX). The batch holds only the token ids; the model takes them as its
targets and shifts them right inside (``shift_right``: position t reads ids ``< t``), attention masks the
future and padded keys by ``ids > 0``, and the loss weights every position by ``ids > 0``.

Nothing is wrong. Two things used to look wrong from outside: the targets equal the model's input (the
shift is inside the model, not in the data), and the padding is the pad id itself (changing a pad id
un-pads that position, so a probe that changes the ids moves the loss of a correct program).
"""

import jax
import jax.numpy as jnp
from flax import nnx

import jaxsane
from benchmarks.faults._lm import LENGTH, PAD, VOCAB, Stream, nnx_init, nnx_step, token_xent

EXPECTED = []
STYLE = "nnx"
STAGES = ["data", "init", "step", "batch", "run"]
OPTIONS = {"run_steps": 10}


def shift_right(ids):
    return jnp.pad(ids, ((0, 0), (1, 0)))[:, :-1]


class ShiftInsideLM(nnx.Module):
    """A 1-block pre-LN causal transformer over the right-shifted ids; keys masked by the unshifted ids > 0."""

    def __init__(self, rngs: nnx.Rngs, dim: int = 32, heads: int = 2):
        self.embed = nnx.Embed(VOCAB, dim, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (LENGTH, dim)))
        self.ln1, self.ln2 = nnx.LayerNorm(dim, rngs=rngs), nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, dim, decode=False, rngs=rngs)
        self.mlp1, self.mlp2 = nnx.Linear(dim, 4 * dim, rngs=rngs), nnx.Linear(4 * dim, dim, rngs=rngs)
        self.out = nnx.Linear(dim, VOCAB, rngs=rngs)

    def __call__(self, ids):
        T = ids.shape[1]
        h = self.embed(shift_right(ids)) + self.pos[...][:T]
        mask = jnp.tril(jnp.ones((T, T), bool))[None, None] & (ids > PAD)[:, None, None, :]
        h = h + self.attn(self.ln1(h), mask=mask)
        h = h + self.mlp2(nnx.gelu(self.mlp1(self.ln2(h))))
        return self.out(h)


def loss(model, batch):
    ids = batch["inputs"]
    weights = jnp.where(ids > PAD, 1.0, 0.0)
    return jnp.sum(token_xent(model(ids), ids) * weights) / jnp.sum(weights)


def experiment():
    return jaxsane.Experiment(init=nnx_init(ShiftInsideLM), step=nnx_step(loss),
                              train=Stream(make=lambda tokens, mask: {"inputs": tokens}), loss=loss,
                              apply=lambda model, ids: model(ids), inputs=lambda b: b["inputs"],
                              labels=lambda b: b["inputs"], mask=lambda b: b["inputs"] > PAD, num_classes=VOCAB,
                              causal=True, name="c81_lm_ids_mask_shift_inside")
