"""Tiny train programs in every step style, shared by the foundation tests."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

import jaxsane

TX = optax.adam(1e-2)


def batch(n=8, bad=False, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    if bad:
        x[2, 1] = np.nan
    return {"x": x, "y": (np.arange(n) % 3).astype(np.int32)}


# ---- pure optax
def optax_init(key):
    params = {"w": jax.random.normal(key, (4, 3)) * 0.5, "b": jnp.zeros(3)}
    return params, TX.init(params)


def optax_apply(params, x):
    return x @ params["w"] + params["b"]


def optax_loss(params, b):
    return optax.softmax_cross_entropy_with_integer_labels(optax_apply(params, b["x"]), b["y"]).mean()


def optax_step(state, b):
    params, opt_state = state
    value, grads = jax.value_and_grad(optax_loss)(params, b)
    updates, opt_state = TX.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), {"loss": value}


def optax_step_state_only(state, b):
    return optax_step(state, b)[0]


def optax_step_of(loss, tx):
    """The usual jitted optax step for ``loss(params, batch)`` over a ``(params, opt_state)`` state."""

    @jax.jit
    def step(state, b):
        params, opt = state
        value, grads = jax.value_and_grad(loss)(params, b)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), {"loss": value}

    return step


def optax_experiment(**kw):
    return jaxsane.Experiment(init=optax_init, step=jax.jit(optax_step), train=batch(), loss=optax_loss,
                              apply=optax_apply, num_classes=3, **kw)


# ---- linen TrainState
class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))


def linen_init(key):
    model = LinenMLP()
    params = model.init(key, jnp.zeros((1, 4)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=TX)


def linen_loss(params, b):
    logits = LinenMLP().apply({"params": params}, b["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()


@jax.jit
def linen_step(state, b):
    value, grads = jax.value_and_grad(linen_loss)(state.params, b)
    return state.apply_gradients(grads=grads), {"loss": value}


# ---- NNX in place
class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.l2 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def nnx_init(key):
    model = NNXMLP(nnx.Rngs(params=key))
    return model, nnx.Optimizer(model, TX, wrt=nnx.Param)


def nnx_loss(model, b):
    return optax.softmax_cross_entropy_with_integer_labels(model(b["x"]), b["y"]).mean()


@nnx.jit
def nnx_step(model, optimizer, b):
    value, grads = nnx.value_and_grad(nnx_loss)(model, b)
    optimizer.update(model, grads)
    return value


@nnx.jit
def nnx_step_tuple(state, b):
    model, optimizer = state
    value, grads = nnx.value_and_grad(nnx_loss)(model, b)
    optimizer.update(model, grads)
    return value


def nnx_classifier_experiment(module, x, y, *, lr=1e-3, apply=lambda m, x: m(x), num_classes=None, loss=None):
    """An NNX ``module(rngs)`` classifier with Adam (``lr`` a rate or a schedule), a cross-entropy step returning
    the loss, one batch; ``loss=True`` declares the loss to doctor too."""
    def init(key):
        model = module(nnx.Rngs(params=key))
        return model, nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)

    def mean_loss(model, b):
        return optax.softmax_cross_entropy_with_integer_labels(model(b["x"]), b["y"]).mean()

    @nnx.jit
    def step(model, optimizer, b):
        value, grads = nnx.value_and_grad(mean_loss)(model, b)
        optimizer.update(model, grads)
        return value

    return jaxsane.Experiment(
        init=init, step=step, train={"x": x, "y": y}, apply=apply, num_classes=num_classes,
        loss=mean_loss if loss else None,
    )


# ---- an NNX step whose forward pass makes a NaN (log of a negative activation), as a user's module file
NNX_LOG_MODULE = '''
import jax.numpy as jnp, optax
from flax import nnx

class LogMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(3, 4, rngs=rngs)
        self.l2 = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.log(self.l1(x)))  # NAN_LINE

def make_objects():
    model = LogMLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

def batch():
    return {"x": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "y": jnp.ones((2, 1))}

@nnx.jit
def train_step(model, optimizer, batch):
    model.train()
    loss_fn = lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss
'''


def nnx_log_dump(directory, extra: str = "", name: str = "user_nnx_step"):
    """Write :data:`NNX_LOG_MODULE` (+ ``extra``) as ``directory/name.py``, import it, run its guarded step
    with ``dump_dir`` and return ``(module, NonFiniteError)``."""
    import importlib.util
    import os
    file = os.path.join(str(directory), f"{name}.py")
    with open(file, "w") as fh:
        fh.write(NNX_LOG_MODULE + extra)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model, optimizer = module.make_objects()
    guarded = jaxsane.guard(module.train_step, dump_dir=os.path.join(str(directory), "dumps"), sync=True)
    try:
        guarded(model, optimizer, module.batch())
    except jaxsane.NonFiniteError as e:
        return module, e
    raise AssertionError("the NNX log step did not fail")
