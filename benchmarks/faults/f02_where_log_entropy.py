"""jnp.where over log: an entropy feature p*log(p) guarded by a where, NaN in the backward pass.

``p`` is a ReLU-normalised distribution, so inactive units give p == 0 exactly. The where hides
the forward 0 * -inf, but log'(0) = inf times the zero cotangent is NaN. Fix: ``jnp.log(jnp.where(p > 0,
p, 1.0))`` inside the where, or ``jax.scipy.special.xlogy(p, p)``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits, xent

EXPECTED = ["nonfinite.backward"]
STYLE = "linen"
STAGES = ["run"]
OPTIONS = {"run_steps": 5}


class EntropyMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32)(x))
        p = h / (jnp.sum(h, axis=-1, keepdims=True) + 1e-6)
        entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(p), 0.0), axis=-1, keepdims=True)  # FAULT
        return nn.Dense(NUM_CLASSES)(jnp.concatenate([h, entropy], axis=-1))


model = EntropyMLP()


def apply(params, x):
    return model.apply({"params": params}, x)


def loss(params, batch):
    return xent(apply(params, batch["x"]), batch["y"])


def init(key):
    params = model.init(key, jnp.zeros((1, 64)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(3e-3))


@jax.jit
def train_step(state, batch):
    value, grads = jax.value_and_grad(loss)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": value}


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=train_step, train=train, eval=eval_, loss=loss, apply=apply,
                              num_classes=NUM_CLASSES, name="f02_where_log_entropy")
