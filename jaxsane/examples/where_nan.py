"""A planted bug: the ``jnp.where`` double-where trap. The forward pass is finite, the gradient is NaN.

The model adds a "stroke energy" feature, the square root of the summed squared intensity of
the left image border. Many digits leave that border blank, so the sum is exactly 0. The
author guarded the sqrt with ``jnp.where(e > 0, jnp.sqrt(e), 0.0)``: the forward value is fine,
but the derivative of sqrt at 0 is inf, and the where multiplies it by a zero cotangent:
``0 * inf = NaN`` in the backward pass. The fix is the double where:
``jnp.sqrt(jnp.where(e > 0, e, 1.0))`` inside the outer where.
"""

import jax
import jax.numpy as jnp
import optax

import jaxsane

from ._digits import NUM_CLASSES, train_eval
from .digits_optax import init_params

tx = optax.adam(3e-3)


def apply(params, x):
    border = x.reshape(-1, 8, 8)[:, :, 0]
    energy = jnp.sum(border * border * params["gain"], axis=-1, keepdims=True)
    stroke = jnp.where(energy > 0, jnp.sqrt(energy), 0.0)  # BUG: sqrt'(0) = inf, times 0 -> NaN gradient
    h = jnp.concatenate([x, stroke], axis=-1)
    for layer in params["mlp"][:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    return h @ params["mlp"][-1]["w"] + params["mlp"][-1]["b"]


def loss(params, batch):
    return optax.softmax_cross_entropy_with_integer_labels(apply(params, batch["x"]), batch["y"]).mean()


def init(key):
    mlp = init_params(key)
    mlp[0]["w"] = jnp.concatenate([mlp[0]["w"], jnp.zeros((1, mlp[0]["w"].shape[1]))])
    params = {"gain": jnp.ones((8,)), "mlp": mlp}
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
        name="where_nan (planted bug)",
    )
