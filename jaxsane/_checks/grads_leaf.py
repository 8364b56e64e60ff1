"""One leaf of the gradient check: its autodiff derivative along its direction against central finite
differences down the step ladder, then, for a leaf that fails at every step, the kink test at the point
(``grads_kink``); what each leaf gives is gathered in a :class:`Tally`. Host-side, not jit-safe.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np

from .._core.finding import Finding
from .grads_findings import (
    mismatch_finding,
    missing_finding,
    nonfinite_gradient_finding,
    nonfinite_nearby_finding,
    stopped_gradient_finding,
    zeroed_here_finding,
)
from .grads_kink import (
    KinkVerdict,
    kink_at_every_step,
    kink_finding,
    probe_sub_directions,
    quotient_round_off,
)
from .grads_precision import Tolerance


def directional_quotient(h: Callable, t0: np.ndarray, eps: float) -> float:
    return float((h(t0 + eps) - h(t0 - eps)) / (2 * eps))


@dataclasses.dataclass
class Tally:
    """What the leaves' comparisons found, in leaf order: findings, and the leaves reported together."""

    findings: list[Finding] = dataclasses.field(default_factory=list)
    backward: list[tuple[str, float]] = dataclasses.field(default_factory=list)  # autodiff non-finite, loss finite
    nearby: list[tuple[str, float]] = dataclasses.field(default_factory=list)  # non-finite within a step
    kinked: list[tuple[str, KinkVerdict]] = dataclasses.field(default_factory=list)  # not judged: a kink
    zeroed: list[tuple[str, Any]] = dataclasses.field(default_factory=list)  # zero gradient, read by the output
    stopped: list[tuple[str, float, float, tuple[str, ...]]] = dataclasses.field(default_factory=list)  # by design

    def findings_at(self, v0: np.ndarray, eps: float) -> list[Finding]:
        findings = list(self.findings)
        if self.backward:
            findings.append(nonfinite_gradient_finding(self.backward, float(v0.sum())))
        if self.nearby:
            findings.append(nonfinite_nearby_finding(self.nearby, float(v0.sum()), eps))
        if self.kinked:
            findings.append(kink_finding(self.kinked))
        if self.zeroed:
            findings.append(zeroed_here_finding(self.zeroed))
        if self.stopped:
            findings.append(stopped_gradient_finding(self.stopped))
        return findings


