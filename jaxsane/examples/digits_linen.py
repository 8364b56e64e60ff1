"""A healthy digits classifier in Flax linen with a ``TrainState``."""

import flax.linen as nn
import jax
import optax
from flax.training import train_state

import jaxsane

from ._digits import NUM_CLASSES, train_eval


class MLP(nn.Module):
    hidden: int = 128

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(NUM_CLASSES)(x)


model = MLP()


@jax.jit  # one compiled program instead of an eager model.init, op by op
def init(key):
    params = model.init(key, jax.numpy.zeros((1, 64)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(3e-3))


def apply(params, x):
    return model.apply({"params": params}, x)


def loss(params, batch):
    return optax.softmax_cross_entropy_with_integer_labels(apply(params, batch["x"]), batch["y"]).mean()


@jax.jit
def train_step(state, batch):
    value, grads = jax.value_and_grad(loss)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": value}


def experiment():
    train, eval_ = train_eval()
    return jaxsane.Experiment(
        init=init,
        step=train_step,
        train=train,
        eval=eval_,
        loss=loss,
        apply=apply,
        num_classes=NUM_CLASSES,
        name="digits_linen",
    )
