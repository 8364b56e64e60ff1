"""Correct: a VAE on the digits (Bernoulli pixels, Gaussian latent, ELBO = reconstruction + KL).

The batch has no labels and its loss has a floor well above 0 (the KL term and the pixels' own
entropy): ``init.loss`` must not compare it with ln(784)-like "chance", and the overfit stage must
judge the floor, not a fixed fraction of the start.
"""

import jax
import jax.numpy as jnp
import optax

import jaxsane
from benchmarks.faults._common import dense_params, digits, mlp_apply

EXPECTED = []
STYLE = "optax"
STAGES = ["data", "init", "grads", "step", "batch", "overfit", "run"]
OPTIONS = {"run_steps": 30, "overfit_steps": 150}
LATENT = 8
tx = optax.adam(3e-3)


def encode(params, x):
    h = mlp_apply(params["enc"], x)
    return h[:, :LATENT], h[:, LATENT:]              # mean, log-variance


def decode(params, z):
    return mlp_apply(params["dec"], z)               # pixel logits


def kl_divergence(mean, logvar):
    return -0.5 * jnp.sum(1 + logvar - mean ** 2 - jnp.exp(logvar), axis=-1)


def elbo_loss(params, batch, key):
    x = batch["x"]                                    # pixels in [0, 1]: Bernoulli targets
    mean, logvar = encode(params, x)
    eps = jax.random.normal(key, mean.shape)          # the reparameterisation trick
    z = mean + jnp.exp(0.5 * logvar) * eps
    logits = decode(params, z)
    recon = optax.sigmoid_binary_cross_entropy(logits, x).sum(-1)
    return jnp.mean(recon + kl_divergence(mean, logvar))


def loss(params, batch):
    """The ELBO at one fixed noise draw: a deterministic handle for jaxsane's checks."""
    return elbo_loss(params, batch, jax.random.key(0))


@jax.jit
def train_step(state, batch):
    params, opt_state, key = state
    key, noise_key = jax.random.split(key)           # fresh noise every step
    value, grads = jax.value_and_grad(elbo_loss)(params, batch, noise_key)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state, key), {"loss": value}


def apply(params, x):
    mean, _ = encode(params, x)
    return decode(params, mean)


def init(key):
    k1, k2 = jax.random.split(key)
    params = {"enc": dense_params(k1, (64, 64, 2 * LATENT)), "dec": dense_params(k2, (LATENT, 64, 64))}
    return params, tx.init(params), jax.random.fold_in(key, 1)


def experiment():
    train, eval_ = digits()
    strip = lambda b: {"x": b["x"]}  # an autoencoder's batch: images only
    return jaxsane.Experiment(init=init, step=train_step, train=lambda: (strip(b) for b in train),
                              eval=strip(eval_), loss=loss, apply=apply, name="c41_healthy_vae")
