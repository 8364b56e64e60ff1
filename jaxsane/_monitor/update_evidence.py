"""What a run's update telemetry says about the optimizer, beyond the loss: leaves the optimizer holds still
though they have gradients (a frozen backbone), and updates still growing at the end of a run (a learning-rate
warmup). :func:`~jaxsane.check_training` reads them so that a deliberate setup is not called a fault. Host-side
numpy on a :class:`~jaxsane.History`; not jit-safe.
"""

from __future__ import annotations

import numpy as np

from .._core.history import History

WARMUP_GROWTH = 1.4
"""Updates whose size grew by at least this factor from the middle of a run to its end are still warming up: a
linear warmup grows them 1.5x from step 16 to 24 and 2x from 15 to 30, while momentum building up (SGD, beta 0.9)
grows them 1.13x from step 16 to 24, and Adam's bias-corrected steps not at all."""


def held_leaves(h: History, leaves: list[int]) -> list[int]:
    """Those of ``leaves`` (indices into the telemetry's columns) whose update was exactly zero on every sampled
    step while their gradient was not: the optimizer leaves them where they are on purpose (``optax.set_to_zero``
    in a ``multi_transform``, ``optax.masked``, ``nnx.Optimizer(wrt=...)``), unlike a parameter cut off from the
    loss (``stop_gradient``), whose gradient is zero too, and a bf16/fp16 leaf whose updates round away
    (``update_lost``: ``train.update_underflow``'s). Needs the gradient sampled on the update's steps; empty
    otherwise."""
    u, g = h.arrays("update_norm"), h.arrays("grad_norm")
    if not leaves or u.size == 0 or g.size == 0 or g.shape[1] != u.shape[1]:
        return []
    row = {step: i for i, step in enumerate(h.grad_steps or [])}
    both = [(i, row[s]) for i, s in enumerate(h.tele_steps) if s in row]
    if not both:
        return []
    u, g = u[[i for i, _ in both]], g[[j for _, j in both]]
    lost = h.arrays("update_lost")  # bf16/fp16 leaves whose updates round away also stand still: not held
    rounded = set(np.flatnonzero(np.nan_to_num(lost).max(axis=0) > 0)) if lost.shape[1:] == u.shape[1:] else set()
    return [
        j
        for j in leaves
        if j not in rounded and np.all(u[:, j] == 0) and np.all(np.isfinite(g[:, j])) and np.all(g[:, j] > 0)
    ]


def gradless_leaves(h: History, leaves: list[int]) -> list[int]:
    """Those of ``leaves`` (indices into the telemetry's columns) whose gradient was exactly zero on every sampled
    step: the loss does not depend on them (an output computed and never used, a ``stop_gradient``), so no
    learning rate moves them. Empty without gradient telemetry."""
    u, g = h.arrays("update_norm"), h.arrays("grad_norm")
    if not leaves or g.size == 0 or g.shape[1] != u.shape[1]:
        return []
    return [j for j in leaves if np.all(g[:, j] == 0)]


def warmup_growth(h: History) -> float | None:
    """How much the update's size grew from the sample nearest the middle of the run to its last sample, when that
    is at least :data:`WARMUP_GROWTH` (the optimizer is still warming up its steps at the end of the run); None
    otherwise, or without update telemetry on at least three steps that moved a weight."""
    u = h.arrays("update_norm")
    if u.size == 0 or len(h.tele_steps) != len(u):
        return None
    idx = h.weight_leaves or list(range(u.shape[1]))
    size = np.sqrt(np.nansum(u[:, idx] ** 2, axis=1))
    steps = np.asarray(h.tele_steps, dtype=np.float64)
    moved = size > 0
    steps, size = steps[moved], size[moved]
    if size.size < 3:
        return None
    middle = int(np.argmin(np.abs(steps - (steps[0] + steps[-1]) / 2)))
    if middle == size.size - 1:
        return None
    growth = float(size[-1] / size[middle])
    return growth if growth >= WARMUP_GROWTH else None
