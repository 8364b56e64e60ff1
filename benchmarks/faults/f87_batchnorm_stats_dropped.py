"""Linen BatchNorm in train mode inside the step (batch statistics, mutable ``batch_stats``), but the step
returns the state without the new statistics: training looks fine, eval runs on the initial running averages
and its loss stalls far above the train loss. Fix: `.replace(batch_stats=updates["batch_stats"])`.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, digits, xent

EXPECTED = ["step.stats_frozen"]
STYLE = "linen"
STAGES = ["data", "init", "grads", "step", "batch", "overfit", "run"]
OPTIONS = {"run_steps": 30, "overfit_steps": 150}


class BNMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dense(64)(x)
        h = nn.BatchNorm(use_running_average=not train, momentum=0.9)(h)
        return nn.Dense(NUM_CLASSES)(nn.relu(h))


model = BNMLP()


class State(train_state.TrainState):
    batch_stats: dict


def init(key):
    variables = model.init(key, jnp.zeros((2, 64)))
    return State.create(apply_fn=model.apply, params=variables["params"], tx=optax.adam(3e-3),
                        batch_stats=variables["batch_stats"])


@jax.jit
def train_step(state, batch):
    def train_loss(params):
        logits, updates = model.apply({"params": params, "batch_stats": state.batch_stats}, batch["x"],
                                      train=True, mutable=["batch_stats"])
        return xent(logits, batch["y"]), updates

    (value, updates), grads = jax.value_and_grad(train_loss, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads)  # FAULT: the new batch_stats (updates) are dropped
    return state, {"loss": value}


def experiment():
    train, eval_ = digits()
    stats = init(jax.random.key(0)).batch_stats  # eval with the initial running statistics
    apply = lambda params, x: model.apply({"params": params, "batch_stats": stats}, x)
    loss = lambda params, batch: xent(apply(params, batch["x"]), batch["y"])
    return jaxsane.Experiment(init=init, step=train_step, train=train, eval=eval_, loss=loss, apply=apply,
                              num_classes=NUM_CLASSES, name="f87_batchnorm_stats_dropped")
