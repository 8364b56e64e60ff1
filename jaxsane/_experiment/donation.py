"""A donating step must not delete arrays that others share.

With ``reuse_init=True`` (doctor) :meth:`PureExperiment.init` hands every caller a new tree over the same arrays,
and doctor's background threads read them (the gradient check, the sweep's states) while a stage calls the
user's step. A step jitted with ``donate_argnums`` deletes its inputs: called on those arrays, it deleted them
under the readers (a sharded MLP-Mixer: a segfault in the gradient check, no report at all). So an eager call
whose state holds arrays of the remembered init gets copies of those, until one such call shows that the step
donates nothing (then none are copied again). Host-side; not jit-safe (inside a trace nothing is donated).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax._src import core as jcore

from .._core.tree import PyTree, copy_arrays


class SparingDonation:
    """``step(state, batch)``, called with copies of the shared arrays while the step may donate them."""

    def __init__(self, step: Callable[[PyTree, PyTree], Any], shared: Callable[[], PyTree]):
        self.step, self.shared = step, shared
        self.donates: bool | None = None  # unknown until a call on copies shows it

    def __call__(self, state: PyTree, batch: PyTree) -> Any:
        remembered = self.shared() if self.donates is not False and jcore.trace_state_clean() else None
        if remembered is None:
            return self.step(state, batch)
        ids = {id(x) for x in jax.tree_util.tree_leaves(remembered) if isinstance(x, jax.Array)}
        copies: list[jax.Array] = []

        def spared(x: Any) -> Any:
            if isinstance(x, jax.Array) and id(x) in ids:
                copies.append(copy_arrays(x))
                return copies[-1]
            return x

        out = self.step(jax.tree_util.tree_map(spared, state), batch)
        if copies and self.donates is None:
            self.donates = any(c.is_deleted() for c in copies)
        return out
