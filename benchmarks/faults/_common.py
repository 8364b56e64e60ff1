"""Shared, fault-free scaffolding for the fault programs: data and healthy boilerplate.

Nothing here is faulty: every program keeps its own bug (marked ``# FAULT``) in its own file, so
that a finding's file:line can be compared with the marked line.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxsane.examples._digits import NUM_CLASSES, Batches, load_digits_split

__all__ = ["NUM_CLASSES", "digits", "dense_params", "mlp_apply", "gelu_mlp_apply", "message_passing", "xent",
           "optax_step"]


def digits(batch_size: int = 64, eval_size: int = 256, scale: float = 1.0):
    """(train, eval): a deterministic infinite stream of {"x", "y"} digits batches and one eval batch."""
    x, y, xe, ye = load_digits_split()
    return Batches(x * scale, y, batch_size), {"x": xe[:eval_size] * scale, "y": ye[:eval_size]}


def dense_params(key, sizes, scale=None):
    """He-initialised MLP params [{"w", "b"}, ...] (``scale`` overrides the std)."""
    params = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:]):
        key, sub = jax.random.split(key)
        std = jnp.sqrt(2.0 / n_in) if scale is None else scale
        params.append({"w": jax.random.normal(sub, (n_in, n_out)) * std, "b": jnp.zeros(n_out)})
    return params


def mlp_apply(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def optax_step(loss, tx):
    """A healthy jitted pure-optax step for ``loss(params, batch)``: state = (params, opt_state)."""

    @jax.jit
    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    return step


def sequences(batch_size: int = 32, seed: int = 0, all_padding_every: int = 0):
    """Digits as sequences of 8 rows (8 features each) with a right-padding mask of random length.

    ``all_padding_every=k`` makes every k-th example entirely padding (length 0).
    """
    x, y, xe, ye = load_digits_split()

    class Stream:
        def __iter__(self):
            rng = np.random.default_rng(seed)
            start = 0
            while True:
                if start + batch_size > len(x):
                    start = 0
                xs = x[start:start + batch_size].reshape(-1, 8, 8)
                lengths = rng.integers(4, 9, size=batch_size)
                if all_padding_every:
                    lengths[::all_padding_every] = 0
                mask = (np.arange(8)[None, :] < lengths[:, None]).astype(np.float32)
                yield {"x": xs * mask[..., None], "y": y[start:start + batch_size], "mask": mask}
                start += batch_size

    return Stream()


def gelu_mlp_apply(params, x):
    """:func:`mlp_apply` with GELU: smooth where all-zero rows (a graph batch's padding nodes) put a ReLU on its kink."""
    for layer in params[:-1]:
        x = jax.nn.gelu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def message_passing(layers, graph, max_degree, act=jax.nn.gelu, h=None):
    """Node states after sum message passing over a jraph-style graph dict (``act``, GELU by default; messages /
    ``max_degree``), from ``h`` (default the node features)."""
    h = graph["nodes"] if h is None else h
    for layer in layers:
        messages = jax.ops.segment_sum(h[graph["senders"]] * graph["edges"], graph["receivers"], h.shape[0])
        h = act(jnp.concatenate([h, messages / max_degree], -1) @ layer["w"] + layer["b"])
    return h
