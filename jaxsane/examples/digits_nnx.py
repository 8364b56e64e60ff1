"""A healthy digits classifier in Flax NNX: an ``nnx.jit`` step mutating (model, optimizer) in place."""

import optax
from flax import nnx

import jaxsane

from ._digits import NUM_CLASSES, train_eval


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, hidden: int = 128):
        self.l1 = nnx.Linear(64, hidden, rngs=rngs)
        self.l2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, NUM_CLASSES, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.l1(x))
        x = nnx.relu(self.l2(x))
        return self.out(x)


def init(key):
    model = MLP(nnx.Rngs(params=key))
    return model, nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)


def loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()


@nnx.jit
def train_step(model, optimizer, batch):
    value, grads = nnx.value_and_grad(loss)(model, batch)
    optimizer.update(model, grads)
    return value


def experiment():
    train, eval_ = train_eval()
    return jaxsane.Experiment(
        init=init,
        step=train_step,
        train=train,
        eval=eval_,
        loss=loss,
        apply=lambda model, x: model(x),
        num_classes=NUM_CLASSES,
        name="digits_nnx",
    )
