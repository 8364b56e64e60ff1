"""Shared, fault-free scaffolding for the sequence-model programs: a token corpus and healthy
causal transformer LMs (Flax NNX and linen).

The corpus is a first-order Markov chain over ``VOCAB`` ids in which every token has two possible
successors, so many sequences share a prefix and continue differently (a batch cannot be fit to
100% next-token accuracy). Sequences hold a BOS id and 5..T real tokens, right-padded with
``PAD = 0``; the stream cycles over a fixed set of distinct sequences (an epoch), as an endless
generator over a finite dataset does. Nothing here is faulty: every program keeps its own bug
(marked ``# FAULT``) in its own file.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx

VOCAB = 16
PAD, BOS = 0, 1
LENGTH = 12          # tokens per sequence, BOS included; model inputs/targets have LENGTH - 1


def corpus(rows: int = 192, seed: int = 0, all_padding_every: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [rows, LENGTH] int32 right-padded with PAD, mask [rows, LENGTH] float32), distinct rows.

    ``all_padding_every=k`` empties every k-th sequence (BOS only: no target position is real).
    """
    rng = np.random.default_rng(seed)
    succ = rng.integers(2, VOCAB, size=(VOCAB, 2))
    seen, out = set(), []
    while len(out) < rows:
        n = int(rng.integers(6, LENGTH + 1))
        seq = [BOS, int(rng.integers(2, VOCAB))]
        while len(seq) < n:
            seq.append(int(succ[seq[-1], rng.integers(0, 2)]))
        key = tuple(seq)
        if key in seen:
            continue
        seen.add(key)
        out.append(seq + [PAD] * (LENGTH - n))
    tokens = np.asarray(out, np.int32)
    if all_padding_every:
        tokens[::all_padding_every, 1:] = PAD
    return tokens, (tokens != PAD).astype(np.float32)


def shifted(tokens: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
    """The healthy next-token batch: inputs ``tokens[:, :-1]``, targets ``tokens[:, 1:]``."""
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask[:, 1:]}


class Stream:
    """An endless stream of batches cycling over ``make(tokens, mask)`` rows (re-iterable)."""

    def __init__(self, batch_size: int = 16, make=shifted, **corpus_kwargs):
        self.batch_size, self.make, self.data = batch_size, make, corpus(**corpus_kwargs)

    def __iter__(self):
        tokens, mask = self.data
        start = 0
        while True:
            idx = (start + np.arange(self.batch_size)) % len(tokens)
            yield self.make(tokens[idx], mask[idx])
            start += self.batch_size


def causal_mask(tokens: jax.Array) -> jax.Array:
    """[B, 1, T, T]: query t may attend key s when s <= t and key s is not padding."""
    T = tokens.shape[1]
    return jnp.tril(jnp.ones((T, T), bool))[None, None] & (tokens != PAD)[:, None, None, :]


def token_xent(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def masked_mean(per_token: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(per_token * mask) / jnp.maximum(jnp.sum(mask), 1.0)


class NnxLM(nnx.Module):
    """A 1-block pre-LN causal transformer LM (NNX), masking causally and padded keys."""

    def __init__(self, rngs: nnx.Rngs, dim: int = 32, heads: int = 2):
        self.embed = nnx.Embed(VOCAB, dim, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (LENGTH - 1, dim)))
        self.ln1, self.ln2 = nnx.LayerNorm(dim, rngs=rngs), nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, dim, decode=False, rngs=rngs)
        self.mlp1, self.mlp2 = nnx.Linear(dim, 4 * dim, rngs=rngs), nnx.Linear(4 * dim, dim, rngs=rngs)
        self.out = nnx.Linear(dim, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
        h = h + self.attn(self.ln1(h), mask=causal_mask(tokens))
        h = h + self.mlp2(nnx.gelu(self.mlp1(self.ln2(h))))
        return self.out(h)


def nnx_init(model_cls, lr: float = 3e-3):
    def init(key):
        model = model_cls(nnx.Rngs(params=key))
        return model, nnx.Optimizer(model, optax.adamw(lr, weight_decay=1e-4), wrt=nnx.Param)
    return init


def nnx_step(loss):
    @nnx.jit
    def train_step(model, optimizer, batch):
        value, grads = nnx.value_and_grad(loss)(model, batch)
        optimizer.update(model, grads)
        return value
    return train_step


class LinenBlock(nn.Module):
    dim: int = 32

    @nn.compact
    def __call__(self, h, mask):
        h = h + nn.MultiHeadDotProductAttention(num_heads=2)(nn.LayerNorm()(h), mask=mask)
        return h + nn.Dense(self.dim)(nn.gelu(nn.Dense(4 * self.dim)(nn.LayerNorm()(h))))


def linen_state(module, lr: float = 3e-3):
    """``key -> (params, opt_state)`` for a linen LM, and the optimizer."""
    tx = optax.adamw(lr, weight_decay=1e-4)

    def init(key):
        params = module.init(key, jnp.ones((2, LENGTH - 1), jnp.int32))["params"]
        return params, tx.init(params)
    return init, tx
