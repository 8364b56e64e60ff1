"""Equinox: a dropout key that is never split. The key lives in the state, as it should, but the step
passes it to the dropout layers and returns it unchanged, so every step (and every example) drops the
same units. Fix: ``key, sub = jax.random.split(key)``, use ``sub`` and return the new ``key``.
"""

import equinox as eqx
import jax
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits, xent
from benchmarks.faults._eqx import init_opt

EXPECTED = ["step.rng_reused"]
STYLE = "equinox"
STAGES = ["step"]
tx = optax.adam(3e-3)


class DropoutMLP(eqx.Module):
    hidden: eqx.nn.Linear
    drop: eqx.nn.Dropout
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.hidden = eqx.nn.Linear(64, 64, key=k1)
        self.drop = eqx.nn.Dropout(0.5)
        self.head = eqx.nn.Linear(64, NUM_CLASSES, key=k2)

    def __call__(self, x, *, key=None):
        return self.head(self.drop(jax.nn.relu(self.hidden(x)), key=key))


def init(key):
    model = DropoutMLP(key)
    return model, init_opt(model, tx), jax.random.key(1)


def train_loss(model, batch, key):
    return xent(jax.vmap(lambda x: model(x, key=key))(batch["x"]), batch["y"])


def apply(model, x):
    return jax.vmap(eqx.nn.inference_mode(model))(x)


@eqx.filter_jit
def step(state, batch):
    model, opt_state, key = state
    value, grads = eqx.filter_value_and_grad(train_loss)(model, batch, key)  # FAULT: key never split
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return (eqx.apply_updates(model, updates), opt_state, key), {"loss": value}


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=step, train=train, eval=eval_, apply=apply,
                              loss=lambda m, b: xent(apply(m, b["x"]), b["y"]), num_classes=NUM_CLASSES,
                              name="f73_eqx_dropout_key_reused")
