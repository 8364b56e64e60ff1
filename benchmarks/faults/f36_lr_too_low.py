"""Learning rate far too low: full-batch Adam with lr=1e-7 (a schedule's final value used as the peak).

Every update is ~1e-7 of a unit: the loss stays flat at its initial value for the whole run.
Fix: a learning rate around 1e-3 for Adam (``jaxsane.overfit`` sweeps it and reports the best).
"""

import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, mlp_apply, optax_step, xent
from jaxsane.examples._digits import load_digits_split

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
    x, y, xe, ye = load_digits_split()
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train={"x": x, "y": y}, eval={"x": xe, "y": ye},
                              loss=loss,
                              apply=mlp_apply, num_classes=NUM_CLASSES, name="f36_lr_too_low")
