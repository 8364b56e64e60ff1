"""An fp16 model without loss scaling whose activations overflow.

The MLP runs in float16 on raw 8-bit pixel intensities (0..255, not normalised); its hand-written softmax takes
``exp`` of logits that reach the hundreds, above ln(65504) = 11.1, the fp16 maximum: inf, then inf/inf = NaN
in some rows. In float32 the same program is finite. Fix: compute the softmax in float32 (or use
jax.nn.log_softmax, which subtracts the max) and normalise the inputs (c92).
"""

import jax
import jax.numpy as jnp

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, digits, mlp_apply, optax_step
import optax

EXPECTED = ["precision.overflow"]
STYLE = "optax"
tx = optax.sgd(1e-3)


def loss(params, batch):
    logits = mlp_apply(params, batch["x"].astype(jnp.float16))
    e = jnp.exp(logits)  # FAULT: exp in fp16 of logits above 11.1 overflows
    p = e / e.sum(axis=-1, keepdims=True)
    return -jnp.mean(jnp.log(jnp.take_along_axis(p, batch["y"][:, None], axis=1)))


def init(key):
    params = jax.tree.map(lambda p: p.astype(jnp.float16), dense_params(key, (64, 64, NUM_CLASSES)))
    return params, tx.init(params)


def experiment():
    train, eval_ = digits(scale=16.0)  # raw 8-bit intensities, 0..255
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=train, eval=eval_, loss=loss,
                              num_classes=NUM_CLASSES, name="f92_fp16_overflow")


def check():
    exp = experiment()
    params, _ = exp.init(jax.random.key(0))
    return jaxsane.compare_precision(exp.loss, params, next(iter(exp.train)))
