"""Correct: a causal LM (Flax NNX) whose padded targets carry the ignore index -100.

The loss masks by ``targets != -100`` (not by the batch's mask); the model derives its key-padding
mask from the pad id of its own inputs. Changing padded tokens cannot reach the loss: padded keys
lie after every real query, and padded targets are ignored. Declared causal.
"""

import jax.numpy as jnp

import jaxsane
from benchmarks.faults._lm import VOCAB, NnxLM, Stream, nnx_init, nnx_step, token_xent

EXPECTED = []
STYLE = "nnx"
STAGES = ["data", "step", "batch"]

IGNORE = -100


def make_batch(tokens, mask):
    targets = jnp.where(mask[:, 1:] > 0, tokens[:, 1:], IGNORE)
    return {"tokens": tokens[:, :-1], "targets": targets, "mask": mask[:, 1:]}


def loss(model, batch):
    valid = batch["targets"] != IGNORE
    per_token = token_xent(model(batch["tokens"]), jnp.where(valid, batch["targets"], 0))
    return jnp.sum(jnp.where(valid, per_token, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


def experiment():
    return jaxsane.Experiment(init=nnx_init(NnxLM), step=nnx_step(loss), train=Stream(make=make_batch), loss=loss,
                              apply=lambda model, tokens: model(tokens), num_classes=VOCAB, causal=True,
                              name="c11_lm_ignore_index")
