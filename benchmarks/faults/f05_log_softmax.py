"""log(softmax(x)): a sharpened softmax underflows to exactly 0 and its log is -inf.

The author sharpens the prediction with a temperature and takes ``jnp.log(jax.nn.softmax(...))``.
Once a logit gap exceeds ~100 the softmax of the true class is 0 in float32 and the loss is inf.
Fix: ``jax.nn.log_softmax`` (or ``optax.softmax_cross_entropy_with_integer_labels``) on the logits.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits

EXPECTED = ["nonfinite.forward"]
STYLE = "linen"
STAGES = ["run"]
OPTIONS = {"run_steps": 10}
TEMPERATURE = 0.002


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(NUM_CLASSES)(nn.relu(nn.Dense(32)(x)))


model = MLP()


def apply(params, x):
    return model.apply({"params": params}, x)


def loss(params, batch):
    log_probs = jnp.log(jax.nn.softmax(apply(params, batch["x"]) / TEMPERATURE))  # FAULT: log(0) = -inf
    return -jnp.mean(jnp.take_along_axis(log_probs, batch["y"][:, None], axis=-1))


def init(key):
    params = model.init(key, jnp.zeros((1, 64)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))


@jax.jit
def train_step(state, batch):
    value, grads = jax.value_and_grad(loss)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": value}


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=train_step, train=train, eval=eval_, loss=loss, apply=apply,
                              num_classes=NUM_CLASSES, name="f05_log_softmax")