@dataclasses.dataclass(frozen=True)
class LeafJudge:
    """Compares one leaf's autodiff derivative along its direction with finite differences (order 1 through
    ``check_jvp``/``check_vjp`` with the compiled derivatives, higher orders through
    ``jax.test_util.check_grads``), down the step ladder, then tests a failing leaf for a kink at the point."""

    order: int
    kinks: bool
    seed: int
    tol: Tolerance
    modes: tuple[str, ...]
    tdtype: np.dtype
    values: list
    dirs: list
    value_at: Any
    v0: np.ndarray
    grads: list[np.ndarray]
    directional: list[float]
    jvps: np.ndarray | None
    reaches: list[bool] | None = None  # per leaf: a path of the function leads from it to the output (_reaching)
    stops: list[tuple[str, ...]] | None = None  # per leaf: the stop_gradients its value flows into (grads_stops)
    unstopped: Callable[[int], float | None] | None = None  # per leaf: the derivative through them (grads_stops)

    @property
    def n(self) -> int:
        return len(self.values)

    def value_along(self, j: int, sub: np.ndarray, t: float) -> np.ndarray:
        """``f`` with leaf ``j`` moved by ``t`` along ``sub`` (a sub-direction of its direction)."""
        vec = np.zeros((self.n,), self.tdtype)
        vec[j] = t
        return np.asarray(self.value_at(self.values, self.dirs[:j] + [sub] + self.dirs[j + 1 :], vec))

    def along(self, j: int | list[int]) -> Callable:
        """``g(t)``: ``f`` with leaf ``j`` (or every leaf of a list, together) moved by ``t`` along its direction;
        check_jvp and check_vjp ask for the same points, so each is evaluated once."""
        memo: dict[float, np.ndarray] = {0.0: self.v0}

        def g(t):
            key = float(np.asarray(t))
            if key not in memo:
                vec = np.zeros((self.n,), self.tdtype)
                vec[j] = key
                memo[key] = np.asarray(self.value_at(self.values, self.dirs, vec))
            return memo[key]

        return g

    def unmoved_together(self, js: list[int]) -> bool:
        """Whether ``f`` is bitwise unchanged when the leaves ``js`` (whose gradients are identically zero) all move
        a step ``eps`` each way at once, along their independent random directions: then each one's own
        difference quotient is exactly zero too (a cancellation to the last bit between independent random
        directions does not happen), and two evaluations judge them all instead of two per leaf (an MLP-Mixer
        with a zero-initialised head: 76 such leaves, 70 s of its gradient check on 8 host devices). Not
        jit-safe."""
        return directional_quotient(self.along(js), np.asarray(0.0, self.tdtype), self.tol.eps) == 0.0

    def checks(self, j: int, g: Callable, ad: float) -> tuple:
        """The ``(g, g_jvp, g_vjp)`` that :func:`run_check` compares for leaf ``j``."""
        v0, jvps, tdtype = self.v0, self.jvps, self.tdtype
        if self.order != 1:

            def g_traceable(t):  # for order >= 2, differentiated by jax.test_util.check_grads itself
                return self.value_at(self.values, self.dirs, jnp.zeros((self.n,), tdtype).at[j].set(t))

            return g_traceable, None, None

        def g_jvp(primals, tangents):  # jvp is linear in the tangent: scale the compiled one
            assert jvps is not None  # asked only in forward mode, where the JVPs were computed
            return v0, np.asarray(jvps[j] * np.asarray(tangents[0]), v0.dtype)

        def g_vjp(t):  # check_vjp asks at t0 only, where the reverse-mode gradient is known
            return v0, lambda ct: (np.asarray(np.asarray(ct) * ad, tdtype),)

        return g, g_jvp, g_vjp

    def judge(self, j: int, path: str, tally: Tally, unmoved: bool = False) -> None:
        """Compare leaf ``j`` and record what it gives in ``tally``; ``unmoved``: its gradient is identically zero
        and :meth:`unmoved_together` found ``f`` unchanged along it (its difference quotient is 0)."""
        tol, ad, jvps = self.tol, self.directional[j], self.jvps
        if not (np.all(np.isfinite(self.grads[j])) and np.isfinite(ad) and (jvps is None or np.isfinite(jvps[j]))):
            tally.backward.append((path, ad))
            return
        g = self.along(j)
        t0 = np.asarray(0.0, self.tdtype)
        if not np.any(self.grads[j]):
            self.missing(j, path, g, t0, tally, unmoved)
            return
        checks = self.checks(j, g, ad)
        failure, errors, fds = None, [], []
        for step_size in tol.ladder:  # a kink (ReLU) inside the step is not a bug: it leaves at smaller steps
            failure = run_check(checks, t0, self.order, self.modes, tol.atol, tol.rtol, step_size)
            if failure is None:
                break
            fds.append(directional_quotient(g, t0, step_size))
            errors.append(abs(fds[-1] - ad) / max(abs(ad), abs(fds[-1]), 1e-30))
        if failure is None:
            return
        if not np.all(np.isfinite(fds)):  # not a wrong rule: the loss is NaN/Inf a step away from the point
            tally.nearby.append((path, next(v for v in fds if not np.isfinite(v))))
            return
        if min(abs(f - ad) for f in fds) <= tol.atol + tol.rtol * abs(ad) or (
            len(errors) > 1 and errors[-1] < errors[0] / 10
        ):
            return  # agrees at some step, or the gap shrinks with the step: kink noise, not a bug
        at_kink = self.kinks and self.order == 1 and self.at_kink(g, ad)
        if not at_kink and within_own_error(
            g, tol.ladder[: len(fds)], fds, ad, tol.atol + tol.rtol * abs(ad), self.tdtype
        ):
            return  # the gap is no larger than the difference quotient's own error: not a finding
        fd = min(fds, key=lambda v: abs(v - ad))
        self.mismatch(j, path, g, ad, fd, failure, tally)

    def at_kink(self, g: Callable, ad: float) -> bool:
        """Whether ``g`` has a kink at the point (``grads_kink.kink_at_every_step`` at the ladder's ends): judged
        before the quotient's own error, which a kink's steady jump does not explain, in every dtype alike."""
        tol = self.tol
        return kink_at_every_step(g, (tol.ladder[0], tol.ladder[-1]), ad, tol.atol, tol.kink_rtol)[0]

    def missing(self, j: int, path: str, g: Callable, t0: np.ndarray, tally: Tally, unmoved: bool = False) -> None:
        """A leaf whose gradient is identically zero: ``grad.missing``, or non-finite a step away (``unmoved``: its
        difference quotient is known to be 0)."""
        tol = self.tol
        fd = 0.0 if unmoved else directional_quotient(g, t0, tol.eps)
        if not np.isfinite(fd):
            tally.nearby.append((path, fd))
            return
        ends = (tol.ladder[0], tol.ladder[-1])  # the steps of the kink test
        kink = fd != 0.0 and self.kinks and kink_at_every_step(g, ends, 0.0, tol.atol, tol.kink_rtol)[0]
        if fd == 0.0 and self.reaches is not None and self.reaches[j]:  # used, zeroed further on at this point
            tally.zeroed.append((path, self.values[j]))
            return
        tally.findings.append(missing_finding(path, fd, fd != 0.0, self.values[j], kink))

    def stopped_by_design(self, j: int, g: Callable) -> bool:
        """Whether leaf ``j`` flows into a ``stop_gradient`` and its derivative with the gradient passed through
        there agrees with finite differences at a step of the ladder: the gap is the stop_gradient's, not a wrong
        rule's."""
        if not (self.stops and self.stops[j]) or self.unstopped is None:
            return False
        through, tol = self.unstopped(j), self.tol
        if through is None:
            return False
        t0 = np.asarray(0.0, self.tdtype)
        fds = [directional_quotient(g, t0, h) for h in tol.ladder]  # (the judge's points: evaluated already)
        return any(np.isfinite(f) and abs(through - f) <= tol.atol + tol.rtol * max(abs(through), abs(f)) for f in fds)

    def mismatch(self, j: int, path: str, g: Callable, ad: float, fd: float, failure: str, tally: Tally) -> None:
        """A leaf that fails at every step: ``grad.mismatch``, unless the point is a kink along its direction
        and no sub-direction off the kink disagrees (then it is not judged)."""
        tol = self.tol
        where, kink_extra = "", {}
        if self.kinks and self.order == 1:
            ends = (tol.ladder[0], tol.ladder[-1])  # the steps of the kink test
            at_kink, right, left = kink_at_every_step(g, ends, ad, tol.atol, tol.kink_rtol)
            if at_kink:  # no step helps at a kink: judge the sub-directions off it, or not at all
                verdict = probe_sub_directions(
                    functools.partial(self.value_along, j),
                    self.grads[j],
                    np.asarray(self.dirs[j]),
                    np.random.default_rng([self.seed, j]),
                    ends,
                    right,
                    left,
                    tol.atol,
                    tol.rtol,
                    tol.kink_rtol,
                    machine_eps=float(np.finfo(np.dtype(self.tdtype)).eps),
                )
                if verdict.wrong is None:
                    tally.kinked.append((path, verdict))
                    return
                ad, fd, kink_extra = verdict.wrong["autodiff"], verdict.wrong["finite_diff"], verdict.wrong
                where = (
                    f" along a sub-direction off a kink at the point ({verdict.wrong['coordinates']} of its "
                    f"{np.size(self.values[j])} coordinates; {verdict.summary()})"
                )
        if self.stopped_by_design(j, g):  # autodiff stops there, finite differences do not
            tally.stopped.append((path, ad, fd, self.stops[j] if self.stops else ()))
            return
        forward = float(self.jvps[j]) if self.jvps is not None and not where else None
        finding = mismatch_finding(
            path,
            ad,
            fd,
            forward=forward,
            where=where,
            atol=tol.atol,
            rtol=tol.rtol,
            eps=tol.eps,
            compute=tol.compute,
            order=self.order,
            modes=self.modes,
            failure=failure,
            kink=kink_extra,
        )
        tally.findings.append(finding)


