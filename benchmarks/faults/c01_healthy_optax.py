"""Correct: a pure-optax MLP with AdamW, gradient clipping and a cosine schedule."""

import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, digits, mlp_apply, optax_step, xent

EXPECTED = []
STYLE = "optax"
STAGES = ["data", "init", "grads", "step", "batch", "overfit", "run"]
OPTIONS = {"run_steps": 30, "overfit_steps": 150}
tx = optax.chain(optax.clip_by_global_norm(1.0),
                 optax.adamw(optax.warmup_cosine_decay_schedule(1e-4, 3e-3, 10, 1000), weight_decay=1e-4))


def loss(params, batch):
    return xent(mlp_apply(params, batch["x"]), batch["y"])


def init(key):
    params = dense_params(key, (64, 64, 32, NUM_CLASSES))
    return params, tx.init(params)


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=train, eval=eval_, loss=loss,
                              apply=mlp_apply, num_classes=NUM_CLASSES, name="c01_healthy_optax")
