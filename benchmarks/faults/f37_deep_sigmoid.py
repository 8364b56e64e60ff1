"""Vanishing gradients: a 10-layer sigmoid MLP with small init. Each sigmoid layer multiplies the
backward signal by at most 1/4, so the first layers' gradients are orders of magnitude smaller
than the last layer's and the early layers barely train.

Fix: ReLU/GELU activations with He init, residual connections or normalisation layers.
"""

import jax
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, digits, optax_step, xent

EXPECTED = ["train.vanishing_grads"]
STYLE = "optax"
STAGES = ["run"]
OPTIONS = {"run_steps": 20}
SIZES = (64,) + (32,) * 9 + (NUM_CLASSES,)
tx = optax.sgd(0.1)


def apply(params, x):
    for layer in params[:-1]:
        x = jax.nn.sigmoid(x @ layer["w"] + layer["b"])  # FAULT: saturating activation through 10 layers
    return x @ params[-1]["w"] + params[-1]["b"]


def loss(params, batch):
    return xent(apply(params, batch["x"]), batch["y"])


def init(key):
    params = dense_params(key, SIZES, scale=0.1)
    return params, tx.init(params)


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=train, eval=eval_, loss=loss, apply=apply,
                              num_classes=NUM_CLASSES, name="f37_deep_sigmoid")