def quotient_error(g: Callable, steps: Sequence[float], fds: Sequence[float], dtype: Any) -> list[float]:
    """The error estimate of the central quotient at each step after the first: how much it moved from the
    previous step (truncation and kinks crossed by the step shrink with it, so the change bounds what is left:
    a Richardson estimate), plus its round-off ``ROUNDING_ULPS * eps * max|g| / h``. Host-side."""
    return [abs(fds[k] - fds[k - 1]) + quotient_round_off(g, float(steps[k]), dtype) for k in range(1, len(fds))]


def within_own_error(
    g: Callable, steps: Sequence[float], fds: Sequence[float], autodiff: float, tolerance: float, dtype: Any
) -> bool:
    """Whether autodiff is within ``tolerance`` plus twice the quotient's own error estimate
    (:func:`quotient_error`) of the central quotient at some step after the first: the finite difference
    cannot tell them apart (a float32 quotient across ReLU kinks), so there is no mismatch to report. A wrong
    derivative (a flipped sign, a missing factor) leaves a gap the quotients agree on, far above their error.
    Host-side."""
    errors = quotient_error(g, steps, fds, dtype)
    return any(abs(fds[k] - autodiff) <= tolerance + 2.0 * e for k, e in zip(range(1, len(fds)), errors))


def run_check(fns, t0, order, modes, atol, rtol, eps) -> str | None:
    """None when jax.test_util's checks pass on the one-scalar function at ``t0``, else their message.

    Order 1 uses ``check_jvp``/``check_vjp`` (what ``check_grads`` runs at order 1) with the JVP and
    VJP compiled once for all leaves; higher orders call ``jax.test_util.check_grads`` itself.
    """
    g, g_jvp, g_vjp = fns
    try:
        if g_jvp is None:
            jax.test_util.check_grads(g, (t0,), order, modes=modes, atol=atol, rtol=rtol, eps=eps)
        else:
            if "fwd" in modes:
                jax.test_util.check_jvp(g, g_jvp, (t0,), atol=atol, rtol=rtol, eps=eps, err_msg="JVP")
            if "rev" in modes:
                jax.test_util.check_vjp(g, g_vjp, (t0,), atol=atol, rtol=rtol, eps=eps, err_msg="VJP")
    except AssertionError as e:
        return str(e)
    return None
