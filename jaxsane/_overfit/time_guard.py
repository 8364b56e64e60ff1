"""The overfit sweep's time guard: its groups run in slices that end by a deadline (:func:`within`), and a sweep
the deadline will cut stops sooner once its target is out of reach at its pace (:class:`Reach`). Host-side; not
jit-safe.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

Carry = Any  # ``sweep_program.Carry``: a group's loop carry (chunks run, states, losses, accuracy, reached_at)
SweepSpec = Any  # ``sweep_program.SweepSpec``: the step, its chunk and its targets


REACH_MARGIN = 3.0
"""A sweep cut by its time limit stops early when at its latest pace every real configuration would need more
than this many times the steps its time still allows to reach its target (:class:`Reach`)."""
REACH_SLICES = 4  # with a reach test, a slice runs at most this share of the chunks the time left allows


class Reach:
    """Whether a group's run can still reach its target before the deadline, at its latest pace: the steeper of
    the mean loss's fall over its last chunk and over its last two, extrapolated in a straight line to the loss
    target (``spec.target`` x the initial loss), and the accuracy's rise since the last test to the accuracy
    target. Optimistic on purpose: a loss curve that falls ever slower reaches its target later than the line
    says. A 7M-parameter LSTM LM's 2 sequences: 8.3 -> 5.3 in 15 steps, then 0.014 a step (its fit came at
    step 286 of the 65 its time allowed). Only a sweep the deadline will cut anyway asks (:func:`within`), so a
    sweep that runs all its steps is judged as before. Not jit-safe (host numpy)."""

    def __init__(self, spec: SweepSpec, real: np.ndarray, target_accuracy: Callable[[], float]):
        self.spec, self.real, self.target_accuracy = spec, np.asarray(real, bool), target_accuracy
        self.last: tuple[int, np.ndarray] | None = None  # (steps, accuracy) at the last test

    def __call__(self, carry: Carry, chunks_left: int) -> bool:
        """True when no real configuration can reach its target in ``REACH_MARGIN x chunks_left`` chunks."""
        c = self.spec.chunk
        steps = int(carry.chunks) * c
        losses = np.asarray(carry.losses)[self.real, :steps]
        accuracy = np.asarray(carry.accuracy)[self.real]
        last, self.last = self.last, (steps, accuracy)
        if steps < 3 * c or not losses.size:
            return False
        means = losses[:, -3 * c :].reshape(len(losses), 3, c).mean(axis=2)
        pace = np.maximum(means[:, 1] - means[:, 2], (means[:, 0] - means[:, 2]) / 2) / c  # loss per step
        goal = self.spec.target * losses[:, 0]
        with np.errstate(divide="ignore", invalid="ignore"):
            needed = np.where(pace > 0, (means[:, 2] - goal) / pace, np.inf)
            if self.spec.accuracy is not None and last is not None and steps > last[0]:
                rise = (accuracy - last[1]) / (steps - last[0])
                needed = np.minimum(needed, np.where(rise > 0, (self.target_accuracy() - accuracy) / rise, np.inf))
        judged = np.isfinite(losses[:, 0]) & (losses[:, 0] > 0) & (np.asarray(carry.reached_at)[self.real] < 0)
        needed = np.where(judged, needed, 0.0)  # a fit already, or no ratio target (a loss <= 0): within reach
        return bool(np.all(~np.isfinite(means[:, 2]) | (needed > REACH_MARGIN * chunks_left * c)))


def within(
    run: Callable[[Carry | None, int, bool], Carry],
    carry: Carry | None,
    limit: int,
    first: bool,
    deadline: float,
    reach: Callable[[Carry, int], bool] | None = None,
) -> tuple[Carry, str]:
    """``run(carry, limit, prepare)`` up to ``limit`` chunks in slices that end by ``deadline`` (a
    ``time.perf_counter`` time): one chunk, which does not count against the deadline (its one-off costs, the
    program's first run and preparing the states, took 1 s of a 12M-parameter MLP's sweep whose chunks then ran in
    0.08 s), then one more to measure the pace, then as many as that pace fits in the time left. With ``reach``
    (``reach(carry, chunks the time allows) -> bool``, :class:`Reach`) the time left runs in slices of a
    quarter of it, and a run the deadline would cut stops as soon as ``reach`` says its target is out of reach.
    Returns the carry and why it stopped short: ``"time"`` (the deadline), ``"reach"``, or ``""`` (it ran to
    ``limit`` or the program's own early exit). At least one chunk runs, so every group has a curve. Not
    jit-safe."""
    began, done = time.perf_counter(), 0 if carry is None else int(carry.chunks)
    asked = min(limit, done + 1)
    out = run(carry, asked, first)
    deadline += time.perf_counter() - began
    started, base = time.perf_counter(), int(out.chunks)
    while int(out.chunks) == asked < limit:  # the program ran all it was asked: no early exit yet
        now, ran = time.perf_counter(), int(out.chunks) - base
        more = int((deadline - now) // ((now - started) / ran)) if ran else int(now < deadline)
        if more < 1:
            return out, "time"
        left = limit - int(out.chunks)
        if reach is not None and more < left and reach(out, more):  # cut anyway, and no fit before the cut
            return out, "reach"
        asked = int(out.chunks) + min(left, more if reach is None else max(1, more // REACH_SLICES))
        out = run(out, asked, False)
    return out, ""


def cut_note(cut: list[str], steps: int, time_limit: float | None) -> str:
    """The progress line of a sweep whose groups stopped short (``cut``: why each did, :func:`within`)."""
    if "reach" in cut:
        return f"stopped after {steps} steps: at its pace no target was within its time limit's reach"
    return f"stopped at the sweep's time limit ({time_limit or 0:.0f} s) after {steps} steps"
