"""A healthy Equinox CNN with the layers that need care: ``eqx.nn.Conv2d`` on the 8x8 digits,
``eqx.nn.LayerNorm``, and ``eqx.nn.Dropout`` fed a key that lives in the state and is split every step
(one sub-key per example). ``apply`` runs the model in inference mode (``eqx.nn.inference_mode``).
"""

import equinox as eqx
import jax
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits, xent
from benchmarks.faults._eqx import init_opt

EXPECTED = []
STYLE = "equinox"
STAGES = ["data", "init", "grads", "step", "batch", "overfit", "run"]
OPTIONS = {"run_steps": 30, "overfit_steps": 150}
tx = optax.adam(3e-3)


class ConvNet(eqx.Module):
    conv: eqx.nn.Conv2d
    norm: eqx.nn.LayerNorm
    drop: eqx.nn.Dropout
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(1, 8, kernel_size=3, padding=1, key=k1)
        self.norm = eqx.nn.LayerNorm(8 * 8 * 8)
        self.drop = eqx.nn.Dropout(0.2)
        self.head = eqx.nn.Linear(8 * 8 * 8, NUM_CLASSES, key=k2)

    def __call__(self, x, *, key=None):
        h = jax.nn.relu(self.conv(x.reshape(1, 8, 8))).reshape(-1)
        h = self.drop(self.norm(h), key=key)
        return self.head(h)


def init(key):
    model = ConvNet(key)
    return model, init_opt(model, tx), jax.random.key(1)


def train_loss(model, batch, key):
    keys = jax.random.split(key, batch["x"].shape[0])
    return xent(jax.vmap(lambda x, k: model(x, key=k))(batch["x"], keys), batch["y"])


def apply(model, x):
    return jax.vmap(eqx.nn.inference_mode(model))(x)


def loss(model, batch):
    return train_loss(model, batch, jax.random.key(0))


@eqx.filter_jit
def step(state, batch):
    model, opt_state, key = state
    key, sub = jax.random.split(key)
    value, grads = eqx.filter_value_and_grad(train_loss)(model, batch, sub)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return (eqx.apply_updates(model, updates), opt_state, key), {"loss": value}


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=step, train=train, eval=eval_, loss=loss, apply=apply,
                              num_classes=NUM_CLASSES, name="c71_healthy_eqx_conv_dropout")
