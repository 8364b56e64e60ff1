"""Kinks in the gradient check: a point where the function is not differentiable is not a wrong derivative.

:func:`jaxsane.check_grads` compares autodiff with central differences along a random direction
``d``. At a kink *at the point* (a ReLU, ``abs``, ``clip`` or ``max`` tie exactly at the evaluation
point: zero-filled padding or zero-feature rows through a zero-initialised bias, ``max`` over equal
values) the central quotient is the average of the two one-sided slopes, autodiff returns one
side (``relu'(0) = 0``) or a mix of them, and no smaller step closes the gap.

Rule. With ``g(t) = f(leaf + t d)``, the one-sided quotients are ``R(h) = (g(h) - g(0)) / h`` and
``L(h) = (g(0) - g(-h)) / h``. ``g`` has a *kink along d* when ``|R(h) - L(h)| > atol +
kink_rtol * max(|R|, |L|, |autodiff|)`` plus twice a quotient's round-off (:func:`quotient_round_off`) at both
the largest and the smallest step of the ladder (a jump that does not shrink with the step: curvature makes
``R - L = h g''`` shrink, round-off grows as the step shrinks, so neither passes at both ends; a jump that grows
by more than ``1 / KEEPS`` from the largest step to the smallest is round-off too: a float32 VAE's loss of 550, a
sum over its pixels, carried jumps of 0.55 at a step of 1e-3 and 10.4 at 1e-4, and 11 of its leaves were
"kinks"). A wrong derivative on a differentiable path has ``R ≈ L`` and both disagree with autodiff: it
stays a ``grad.mismatch``.

Where ``d`` crosses a kink, the leaf's coordinates are split at random into at most
:data:`KINK_BLOCKS` blocks and each block's sub-direction ``d_b`` (``d`` on the block, 0 elsewhere)
is probed the same way at both steps, against the autodiff derivative ``grad . d_b``:

* smooth at both steps and central differences disagree with autodiff at both (tolerance
  ``atol + rtol * max(|autodiff|, |central|)``): a wrong derivative, reported as ``grad.mismatch``
  on that sub-direction;
* a kink at both steps: not judged (autodiff between the one-sided slopes is counted as
  *consistent*; outside them it may still be a legitimate choice of subgradient, e.g. relu(x) - relu(-x));
* otherwise (smooth and agreeing, or mixed between the steps): agrees / not judged.

The probe stops at the first wrong sub-direction, or when the first :data:`KINK_SETTLE` all sit on the kink.
A leaf without a wrong sub-direction is reported in one ``grad.kink`` (info) finding, never as an
error: at a kink the check cannot tell a wrong rule from a choice of one-sided derivative. Host-side numpy,
not jit-safe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._core.finding import Finding

KINK_BLOCKS = 32  # sub-directions probed per kinked leaf (4 evaluations each)
KINK_SETTLE = 6
"""Probing a leaf stops when its first this many sub-directions all sit on the kink: the kink then runs through
most of its coordinates (a conv kernel or a BatchNorm scale feeds every position, zero-padded borders included),
the other sub-directions would sit on it too, and there is nothing off it to judge. A healthy NNX ResNet's
float64 check probed 8 such leaves in 32 sub-directions each, 1024 evaluations of its loss: 176 s of its
gradient check. Where the kink holds a few coordinates (the ones a wrong rule beside it can be told on), the
first sub-directions are mostly off it and the probe goes on."""
KEEPS = 0.3  # a kink at the point keeps its jump within this factor (either way) from the largest step to the smallest


ROUNDING_ULPS = 4.0
"""Rounding error of one evaluation of the loss, in units of its dtype's epsilon times its size: a quotient with
step ``h`` carries about ``ROUNDING_ULPS * eps * |g| / h`` of round-off."""


def one_sided(g: Callable[[float], float], h: float) -> tuple[float, float]:
    """``(R, L)``: the right and left difference quotients of ``g`` at 0 with step ``h``."""
    g0 = float(g(0.0))
    return (float(g(h)) - g0) / h, (g0 - float(g(-h))) / h


def quotient_round_off(g: Callable[[Any], Any], h: float, dtype: Any) -> float:
    """The round-off of one difference quotient of ``g`` with step ``h``: ``ROUNDING_ULPS * eps * max|g| / h``
    over ``g(0), g(h), g(-h)``, with ``dtype``'s epsilon (1e-16 for a dtype that is not a float). Host-side."""
    machine = float(np.finfo(np.dtype(dtype)).eps) if np.issubdtype(np.dtype(dtype), np.floating) else 1e-16
    size = max(abs(float(np.sum(g(np.asarray(t, dtype))))) for t in (0.0, h, -h))
    return ROUNDING_ULPS * machine * size / h


def jumps(right: float, left: float, autodiff: float, atol: float, kink_rtol: float) -> bool:
    """Whether the one-sided slopes differ by more than ``atol + kink_rtol * scale`` (the scale of the slopes)."""
    scale = max(abs(right), abs(left), abs(autodiff))
    return abs(right - left) > atol + kink_rtol * scale


def disagrees(autodiff: float, central: float, atol: float, rtol: float) -> bool:
    return abs(autodiff - central) > atol + rtol * max(abs(autodiff), abs(central))


def brackets(autodiff: float, right: float, left: float, atol: float, rtol: float) -> bool:
    """Whether ``autodiff`` lies between the one-sided slopes (within the comparison tolerance)."""
    tol = atol + rtol * max(abs(right), abs(left), abs(autodiff))
    return min(right, left) - tol <= autodiff <= max(right, left) + tol


