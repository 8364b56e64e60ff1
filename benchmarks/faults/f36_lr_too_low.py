"""Learning rate far too low: Adam with lr=1e-7 (a schedule's final value used as the peak).

Every update is ~1e-7 of a unit: the loss stays flat at its initial value for the whole run.
Fix: a learning rate around 1e-3 for Adam (``jaxsane.overfit`` sweeps it and reports the best).
"""

import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, digits, mlp_apply, optax_step, xent

EXPECTED = ["train.plateau"]
STYLE = "optax"
STAGES = ["run"]
OPTIONS = {"run_steps": 30}
tx = optax.adam(learning_rate=1e-7)  # FAULT


def loss(params, batch):
    return xent(mlp_apply(params, batch["x"]), batch["y"])


def init(key):
    params = dense_params(key, (64, 32, NUM_CLASSES))
    return params, tx.init(params)


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=train, eval=eval_, loss=loss,
                              apply=mlp_apply, num_classes=NUM_CLASSES, name="f36_lr_too_low")
