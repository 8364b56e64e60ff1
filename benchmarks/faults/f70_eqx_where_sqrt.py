"""Equinox: jnp.where over sqrt inside a module's ``__call__``. The left column of most digits is blank,
so its energy is exactly 0; sqrt'(0) = inf and the where multiplies it by a zero cotangent: NaN in the
backward pass, so the first update writes NaN into the model. Fix: the double where,
``jnp.sqrt(jnp.where(e > 0, e, 1.0))`` inside the outer where.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits
from benchmarks.faults._eqx import batched, classify_loss, eqx_step, init_opt

EXPECTED = ["nonfinite.backward"]
STYLE = "equinox"
STAGES = ["run"]
OPTIONS = {"run_steps": 5}
tx = optax.adam(3e-3)


class EnergyMLP(eqx.Module):
    gain: jax.Array
    mlp: eqx.nn.MLP

    def __init__(self, key):
        self.gain = jnp.ones(8)
        self.mlp = eqx.nn.MLP(65, NUM_CLASSES, width_size=32, depth=1, key=key)

    def __call__(self, x):
        left = x.reshape(8, 8)[:, 0] * self.gain
        energy = jnp.sum(left * left, keepdims=True)
        rms = jnp.where(energy > 0, jnp.sqrt(energy), 0.0)  # FAULT: sqrt'(0) = inf under the where
        return self.mlp(jnp.concatenate([x, rms]))


def init(key):
    model = EnergyMLP(key)
    return model, init_opt(model, tx)


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=eqx_step(classify_loss, tx), train=train, eval=eval_,
                              loss=classify_loss, apply=batched, num_classes=NUM_CLASSES, name="f70_eqx_where_sqrt")
