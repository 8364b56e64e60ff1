"""A stop_gradient-ed layer: the encoder was frozen "temporarily" and never unfrozen.

The first Dense layer's output goes through ``jax.lax.stop_gradient``, so its kernel and bias get
an identically zero gradient and keep their random init forever. Fix: remove the stop_gradient
(or freeze on purpose with ``optax.multi_transform`` and exclude those leaves from the optimizer).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits, xent

EXPECTED = ["grad.missing"]
STYLE = "linen"
STAGES = ["grads"]


class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jax.lax.stop_gradient(nn.relu(nn.Dense(32, name="encoder")(x)))  # FAULT
        return nn.Dense(NUM_CLASSES, name="head")(h)


model = Classifier()


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
                              num_classes=NUM_CLASSES, name="f12_stop_gradient_layer")
