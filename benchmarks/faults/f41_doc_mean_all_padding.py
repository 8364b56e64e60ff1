"""Per-document mean over an all-padding row: 0/0 for a sequence with no real target.

The LM loss is averaged per document first (``sum(per_token * mask, 1) / sum(mask, 1)``), and the
packing step emits empty documents (BOS only): their mean is 0/0 = NaN and so is the loss. Fix:
drop empty documents, and divide by ``jnp.maximum(mask.sum(1), 1)``.
"""

import jax.numpy as jnp

import jaxsane
from benchmarks.faults._lm import VOCAB, NnxLM, Stream, nnx_init, nnx_step, token_xent

EXPECTED = ["data.all_padding", "nonfinite.forward"]
STYLE = "nnx"
STAGES = ["data", "run"]
OPTIONS = {"run_steps": 3}


def loss(model, batch):
    per_token = token_xent(model(batch["tokens"]), batch["targets"]) * batch["mask"]
    per_doc = jnp.sum(per_token, axis=1) / jnp.sum(batch["mask"], axis=1)  # FAULT: 0/0 for an empty document
    return jnp.mean(per_doc)


def experiment():
    return jaxsane.Experiment(init=nnx_init(NnxLM), step=nnx_step(loss), train=Stream(all_padding_every=8),
                              loss=loss, apply=lambda model, tokens: model(tokens), num_classes=VOCAB, causal=True,
                              name="f41_doc_mean_all_padding")
