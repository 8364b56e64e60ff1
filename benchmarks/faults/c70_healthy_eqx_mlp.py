"""A healthy Equinox classifier, written as Equinox's README writes it: an ``eqx.nn.MLP`` (its activation
functions are leaves of the model), optax Adam, and an ``eqx.filter_jit`` step
``make_step(model, opt_state, batch) -> (model, opt_state, loss)`` over the state ``(model, opt_state)``.
"""

import equinox as eqx
import jax
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits
from benchmarks.faults._eqx import batched, classify_loss, init_opt

EXPECTED = []
STYLE = "equinox"
STAGES = ["data", "init", "grads", "step", "batch", "overfit", "run"]
OPTIONS = {"run_steps": 30, "overfit_steps": 150}
tx = optax.adam(3e-3)


def init(key):
    model = eqx.nn.MLP(64, NUM_CLASSES, width_size=64, depth=2, activation=jax.nn.relu, key=key)
    return model, init_opt(model, tx)


@eqx.filter_jit
def make_step(model, opt_state, batch):
    loss, grads = eqx.filter_value_and_grad(classify_loss)(model, batch)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=make_step, train=train, eval=eval_, loss=classify_loss,
                              apply=batched, num_classes=NUM_CLASSES, name="c70_healthy_eqx_mlp")
