"""A healthy Equinox classifier whose model holds an int32 array field (a vocabulary of class ids the
model indexes its output with, as an embedding table's ids or a label map). Equinox differentiates only the
float leaves (``eqx.filter_value_and_grad``), so the int array is a constant of the step; jaxsane must not
differentiate it either.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits
from benchmarks.faults._eqx import batched, classify_loss

EXPECTED = []
STYLE = "equinox"
STAGES = ["data", "init", "grads", "step", "batch", "overfit", "run"]
OPTIONS = {"run_steps": 30, "overfit_steps": 150}
tx = optax.adam(3e-3)


class Classifier(eqx.Module):
    mlp: eqx.nn.MLP
    order: jax.Array  # int32 [classes]: which output unit is which class

    def __call__(self, x):
        return self.mlp(x)[self.order]


def init(key):
    mlp = eqx.nn.MLP(64, NUM_CLASSES, width_size=64, depth=2, activation=jax.nn.relu, key=key)
    model = Classifier(mlp, jnp.arange(NUM_CLASSES, dtype=jnp.int32)[::-1])
    return model, tx.init(eqx.filter(model, eqx.is_inexact_array))


@eqx.filter_jit
def make_step(model, opt_state, batch):
    loss, grads = eqx.filter_value_and_grad(classify_loss)(model, batch)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=make_step, train=train, eval=eval_, loss=classify_loss,
                              apply=batched, num_classes=NUM_CLASSES, name="c85_healthy_eqx_int_field")
