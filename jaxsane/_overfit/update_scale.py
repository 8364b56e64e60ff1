"""Sweeping a learning rate the optimizer does not expose: scale the step's parameter update instead.

Without ``optax.inject_hyperparams`` the sweep cannot set the rate, and a step whose own rate is tiny (plain
SGD at 1e-4, the first steps of a long warmup) barely moves the loss on the overfit batch: that says
nothing about the model. For SGD, momentum, Adam, AdamW and most optax chains the learning rate is the last
factor of the update, so scaling the update ``new_params - params`` by ``k`` is training at ``k`` times
the rate. :class:`UpdateScaled` does that to the user's step (any style, any optimizer, through
:class:`~jaxsane.PureExperiment`), with ``k`` a leaf of the sweep's state, so the sweep sets it per
configuration as it sets an injected rate. :func:`with_scaled_updates` runs such a second sweep when the
step's own rate fits nothing, and keeps the verdict honest: a fit at a scaled rate is no error, and when
even updates scaled by 1000 hardly move the loss (the scaling assumption may not hold for this optimizer)
the overfit is not judged (``doctor.skipped``), never an error.

:meth:`UpdateScaled.step` is jit-safe; the rest runs on the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._core.finding import Finding
from .._core.tree import PyTree, is_inexact
from .._experiment.contract import PureExperiment
from .result import OverfitResult

UPDATE_SCALES = (1000.0, 100.0, 10.0)
"""The factors a second sweep multiplies the step's updates by (the step's own rate was tried first), the largest
first: the likeliest to fit, and that sweep ends at its first fit."""
BASELINE_SCALE = 100.0
"""The factor of the constant-input baseline of that sweep."""
MOVED = 0.01
"""A loss that never came this fraction of its start away from it was not moved by the updates: a rate too
small to judge the model with (a model that cannot fit, one that ignores its input, still moves its loss
this much towards the labels' own entropy once the rate is large enough)."""
FITTING = ("fits", "floor")
RESCUABLE = ("fails", "unsettled", "high_floor")
"""Verdicts a larger rate may turn into a fit; a diverged or unbounded curve is not a too-small rate."""


class UpdateScaled(PureExperiment):
    """``adapted`` whose state is ``(state, {"hyperparams": {"learning_rate": k}})`` and whose step moves
    the parameters by ``k`` times the user's step's update: ``params + k * (new_params - params)`` on the
    float leaves (the rest of the new state, optimizer state and statistics included, is the step's own).
    The scale sits where :func:`~jaxsane._overfit.setup.learning_rate_paths` finds an injected rate, so the
    sweep sets it per configuration. Everything else is ``adapted``'s."""

    def __init__(self, adapted: PureExperiment, baseline_scale: float = BASELINE_SCALE):  # noqa: D107
        # no PureExperiment.__init__: this view runs no init of its own; other attributes are adapted's
        self.inner = adapted
        self.experiment = adapted.experiment
        self._scale = np.float32(baseline_scale)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copy/pickle): never recurse
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _with_scale(self, state: PyTree) -> PyTree:
        return (state, {"hyperparams": {"learning_rate": self._scale}})

    @property
    def example_state(self) -> PyTree:
        return self._with_scale(self.inner.example_state)

    def init(self, key: jax.Array) -> PyTree:
        return self._with_scale(self.inner.init(key))

    def params(self, state: PyTree) -> PyTree:
        return self.inner.params(state[0])

    def with_params(self, state: PyTree, params: PyTree) -> PyTree:
        return (self.inner.with_params(state[0], params), state[1])

    def user_state(self, state: PyTree) -> Any:
        return self.inner.user_state(state[0])

    def step(self, state: PyTree, batch: PyTree) -> tuple[PyTree, dict[str, Any]]:
        """The user's step with its parameter update scaled by the state's factor. Jit-safe."""
        inner, extra = state
        scale = extra["hyperparams"]["learning_rate"]
        # the values now: NNX states hold Variables that the step updates in place
        before = jax.tree_util.tree_map(lambda x: x, self.inner.params(inner))
        new, metrics = self.inner.step(inner, batch)
        after = self.inner.params(new)

        def scaled(p0: Any, p1: Any) -> Any:
            if not is_inexact(p1):
                return p1
            return (p0 + scale.astype(p0.dtype) * (p1 - p0)).astype(p1.dtype)

        # leaf by leaf under the new parameters' structure (an Equinox field the step changes rides in it)
        leaves, treedef = jax.tree_util.tree_flatten(after)
        moved = [scaled(p0, p1) for p0, p1 in zip(jax.tree_util.tree_leaves(before), leaves)]
        return (self.inner.with_params(new, jax.tree_util.tree_unflatten(treedef, moved)), extra), metrics

    @property
    def loss_fn(self) -> Callable | None:
        return self.inner.loss_fn

    @property
    def apply_fn(self) -> Callable | None:
        return self.inner.apply_fn

    def jitted(self, name: str) -> Any:
        return self.inner.jitted(name) if name != "step" else super().jitted(name)


