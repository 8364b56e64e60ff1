"""Pure-bf16 training with a small learning rate: the updates round away.

The MLP's parameters (and Adam's moments) are stored in bfloat16. bf16 keeps 8 significant bits, so with
round-to-nearest a weight does not move when its update is below about 2^-9 of its magnitude (Zamirai et
al., "Revisiting BFloat16 Training", 2020): Adam at lr 3e-4 moves weights of ~0.2 by ~3e-4, under half an
ulp (4.9e-4). The loss stalls with no NaN anywhere. Fix: float32 master weights (c90), stochastic rounding,
or a larger learning rate.
"""

import jax
import jax.numpy as jnp
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, digits, mlp_apply, optax_step, xent

EXPECTED = ["train.update_underflow"]
STYLE = "optax"
STAGES = ["step", "run"]
OPTIONS = {"run_steps": 30}
tx = optax.adam(3e-4)


def loss(params, batch):
    logits = mlp_apply(params, batch["x"].astype(jnp.bfloat16))
    return xent(logits.astype(jnp.float32), batch["y"])


def init(key):
    params = dense_params(key, (64, 64, NUM_CLASSES))
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)  # FAULT: bf16 weights, no float32 master copy
    return params, tx.init(params)


def experiment():
    train, eval_ = digits(scale=1 / 16)
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=train, eval=eval_, loss=loss,
                              num_classes=NUM_CLASSES, name="f90_bf16_update_underflow")
