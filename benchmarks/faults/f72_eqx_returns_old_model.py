"""Equinox: the step applies the updates and returns the model it was given. The loss is printed every
step and never moves; the optimizer state advances, the model does not. Fix: return the updated model.
"""

import equinox as eqx
import jax
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits
from benchmarks.faults._eqx import batched, classify_loss, init_opt

EXPECTED = ["step.no_update"]
STYLE = "equinox"
STAGES = ["step"]
tx = optax.adam(3e-3)


def init(key):
    model = eqx.nn.MLP(64, NUM_CLASSES, width_size=32, depth=1, activation=jax.nn.gelu, key=key)
    return model, init_opt(model, tx)


@eqx.filter_jit
def make_step(model, opt_state, batch):
    loss, grads = eqx.filter_value_and_grad(classify_loss)(model, batch)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    new_model = eqx.apply_updates(model, updates)
    return model, opt_state, loss  # FAULT: the old model, not new_model


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=make_step, train=train, eval=eval_, loss=classify_loss,
                              apply=batched, num_classes=NUM_CLASSES, name="f72_eqx_returns_old_model")
