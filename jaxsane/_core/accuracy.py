"""Classification accuracy of logits against integer labels, scored only where a label is a class.

A position whose label is not a class id of the logits (the ``-100`` that masked-LM and token-classification
losses ignore, any other value outside ``[0, C)``) or whose mask is 0 is no miss: it is not scored. Jit-safe.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def class_accuracy(logits: jax.Array, labels: jax.Array, mask: Any = None) -> jax.Array:
    """The fraction of scored positions whose argmax over the last axis of ``logits`` ``[..., C]`` is the label
    (``labels`` ``[...]``): positions with a label in ``[0, C)`` and, when ``mask`` has the labels' shape, a
    nonzero mask (0 when nothing is scored). Jit-safe."""
    n_classes = logits.shape[-1]
    scored = (labels >= 0) & (labels < n_classes)
    if mask is not None and jnp.shape(mask) == jnp.shape(labels):
        scored = scored & (jnp.asarray(mask) != 0)
    correct = (jnp.argmax(logits, axis=-1) == labels) & scored
    return jnp.sum(correct.astype(jnp.float32)) / jnp.maximum(jnp.sum(scored.astype(jnp.float32)), 1.0)
