"""A healthy classifier trained with plain SGD at 1e-4, the optimizer built without
``optax.inject_hyperparams``: the overfit sweep cannot set the rate, and at the step's own rate the loss on
one batch barely moves in a few hundred steps. That is a slow rate, not a broken model: the sweep scales the
step's updates as larger rates instead and the model fits.
"""

import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, digits, mlp_apply, optax_step, xent

EXPECTED = []
STYLE = "optax"
STAGES = ["data", "init", "grads", "step", "batch", "overfit", "run"]
OPTIONS = {"run_steps": 30, "overfit_steps": 300}
tx = optax.sgd(1e-4)


def loss(params, batch):
    return xent(mlp_apply(params, batch["x"]), batch["y"])


def init(key):
    params = dense_params(key, (64, 64, NUM_CLASSES))
    return params, tx.init(params)


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=train, eval=eval_, loss=loss,
                              apply=mlp_apply, num_classes=NUM_CLASSES, name="c86_healthy_plain_sgd_small_lr")
