"""Correct: a causal transformer LM (Flax NNX, adamw) on right-padded token sequences.

Next-token targets are the inputs shifted by one; attention masks the future and padded keys; the
loss is the mean over real positions only. Many sequences share a prefix and continue differently,
so a batch cannot be fit to 100% next-token accuracy. Declared causal.
"""

import jaxsane
from benchmarks.faults._lm import VOCAB, NnxLM, Stream, masked_mean, nnx_init, nnx_step, token_xent

EXPECTED = []
STYLE = "nnx"
STAGES = ["data", "init", "step", "batch", "run"]
OPTIONS = {"run_steps": 10}


def loss(model, batch):
    return masked_mean(token_xent(model(batch["tokens"]), batch["targets"]), batch["mask"])


def experiment():
    return jaxsane.Experiment(init=nnx_init(NnxLM), step=nnx_step(loss), train=Stream(), loss=loss,
                              apply=lambda model, tokens: model(tokens), num_classes=VOCAB, causal=True,
                              name="c09_lm_nnx")
