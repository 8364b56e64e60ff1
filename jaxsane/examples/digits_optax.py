"""A healthy digits classifier in pure JAX + optax: ``state = (params, opt_state)``."""

import jax
import jax.numpy as jnp
import optax

import jaxsane

from ._digits import NUM_CLASSES, train_eval

SIZES = (64, 128, 128, NUM_CLASSES)
tx = optax.adam(3e-3)


def init_params(key):
    params = []
    for n_in, n_out in zip(SIZES[:-1], SIZES[1:]):
        key, sub = jax.random.split(key)
        params.append({"w": jax.random.normal(sub, (n_in, n_out)) * jnp.sqrt(2.0 / n_in), "b": jnp.zeros(n_out)})
    return params


def apply(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss(params, batch):
    logits = apply(params, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def init(key):
    params = init_params(key)
    return params, tx.init(params)


@jax.jit
def train_step(state, batch):
    params, opt_state = state
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), {"loss": value}


def experiment():
    train, eval_ = train_eval()
    return jaxsane.Experiment(
        init=init,
        step=train_step,
        train=train,
        eval=eval_,
        loss=loss,
        apply=apply,
        num_classes=NUM_CLASSES,
        name="digits_optax",
    )
