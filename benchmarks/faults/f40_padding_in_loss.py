"""Padding in the loss: the per-token loss is averaged over every position, padding included.

The padded targets (PAD = 0) become a class the model learns to predict, and the loss is scaled
by the padding ratio of each batch. Fix: ``(per_token * mask).sum() / jnp.maximum(mask.sum(), 1)``.
"""

import jaxsane
from benchmarks.faults._lm import VOCAB, NnxLM, Stream, nnx_init, nnx_step, token_xent

EXPECTED = ["seq.padding_in_loss"]
STYLE = "nnx"
STAGES = ["batch"]


def loss(model, batch):
    return token_xent(model(batch["tokens"]), batch["targets"]).mean()  # FAULT: mask not applied


def experiment():
    return jaxsane.Experiment(init=nnx_init(NnxLM), step=nnx_step(loss), train=Stream(), loss=loss,
                              apply=lambda model, tokens: model(tokens), num_classes=VOCAB, causal=True,
                              name="f40_padding_in_loss")
