"""Equinox: a stop_gradient-ed layer. The first layer's output goes through ``jax.lax.stop_gradient``
(frozen "temporarily"), so its weight and bias get an identically zero gradient and keep their random
init. Fix: remove the stop_gradient, or freeze on purpose (``eqx.partition`` with a filter spec, or
``optax.multi_transform``) so the frozen leaves are not in the optimizer at all.
"""

import equinox as eqx
import jax
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits
from benchmarks.faults._eqx import batched, classify_loss, eqx_step, init_opt

EXPECTED = ["grad.missing"]
STYLE = "equinox"
STAGES = ["grads"]
tx = optax.adam(3e-3)


class Classifier(eqx.Module):
    encoder: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.encoder = eqx.nn.Linear(64, 32, key=k1)
        self.head = eqx.nn.Linear(32, NUM_CLASSES, key=k2)

    def __call__(self, x):
        h = jax.lax.stop_gradient(jax.nn.relu(self.encoder(x)))  # FAULT
        return self.head(h)


def init(key):
    model = Classifier(key)
    return model, init_opt(model, tx)


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=eqx_step(classify_loss, tx), train=train, eval=eval_,
                              loss=classify_loss, apply=batched, num_classes=NUM_CLASSES,
                              name="f71_eqx_stop_gradient_layer")