def _moved(result: OverfitResult) -> bool:
    """Whether a real configuration's updates acted on the loss: it went non-finite, or some step's loss is
    at least :data:`MOVED` of its start away from it (up or down). Not jit-safe."""
    for i in result.real:
        curve = np.asarray(result.losses[i], np.float64)
        if not np.all(np.isfinite(curve)):
            return True
        if np.max(np.abs(curve - curve[0])) >= MOVED * max(abs(curve[0]), 1e-12):
            return True
    return False


def _fits(result: OverfitResult) -> bool:
    return any(result.verdicts[i] in FITTING for i in result.real)


def needs_scaled_updates(result: OverfitResult) -> bool:
    """Whether a sweep at the step's own rate (no injectable rate) should be tried again with scaled updates:
    no real configuration fits, the loss moved at all (a step that never changes the model is broken at any
    rate), and the best curve is one a larger rate may fix. Not jit-safe."""
    if not len(result.real) or _fits(result) or result.time_cut is not None:  # (cut short: no time left either)
        return False
    losses = result.losses[result.real]
    if np.all(losses == losses[:, :1]):  # the step never changes the model: no scale of a zero update helps
        return False
    return result.verdicts[result.best] in RESCUABLE


def with_scaled_updates(first: OverfitResult, rerun: Callable[[], OverfitResult]) -> OverfitResult:
    """The verdict of a sweep whose rate could not be set: ``first`` (at the step's own rate) when it fits or
    cannot be rescued by a larger rate, else judged with ``rerun()`` (the same sweep, updates scaled by
    :data:`UPDATE_SCALES`, the largest first; that sweep ends at its first fit). Not jit-safe.

    * the scaled sweep fits: its result, with an ``overfit.update_scaled`` info finding and no error;
    * it does not, and its updates moved the loss: the errors stand (those of the sweep that moved the
      loss: the first one, unless its loss hardly moved);
    * even updates scaled by 1000 hardly moved the loss: ``doctor.skipped`` in place of the errors.
    """
    if not needs_scaled_updates(first):
        return first
    second = rerun()
    own = first.configs[first.best]
    scales = ", ".join(f"{k:g}" for k in sorted(UPDATE_SCALES))
    start, end = first.losses[first.best, 0], first.losses[first.best, -1]
    own_curve = f"the step's own rate took the loss from {start:.4g} to {end:.4g}"
    setup = [f for f in first.findings if f.severity == "info" and f.code not in ("overfit.best", "overfit.floor")]
    if _fits(second):
        best = second.configs[second.best]
        note = Finding(
            "overfit.update_scaled",
            f"{own_curve} in {first.steps_run} steps without fitting (seed {own.seed}); with its parameter "
            f"updates scaled by {best.update_scale:g} (as a {best.update_scale:g}x learning rate for SGD, momentum, "
            "Adam and most optax chains) the model fits the batch at step "
            f"{int(second.reached_at[second.best])} (the largest factors first; the sweep ends at the first fit): the "
            "model learns, the rate is small for this test",
            "nothing to fix if the rate is deliberate (a long warmup, a fine-tuning rate); to let the sweep set "
            "rates itself, build the optimizer with optax.inject_hyperparams",
            extra={"update_scale": best.update_scale, "own_final": float(first.losses[first.best, -1])},
        )
        return dataclasses.replace(second, findings=(*setup, note, *second.findings))
    if not _moved(second):
        skipped = Finding(
            "doctor.skipped",
            f"overfit not judged: {own_curve} and updates scaled by {scales} hardly moved it either; the "
            "optimizer's rate cannot be set (no optax.inject_hyperparams) and scaling its updates may not "
            "act as a larger rate for it",
            "build the optimizer with optax.inject_hyperparams(...)(learning_rate=...) so the sweep can set "
            "the rate per configuration",
        )
        kept = [f for f in first.findings if f.severity == "info"]
        return dataclasses.replace(first, findings=(*kept, skipped))
    base = first if _moved(first) else second
    note = Finding(
        "overfit.update_scaled",
        f"with the step's updates also scaled by {scales} (as larger learning rates) no configuration fits either",
        "",
    )
    findings = base.findings if base is first else (*setup, *second.findings)
    return dataclasses.replace(base, findings=(*findings, note))
