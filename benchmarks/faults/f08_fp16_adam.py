"""float16 Adam: eps=1e-8 rounds to 0 in float16, so a zero gradient gives 0 / 0 = NaN updates.

The model is cast to float16 "to save memory", optimizer state included. Pixels that are 0 in
every image give their first-layer weights an exactly zero gradient; Adam's m / (sqrt(v) + eps) is
then 0 / (0 + 0). The loss stays finite; the new parameters are NaN. Fix: keep float32 master
weights and optimizer state (mixed precision), or use eps >= 1e-4 in float16.
"""

import jax
import jax.numpy as jnp
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, digits, mlp_apply, optax_step, xent

EXPECTED = ["nonfinite.update"]
STYLE = "optax"
STAGES = ["run"]
OPTIONS = {"run_steps": 5}
tx = optax.adam(1e-3)


def loss(params, batch):
    logits = mlp_apply(params, batch["x"].astype(jnp.float16))
    return xent(logits.astype(jnp.float32), batch["y"])


def init(key):
    params = jax.tree.map(lambda p: p.astype(jnp.float16), dense_params(key, (64, 32, NUM_CLASSES)))  # FAULT
    return params, tx.init(params)


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=train, eval=eval_, loss=loss,
                              apply=mlp_apply, num_classes=NUM_CLASSES, name="f08_fp16_adam")
