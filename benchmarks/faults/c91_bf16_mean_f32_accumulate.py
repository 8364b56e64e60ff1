"""Correct: f91's bf16 model with its per-token loss averaged in float32."""

import jax.numpy as jnp

from benchmarks.faults._prec import bigram_init, check_loss, experiment_of, per_token_xent

EXPECTED = []
STYLE = "optax"


def loss(params, batch):
    logits = params["emb"][batch["x"]] @ params["out"]
    per_token = per_token_xent(logits, batch["y"]).astype(jnp.bfloat16)
    return per_token.astype(jnp.float32).mean()


def experiment():
    return experiment_of(loss, bigram_init(jnp.bfloat16), "c91_bf16_mean_f32_accumulate")


def check():
    import sys

    return check_loss(sys.modules[__name__])
