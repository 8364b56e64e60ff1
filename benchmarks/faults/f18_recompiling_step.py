"""A recompiling step: the scheduled learning rate is passed to the jitted update as a static
Python float, so every step with a new learning rate compiles the step again.

Fix: pass the learning rate as an array argument (or use an optax schedule inside the optimizer).
"""

import functools
import itertools
import math

import jax
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, digits, mlp_apply, xent

EXPECTED = ["step.recompiles"]
STYLE = "optax"
STAGES = ["step"]
DECAY_STEPS = 1000
tx = optax.scale_by_adam()


def loss(params, batch):
    return xent(mlp_apply(params, batch["x"]), batch["y"])


def init(key):
    params = dense_params(key, (64, 32, NUM_CLASSES))
    return params, tx.init(params)


@functools.partial(jax.jit, static_argnames="lr")  # FAULT: a float static argument that changes every step
def update(state, batch, lr):
    params, opt_state = state
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, jax.tree.map(lambda u: -lr * u, updates)), opt_state), {"loss": value}


_calls = itertools.count()


def cosine_lr(t: int, peak: float = 0.1) -> float:
    return 0.5 * peak * (1 + math.cos(math.pi * min(t, DECAY_STEPS) / DECAY_STEPS))


def train_step(state, batch):
    return update(state, batch, lr=cosine_lr(next(_calls)))


def experiment():
    train, eval_ = digits()
    return jaxsane.Experiment(init=init, step=train_step, train=train, eval=eval_, loss=loss, apply=mlp_apply,
                              num_classes=NUM_CLASSES, name="f18_recompiling_step")