def kink_at_every_step(
    g: Callable[[float], float], steps: Sequence[float], autodiff: float, atol: float, kink_rtol: float
) -> tuple[bool, float, float]:
    """``(kinked, R, L)``: whether the one-sided slopes jump at every step beyond their round-off and by about as
    much (the jump at the smallest step within a factor :data:`KEEPS` of the largest one's, either way: kinks
    *crossed* by the step, many of them in a float32 check's large steps, make a jump that shrinks with the step,
    round-off one that grows as ``1 / h``; a kink *at* the point makes the same jump at every step), and ``R, L``
    at the smallest."""
    kinked, right, left, sizes = True, 0.0, 0.0, []
    dtype = np.asarray(g(0.0)).dtype  # the loss's own precision
    for h in steps:
        right, left = one_sided(g, h)
        kinked = kinked and jumps(right, left, autodiff, atol + 2.0 * quotient_round_off(g, h, dtype), kink_rtol)
        sizes.append(abs(right - left))
    return kinked and KEEPS * sizes[0] <= sizes[-1] <= sizes[0] / KEEPS, right, left


@dataclasses.dataclass(frozen=True)
class KinkVerdict:
    """What probing the sub-directions of a kinked leaf found (see the module docstring)."""

    right: float  # one-sided slopes along the whole direction (smallest step)
    left: float
    blocks: int  # sub-directions probed (fewer than split once settled: KINK_SETTLE)
    agree: int = 0  # smooth and agreeing with autodiff
    kinked: int = 0  # on a kink at both steps (not judged)
    consistent: int = 0  # ... of which autodiff lies between the one-sided slopes
    wrong: dict | None = None  # the first smooth sub-direction where autodiff disagrees at both steps

    def summary(self) -> str:
        return (
            f"one-sided slopes {self.right:.6g} (right) vs {self.left:.6g} (left); of {self.blocks} "
            f"sub-direction(s), {self.agree} off the kink agree with finite differences and {self.kinked} "
            f"sit on it ({self.consistent} with autodiff between the one-sided slopes)"
        )


def probe_sub_directions(
    value_along: Callable[[np.ndarray, float], np.ndarray | float],
    grad: np.ndarray,
    direction: np.ndarray,
    rng: np.random.Generator,
    steps: Sequence[float],
    right: float,
    left: float,
    atol: float,
    rtol: float,
    kink_rtol: float,
    blocks: int = KINK_BLOCKS,
    machine_eps: float = 0.0,
) -> KinkVerdict:
    """Probe ``direction`` block by block; ``value_along(sub, t)`` is ``f(leaf + t * sub)``. A sub-direction
    disagrees only by more than twice its central quotient's round-off (``ROUNDING_ULPS * machine_eps * |f| / h``:
    a loss of 3e9, an unnormalised regression's, carries 0.5 of it at ``h = 1e-6`` in float64)."""
    d = np.asarray(direction).ravel()
    gflat = np.asarray(grad).ravel()
    groups = np.array_split(rng.permutation(d.size), min(blocks, d.size))
    agree = kinked = consistent = probed = 0
    wrong = None
    for b, index in enumerate(groups):
        if wrong is not None or (probed == kinked >= KINK_SETTLE):
            break  # settled: a wrong sub-direction found, or the kink runs through the whole leaf
        probed += 1
        sub = np.zeros_like(d)
        sub[index] = d[index]
        ad = float(np.vdot(gflat, sub))
        shaped = sub.reshape(np.shape(direction))
        cache: dict[float, float] = {}

        def g(t, shaped=shaped, cache=cache):
            if t not in cache:
                cache[t] = float(value_along(shaped, t))
            return cache[t]

        slopes = [one_sided(g, h) for h in steps]
        kinks = [jumps(right_h, left_h, ad, atol, kink_rtol) for right_h, left_h in slopes]
        if all(kinks):
            kinked += 1
            consistent += all(brackets(ad, right_h, left_h, atol, rtol) for right_h, left_h in slopes)
            continue
        if not any(kinks):
            centrals = [(right_h + left_h) / 2 for right_h, left_h in slopes]
            noise = [ROUNDING_ULPS * machine_eps * max(abs(g(0.0)), abs(g(h)), abs(g(-h))) / h for h in steps]
            if all(disagrees(ad, c, atol + 2.0 * e, rtol) for c, e in zip(centrals, noise)):
                if wrong is None:
                    fd = min(centrals, key=lambda c: abs(c - ad))
                    wrong = {"block": b, "coordinates": int(index.size), "autodiff": ad, "finite_diff": fd}
                continue
            agree += 1
    return KinkVerdict(right, left, probed, agree, kinked, consistent, wrong)


def kink_finding(items: Sequence[tuple[str, KinkVerdict]]) -> Finding:
    """One ``grad.kink`` (info) naming the leaves not judged because the point is a kink along their direction."""
    shown = "; ".join(f"{path}: {v.summary()}" for path, v in items[:3])
    more = f"; and {len(items) - 3} more" if len(items) > 3 else ""
    return Finding(
        "grad.kink",
        f"{len(items)} leaf(s) not judged by the gradient check: the function has a kink at the check point along "
        f"the probed direction (the one-sided difference quotients differ, so the central difference is their "
        f"average while autodiff returns one side or a mix, at any step), and no sub-direction off the kink "
        f"disagrees with autodiff: {shown}{more}",
        "not an error: a ReLU/abs/clip/max exactly at 0 or at a tie at this point (zero-filled padding or "
        "zero-feature rows through a zero-initialised bias, max over equal values). To judge these leaves, check "
        "at a point off the kink (e.g. the parameters after a training step); kinks=False reports every "
        "disagreement as grad.mismatch",
        path=items[0][0],
        extra={"leaves": [path for path, _ in items], "kinks": {path: dataclasses.asdict(v) for path, v in items}},
    )
