"""Equinox: the model counts its training steps in a Python ``int`` field. ``eqx.filter_jit`` treats every
non-array field as static, so each new count is a new program: the step compiles again on every call and
training crawls. Fix: keep the count in an array (``jnp.asarray(0)``) or use the optimizer's own count.
"""

import equinox as eqx
import jax
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits
from benchmarks.faults._eqx import batched, classify_loss

EXPECTED = ["step.recompiles"]
STYLE = "equinox"
STAGES = ["step"]
tx = optax.adam(3e-3)


class Counted(eqx.Module):
    mlp: eqx.nn.MLP
    steps: int = 0

    def __call__(self, x):
        return self.mlp(x)


def init(key):
    model = Counted(eqx.nn.MLP(64, NUM_CLASSES, width_size=32, depth=1, activation=jax.nn.relu, key=key))
    return model, tx.init(eqx.filter(model, eqx.is_inexact_array))


@eqx.filter_jit
def make_step(model, opt_state, batch):
    loss, grads = eqx.filter_value_and_grad(classify_loss)(model, batch)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    model = eqx.apply_updates(model, updates)
    model = eqx.tree_at(lambda m: m.steps, model, model.steps + 1)  # FAULT: a Python int that changes every step
    return model, opt_state, loss


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=make_step, train=train, eval=eval_, loss=classify_loss,
                              apply=batched, num_classes=NUM_CLASSES, name="f88_eqx_python_int_counter")
