"""A bf16 mean over a long axis: the loss of 2048 tokens averaged in bfloat16.

``per_token.mean(dtype=jnp.bfloat16)`` accumulates the sum in bf16 (8 significant bits): every partial sum
rounds, and at init every token's loss is about ln(4096) = 8.3, so the roundings all lean the same way and
the mean is off by a few percent (XLA's pairwise order does not save it). Nothing is NaN; the loss and its
gradient scale are simply wrong. Fix: accumulate in float32 (c91).
"""

import jax.numpy as jnp

from benchmarks.faults._prec import bigram_init, check_loss, experiment_of, per_token_xent

EXPECTED = ["precision.lost"]
STYLE = "optax"


def loss(params, batch):
    logits = params["emb"][batch["x"]] @ params["out"]
    per_token = per_token_xent(logits, batch["y"]).astype(jnp.bfloat16)
    return per_token.mean(dtype=jnp.bfloat16)  # FAULT: the sum of 2048 terms accumulated in bf16


def experiment():
    return experiment_of(loss, bigram_init(jnp.bfloat16), "f91_bf16_long_mean")


def check():
    import sys

    return check_loss(sys.modules[__name__])
