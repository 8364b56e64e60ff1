"""Unshifted next-token targets: the batch's targets are the inputs themselves.

The pipeline builds ``targets = tokens[:, :-1]`` instead of ``tokens[:, 1:]``, so the LM learns to
copy its input and "fits" quickly, while it never learns to predict the next token. Fix: targets
are the inputs shifted left by one (``tokens[:, 1:]``).
"""

import jaxsane
from benchmarks.faults._lm import VOCAB, NnxLM, Stream, masked_mean, nnx_init, nnx_step, token_xent

EXPECTED = ["data.unshifted_targets"]
STYLE = "nnx"
STAGES = ["data"]


def make_batch(tokens, mask):
    return {"tokens": tokens[:, :-1], "targets": tokens[:, :-1], "mask": mask[:, :-1]}  # FAULT: not shifted


def loss(model, batch):
    return masked_mean(token_xent(model(batch["tokens"]), batch["targets"]), batch["mask"])


def experiment():
    return jaxsane.Experiment(init=nnx_init(NnxLM), step=nnx_step(loss), train=Stream(make=make_batch), loss=loss,
                              apply=lambda model, tokens: model(tokens), num_classes=VOCAB, causal=True,
                              name="f38_unshifted_targets")
