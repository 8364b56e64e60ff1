"""The overfit sweep's program: many configurations of one step, vmapped (``sweep.py`` runs it,
``sweep_compile.py`` compiles it).

Every configuration is one slice of a ``jax.vmap``-ed train state. The steps run in a ``lax.scan`` of ``chunk``
steps inside a ``lax.while_loop`` that exits once every real configuration has reached the target, so the sweep
needs no host round trip between steps. The loop's carry is both the program's input and its output, which makes
the program resumable (see :class:`GroupLayout`). :func:`sweep_program` and the functions it calls are jit-safe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core.tree import PyTree


class Carry(NamedTuple):
    """The ``while_loop`` carry of one group, also the program's input and output. Its leaves are jax arrays
    in the program, numpy arrays when a run starts on the host, ``jax.ShapeDtypeStruct`` when compiling."""

    chunks: Any  # int32 []: chunks run so far
    states: PyTree  # [size, ...] train states
    losses: Any  # float32 [size, total]; NaN where not run yet
    accuracy: Any  # float32 [size]: per-example accuracy after the last chunk (0 when unmeasured)
    reached_at: Any  # int32 [size]: first step that met the target, -1 when never


@dataclasses.dataclass
class TraceCount:
    """How many times the sweep program was traced, i.e. compiled (a Python side effect of tracing it)."""

    count: int = 0


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """Which configuration sits in which slot of which group.

    ``slots[g, j]`` is a configuration index; ``padding[g, j]`` marks slots that repeat one of the
    group's configurations only to give every group the same size (their results are dropped).
    """

    slots: np.ndarray  # int [groups, size]
    padding: np.ndarray  # bool [groups, size]
    parallel: int = 0  # groups that run at once (0: all); fewer when their states would not fit in memory together

    @property
    def groups(self) -> int:
        return self.slots.shape[0]

    @property
    def size(self) -> int:
        return self.slots.shape[1]

    def first_slot(self, config: int) -> tuple[int, int]:
        """``(group, slot)`` holding ``config`` (not a padding slot)."""
        g, j = np.argwhere((self.slots == config) & ~self.padding)[0]
        return int(g), int(j)


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    """What one step of one configuration is and when it has fit. ``step`` is
    ``(state, batch) -> (state, loss)``; ``prepare`` is ``(state, lr, scale) -> state`` (lr NaN: keep the
    state's rate), or None when the states come prepared; ``accuracy`` is ``(state, batch) -> accuracy``
    or None. All jit-safe. ``target_accuracy`` is the one asked for; the program takes the one it uses as an
    argument (above 1 when apply's accuracy cannot judge the fit, which may be found while it compiles)."""

    step: Callable[[PyTree, PyTree], tuple[PyTree, jax.Array]]
    prepare: Callable[[PyTree, jax.Array, jax.Array], PyTree] | None
    accuracy: Callable[[PyTree, PyTree], jax.Array] | None
    chunk: int
    n_chunks: int
    target: float
    target_accuracy: float
    first_fit_ends: bool = False
    """End the sweep once any real configuration has fit, not every one (a sweep that asks only whether some
    configuration fits: the scaled-update rescue of ``update_scale.py``). Its groups then run one after another,
    each no longer than the earliest fit so far, and every curve is cut at the earliest fit."""


def per_configuration(fn: Callable) -> Callable:
    """``jax.vmap(fn)`` over the configurations stacked on every argument's leading axis, except that a single
    configuration (a large model's sweep, or one run in memory-sized turns of one state) runs ``fn`` on it
    unbatched: a vmap over one slot still batches every matrix product, which XLA:CPU compiles about 15% longer
    and runs about 15% slower (a 1M-parameter LM's sweep step: 3.6 against 3.1 s of compile, 28 against 24 ms a
    step). Same results up to the last bits of fused floats. Jit-safe."""
    batched = jax.vmap(fn)

    def call(*args: Any) -> Any:
        leaves = jax.tree_util.tree_leaves(args)
        if not leaves or np.shape(leaves[0])[:1] != (1,):
            return batched(*args)
        one = jax.tree_util.tree_map(lambda x: x[0], args)
        return jax.tree_util.tree_map(lambda x: jnp.expand_dims(x, 0), fn(*one))

    return call


def sweep_program(spec: SweepSpec, traces: TraceCount) -> Callable:
    """The program of one group: ``run(carry, batches, lrs, scales, real, limit, early_exit, target_accuracy)
    -> carry``.

    Runs chunks until ``limit`` chunks have run or, when ``early_exit``, every ``real`` slot has reached
    the target. ``traces`` counts traces (one per compile). Jit-safe (it is what gets jitted).
    """
    vstep = per_configuration(spec.step)

    def run(carry: Carry, batches, lrs, scales, real, limit, early_exit, target_accuracy) -> Carry:
        traces.count += 1  # a Python side effect: counts traces, i.e. compiles of the sweep
        carry = prepare_carry(spec, carry, lrs, scales)

        def cond(c: Carry):
            return (c.chunks < limit) & ~(early_exit & done(spec, c, real))

        def body(c: Carry) -> Carry:
            states, chunk_losses = lax.scan(lambda s, _: vstep(s, batches), c.states, None, length=spec.chunk)
            return record_chunk(spec, c, states, chunk_losses, batches, target_accuracy)

        return lax.while_loop(cond, body, carry)

    return run


def prepare_carry(spec: SweepSpec, carry: Carry, lrs: Any, scales: Any) -> Carry:
    """The carry with each configuration's learning rate and init scale set (a first run). Jit-safe."""
    if spec.prepare is None:
        return carry
    return carry._replace(states=per_configuration(spec.prepare)(carry.states, lrs, scales))


def done(spec: SweepSpec, c: Carry, real: Any) -> jax.Array:
    """Whether the group may stop early: every real configuration has reached the target (any one, with
    ``spec.first_fit_ends``). Jit-safe."""
    if spec.first_fit_ends:
        return jnp.any((c.reached_at >= 0) & real)
    return jnp.all((c.reached_at >= 0) | ~real)


def record_chunk(
    spec: SweepSpec, c: Carry, states: PyTree, chunk_losses: Any, batches: PyTree, target_accuracy: Any
) -> Carry:
    """The carry after one chunk: its states, its losses (``[chunk, size]``) written in, and the step at which
    each configuration first met the loss (or accuracy) target. Jit-safe."""
    i, chunk = c.chunks, spec.chunk
    chunk_losses = chunk_losses.T  # [size, chunk]
    losses = lax.dynamic_update_slice(c.losses, chunk_losses, (0, i * chunk))
    # a ratio target needs a positive start: a loss at or below 0 never "fits" by ratio
    hit = (chunk_losses <= (spec.target * losses[:, 0])[:, None]) & (losses[:, 0] > 0)[:, None]
    first = jnp.where(jnp.any(hit, axis=1), i * chunk + jnp.argmax(hit, axis=1), -1).astype(jnp.int32)
    acc = c.accuracy
    if spec.accuracy is not None:
        acc = per_configuration(spec.accuracy)(states, batches)
        first = jnp.where((first < 0) & (acc >= target_accuracy), (i + 1) * chunk - 1, first)
    reached_at = jnp.where(c.reached_at >= 0, c.reached_at, first)
    return Carry(i + 1, states, losses, acc, reached_at)
