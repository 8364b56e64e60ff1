"""Shared, fault-free scaffolding for the Equinox fault programs (``STYLE = "equinox"``).

Equinox models are called on one example; the batch is ``jax.vmap``-ed over them. Steps are written as
Equinox's own examples write them: ``eqx.filter_jit``, ``eqx.filter_value_and_grad``, the optimizer state
built from ``eqx.filter(model, eqx.is_array)``. Nothing here is faulty: each program keeps its bug
(marked ``# FAULT``) in its own file.
"""

from __future__ import annotations

import equinox as eqx
import jax

from benchmarks.faults._common import xent

__all__ = ["batched", "classify_loss", "eqx_step", "init_opt"]


def batched(model, x):
    """The model's outputs for a batch (the model takes one example)."""
    return jax.vmap(model)(x)


def classify_loss(model, batch):
    return xent(batched(model, batch["x"]), batch["y"])


def init_opt(model, tx):
    return tx.init(eqx.filter(model, eqx.is_array))


def eqx_step(loss, tx):
    """A healthy ``eqx.filter_jit`` step for ``loss(model, batch)``: state = (model, opt_state)."""

    @eqx.filter_jit
    def step(state, batch):
        model, opt_state = state
        value, grads = eqx.filter_value_and_grad(loss)(model, batch)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return (eqx.apply_updates(model, updates), opt_state), {"loss": value}

    return step
