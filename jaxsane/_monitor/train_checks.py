"""The ``train.*`` detectors: :func:`check_training` judges a recorded :class:`History`.

:class:`History` is what :class:`jaxsane.Monitor` records on the host; the detectors look at medians
over windows, never one noisy step, against documented, overridable thresholds taken from
AUTOTRAINER (ICSE 2021) and DeepDiagnosis (ICSE 2022) where those publish one. Host-side only
(numpy), not jit-safe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from .._core.finding import Finding, RootCause
from .._core.history import History
from .._core.validate import fail, require_float, require_int
from .precision_checks import check_loss_spikes, check_update_underflow
from .update_evidence import gradless_leaves, held_leaves, warmup_growth

# ----------------------------------------------------------------------------- detectors


def _median(x) -> float:
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    return float(np.median(x)) if x.size else float("nan")


def _window(n: int, frac: float = 0.2, minimum: int = 3) -> int:
    return max(minimum, int(round(n * frac)))


def check_training(
    history: History,
    *,
    min_steps: int = 10,
    diverge_factor: float = 2.0,
    plateau_rel: float = 0.01,
    oscillation_rel: float = 0.25,
    oscillation_trend: float = 0.1,
    update_ratio_low: float = 1e-5,
    update_ratio_high: float = 1e-1,
    vanishing_ratio: float = 1e-3,
    vanishing_first: float = 1e-4,
    exploding_ratio: float = 70.0,
    grad_growth: float = 1e3,
    dead_fraction: float = 0.7,
    overfit_rise: float = 0.2,
    min_evals: int = 3,
    underflow_fraction: float = 0.25,
    spike_window: int = 50,
    spike_k: float = 6.0,
    spike_rel: float = 0.5,
    spike_min_history: int = 10,
) -> list[Finding]:
    """Judge a recorded :class:`History` and return ``train.*`` findings (never raises on a finding).

    Every rule looks at medians over windows of the history, never at one step.

    Args:
      history: what :class:`Monitor` recorded.
      min_steps: loss rules need at least this many recorded steps. A step that returns no loss records
        NaN: loss rules judge only finite values and never fire on a history with no finite loss
        (state-only steps); a loss that was finite and is non-finite over the whole last window is
        ``train.diverging`` ("went non-finite").
      diverge_factor: ``train.diverging`` when the median loss of the last window exceeds this many
        times the median of the first window (or the loss went non-finite).
      plateau_rel: ``train.plateau`` when the loss fell by less than this fraction of its start.
      oscillation_rel: ``train.oscillating`` when, over the second half, the loss's spread around its
        moving median exceeds this fraction of the starting loss ...
      oscillation_trend: ... while the second half's loss fell by less than this fraction.
      update_ratio_low, update_ratio_high: ``train.update_ratio`` when a kernel's median
        ``‖θ_{t+1} − θ_t‖ / ‖θ_t‖`` lies outside this band (DeepDiagnosis, ICSE 2022: [1e-5, 1e-1]).
      vanishing_ratio, vanishing_first: ``train.vanishing_grads`` when the median
        ``‖g_first‖/‖g_last‖ < vanishing_ratio`` and ``‖g_first‖ < vanishing_first`` (AUTOTRAINER, ICSE 2021:
        1e-3 and 1e-4). First/last are the kernels the model reads first/last.
      exploding_ratio: ``train.exploding_grads`` when the median ``‖g_first‖/‖g_last‖`` exceeds this
        (AUTOTRAINER: 70) ...
      grad_growth: ... or the total gradient norm grew by this factor from the first to the last window.
      dead_fraction: ``train.dead_units`` when a ReLU site's median fraction of units inactive on the
        whole batch is at least this (AUTOTRAINER / DeepDiagnosis: 70%).
      overfit_rise: ``train.overfitting`` when the latest eval loss is this fraction above its best
        while the train loss kept falling.
      min_evals: the overfitting rule needs this many evaluations.
      underflow_fraction: ``train.update_underflow`` when a bf16/fp16 leaf's median fraction of updates lost
        to rounding (non-zero in a float32 shadow step, bitwise no change in the real one) is at least this.
      spike_window, spike_k, spike_rel, spike_min_history: ``train.loss_spike`` when a step's loss exceeds
        the median of the last ``spike_min_history`` losses by more than ``spike_k`` robust sigmas (1.4826 x
        the MAD of successive differences / sqrt 2 over the previous ``spike_window`` losses) and by
        ``spike_rel`` of that median (see ``_monitor/precision_checks.py``).

    Returns:
      A list of :class:`Finding` (empty for a healthy run). Not jit-safe (host numpy).
    """
    history = _as_history(history)
    limits = TrainThresholds(
        min_steps=min_steps,
        diverge_factor=diverge_factor,
        plateau_rel=plateau_rel,
        oscillation_rel=oscillation_rel,
        oscillation_trend=oscillation_trend,
        update_ratio_low=update_ratio_low,
        update_ratio_high=update_ratio_high,
        vanishing_ratio=vanishing_ratio,
        vanishing_first=vanishing_first,
        exploding_ratio=exploding_ratio,
        grad_growth=grad_growth,
        dead_fraction=dead_fraction,
        overfit_rise=overfit_rise,
        min_evals=min_evals,
        underflow_fraction=underflow_fraction,
        spike_window=spike_window,
        spike_k=spike_k,
        spike_rel=spike_rel,
        spike_min_history=spike_min_history,
    )
    out = _check_loss(history, limits)
    spikes = check_loss_spikes(history, window=spike_window, k=spike_k, rel=spike_rel, min_history=spike_min_history)
    diverging = [f for f in out if f.code == "train.diverging"]
    if diverging:  # the jumps of a loss that runs away are its divergence, not a separate cause
        cause = RootCause(diverging[0].code, diverging[0].where)
        spikes = [dataclasses.replace(f, caused_by=cause) for f in spikes]
    out += spikes
    out += check_update_underflow(history, limits.underflow_fraction)
    out += _check_update_ratio(history, limits.update_ratio_low, limits.update_ratio_high)
    out += _check_gradients(
        history, limits.vanishing_ratio, limits.vanishing_first, limits.exploding_ratio, limits.grad_growth
    )
    out += _check_dead(history, limits.dead_fraction)
    out += _check_overfitting(history, limits.overfit_rise, limits.min_evals)
    return out


def _as_history(history: object) -> History:
    """``history`` itself, or a :class:`History` rebuilt from ``History.to_dict()`` (e.g. read back from JSON)."""
    if isinstance(history, Mapping):
        history = History.from_dict(dict(history))  # e.g. History.to_dict() read back from JSON
    if not isinstance(history, History):
        raise fail(
            "check_training",
            "history",
            "a jaxsane.History (or a dict from History.to_dict())",
            history,
            fix="pass FitResult.history from jaxsane.fit, or Monitor.pull()",
        )
    if len(history.steps) != len(history.loss):
        raise fail(
            "check_training",
            "history",
            "a History with one loss per step",
            history,
            cause=f"history.steps has {len(history.steps)} entries but history.loss {len(history.loss)}",
            fix="record each step's index and loss together (Monitor.record)",
        )
    return history


@dataclasses.dataclass(frozen=True)
class TrainThresholds:
    """The thresholds of :func:`jaxsane.check_training`, with its documented defaults (AUTOTRAINER, ICSE 2021;
    DeepDiagnosis, ICSE 2022, where they publish one); each field is the keyword argument of the same name.
    Built once per call, after the history is checked; a value out of range raises
    :class:`~jaxsane.ArgumentError`. Host-side only."""

    min_steps: int = 10  # loss rules need this many recorded steps
    diverge_factor: float = 2.0  # train.diverging: last window's median loss over the first's
    plateau_rel: float = 0.01  # train.plateau: the loss fell by less than this fraction of its start
    oscillation_rel: float = 0.25  # train.oscillating: spread around the moving median over the start ...
    oscillation_trend: float = 0.1  # ... while the second half fell by less than this fraction
    update_ratio_low: float = 1e-5  # train.update_ratio band (DeepDiagnosis: [1e-5, 1e-1])
    update_ratio_high: float = 1e-1
    vanishing_ratio: float = 1e-3  # train.vanishing_grads: |g_first|/|g_last| below this (AUTOTRAINER) ...
    vanishing_first: float = 1e-4  # ... and |g_first| below this
    exploding_ratio: float = 70.0  # train.exploding_grads: |g_first|/|g_last| above this (AUTOTRAINER) ...
    grad_growth: float = 1e3  # ... or the total gradient norm grew by this factor
    dead_fraction: float = 0.7  # train.dead_units: a ReLU site's median inactive fraction (AUTOTRAINER)
    overfit_rise: float = 0.2  # train.overfitting: latest eval loss this fraction above its best
    min_evals: int = 3  # the overfitting rule needs this many evaluations
    underflow_fraction: float = 0.25  # train.update_underflow: median fraction of updates lost to rounding
    spike_window: int = 50  # train.loss_spike: the robust level is over this many previous losses ...
    spike_k: float = 6.0  # ... median + spike_k x 1.4826 x MAD ...
    spike_rel: float = 0.5  # ... and at least this fraction of the median above it
    spike_min_history: int = 10  # ... with at least this many losses before the step

    def __post_init__(self) -> None:
        require_int("check_training", "min_steps", self.min_steps, min=1)
        require_int("check_training", "min_evals", self.min_evals, min=1)
        require_int("check_training", "spike_window", self.spike_window, min=1)
        require_int("check_training", "spike_min_history", self.spike_min_history, min=1)
        for field in dataclasses.fields(self):
            if field.name not in ("min_steps", "min_evals", "spike_window", "spike_min_history"):
                require_float("check_training", field.name, getattr(self, field.name), min=0.0)


def _check_loss(h: History, t: TrainThresholds) -> list[Finding]:
    """``train.diverging`` or ``train.plateau`` from the first and last windows of the finite losses, then
    ``train.oscillating`` over the second half of a run that does not diverge."""
    loss = np.asarray(h.loss, dtype=np.float64)
    n = loss.size
    values = loss[np.isfinite(loss)]  # a step that reports no loss records NaN: loss rules judge finite values only
    if not (n >= t.min_steps and values.size):
        return []
    kf = _window(values.size)
    start, end = _median(values[:kf]), _median(values[-kf:])
    out = _loss_trend(loss, list(h.steps), start, end, t)
    growth = warmup_growth(h) if any(f.code == "train.plateau" for f in out) else None
    if growth is not None:
        out = [f if f.code != "train.plateau" else _warming_up(f, growth, n) for f in out]
    diverging = any(f.code == "train.diverging" for f in out)
    if not diverging and values.size >= t.min_steps and n >= 2 * t.min_steps:
        out += _check_oscillation(loss, list(h.steps), start, t)
    return out


def _loss_trend(loss: np.ndarray, steps: list, start: float, end: float, t: TrainThresholds) -> list[Finding]:
    """``train.diverging`` (went non-finite, or rose ``diverge_factor``-fold) or ``train.plateau``; ``start``
    and ``end`` are the medians of the first and last windows of the finite losses."""
    n = loss.size
    finite = np.isfinite(loss)
    values = loss[finite]
    k = _window(n)
    kf = _window(values.size)
    went_nonfinite = not finite[-k:].any()  # finite earlier, nothing finite in the last window
    if went_nonfinite:
        first_bad = int(np.flatnonzero(finite)[-1]) + 1
        return [
            Finding(
                "train.diverging",
                f"the train loss went non-finite: finite from {start:.4g} (median of the first {kf} finite steps) "
                f"to {values[-1]:.4g}, then {loss[first_bad]:.4g} from step {steps[first_bad]} to the end of the "
                f"{n} steps",
                "run the step under jaxsane.guard to catch the first non-finite value and its line; lower the "
                "learning rate (try 10x smaller); add gradient clipping (optax.clip_by_global_norm)",
                step=steps[first_bad],
                extra={"start": start, "end": float(loss[-1]), "nonfinite_from": steps[first_bad]},
            )
        ]
    if values.size < t.min_steps:
        return []  # too few finite losses to judge a trend
    if end > t.diverge_factor * max(start, 1e-12) and end > start:
        return [
            Finding(
                "train.diverging",
                f"the train loss rose from {start:.4g} (median of the first {kf} steps) to "
                f"{end:.4g} (median of the last {kf}) over {n} steps",
                "lower the learning rate (try 10x smaller); check the update's sign (params - lr * grad, "
                "optax.apply_updates with the optimizer's updates, not + grads); add gradient clipping "
                "(optax.clip_by_global_norm)",
                step=steps[-1],
                extra={"start": start, "end": end, "factor": t.diverge_factor},
            )
        ]
    if abs(start - end) < t.plateau_rel * abs(start) + 1e-12:
        return [
            Finding(
                "train.plateau",
                f"the train loss stayed flat over {n} steps: {start:.4g} -> {end:.4g} "
                f"(less than {t.plateau_rel:.0%} change); the model is not learning (underfitting)",
                "check that the learning rate is not 0 or far too small, that the parameters are not frozen "
                "(stop_gradient, an optax.set_to_zero/masked transform) and that the update is applied to "
                "the state the step returns",
                step=steps[-1],
                extra={"start": start, "end": end},
            )
        ]
    return []


def _warming_up(plateau: Finding, growth: float, steps: int) -> Finding:
    """The plateau of a run whose updates were still growing at its end (a learning-rate warmup), not judged:
    the loss of a warmup's first steps stays flat in a model that learns (a BERT-style masked LM, 50 warmup
    steps from a rate of 0, flat over 30 steps and falling over 500)."""
    return Finding(
        "doctor.skipped",
        f"train.plateau not judged: {plateau.message.split(';')[0]}, but the step's updates were still growing "
        f"({growth:.1f}x over the second half of the run: a learning-rate warmup?)",
        f"run past the warmup to judge whether the model learns (jaxsane doctor -o run_steps={4 * steps})",
        step=plateau.step,
        extra={**(plateau.extra or {}), "update_growth": growth},
    )


def _check_oscillation(loss: np.ndarray, steps: list, start: float, t: TrainThresholds) -> list[Finding]:
    """``train.oscillating``: over the second half, the loss's robust spread around its moving median exceeds
    ``oscillation_rel`` of the starting loss while it fell by less than ``oscillation_trend``."""
    half = loss[loss.size // 2 :]
    half = half[np.isfinite(half)]
    if half.size < t.min_steps:
        return []
    w = max(3, half.size // 5) | 1
    pad = np.pad(half, (w // 2, w // 2), mode="edge")
    moving = np.array([np.median(pad[i : i + w]) for i in range(half.size)])
    spread = _median(np.abs(half - moving)) * 1.4826
    k2 = _window(half.size)
    h0, h1 = _median(half[:k2]), _median(half[-k2:])
    if not (spread > t.oscillation_rel * abs(start) and (h0 - h1) < t.oscillation_trend * abs(h0)):
        return []
    return [
        Finding(
            "train.oscillating",
            f"the train loss oscillates without trend over the second half of the run: spread "
            f"{spread:.3g} around its moving median (start {start:.3g}), {h0:.3g} -> {h1:.3g}",
            "lower the learning rate or add a warmup/decay schedule; if the batch is tiny, increase it",
            step=steps[-1],
            extra={"spread": spread},
        )
    ]


ZERO_INIT_GROWTH = 0.01  # a leaf whose norm grew over 100x during the run started from (near) zero


def _check_update_ratio(h: History, low: float, high: float) -> list[Finding]:
    p, u = h.arrays("param_norm"), h.arrays("update_norm")
    if p.size == 0 or len(p) < 2:
        return []
    idx = h.weight_leaves or list(range(p.shape[1]))
    at_start = p[0, idx]  # the norms the run started from, a sample that moved nothing included (a warmup from 0)
    moved = np.any(u[:, idx] > 0, axis=1)
    if moved.any():  # a step that moved no weight at all was skipped (gradient accumulation, an overflow skip)
        p, u = p[moved], u[moved]
    if len(p) < 2:
        return []
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = u[:, idx] / np.where(p[:, idx] > 0, p[:, idx], np.nan)
    # too high: the largest median over a sliding window (an early burst counts, one spike does not);
    # too low: the median over the whole run (a persistently frozen or lr-0 kernel).
    k = _window(len(ratio))
    windows = [ratio[i : i + k] for i in range(0, max(1, len(ratio) - k + 1))]
    peak = np.array([max((_median(w[:, j]) for w in windows), default=float("nan")) for j in range(ratio.shape[1])])
    med = np.array([_median(ratio[:, j]) for j in range(ratio.shape[1])])
    out = []
    # a leaf that starts at (almost) zero (a zero-initialised bias, LayerNorm shift or position table) has a
    # huge ratio while it grows from nothing: the band is for parameters that start at their init scale
    last = p[-1, idx]
    from_zero = (at_start == 0) | (at_start < ZERO_INIT_GROWTH * last)
    hi = [j for j, m in enumerate(peak) if np.isfinite(m) and m > high and not from_zero[j]]
    lo = [j for j, m in enumerate(med) if np.isfinite(m) and m < low]
    names = [h.leaf_paths[i] if i < len(h.leaf_paths) else f"leaf {i}" for i in idx]
    held = {idx.index(i) for i in held_leaves(h, [idx[j] for j in lo])} if len(lo) < len(idx) else set()
    if held:  # a frozen backbone: said, not blamed (a model with every kernel held is step.no_update's)
        lo = [j for j in lo if j not in held]
        out.append(_held(sorted(held), names, len(idx), h.tele_steps[-1]))
    gradless = {idx.index(i) for i in gradless_leaves(h, [idx[j] for j in lo])}
    if gradless:  # no gradient reaches them: the learning rate is not the cause
        lo = [j for j in lo if j not in gradless]
        out.append(_gradless(sorted(gradless), names, len(idx), h.tele_steps[-1], (low, high)))
    if hi:
        j = max(hi, key=lambda j: peak[j])
        out.append(
            Finding(
                "train.update_ratio",
                f"updates are too large: |update|/|param| of {names[j]} reached a median of {peak[j]:.3g} over "
                f"{k} samples (> {high:g}; {len(hi)} of {len(idx)} kernels above the band)",
                "lower the learning rate (a healthy ratio is around 1e-3); add warmup or gradient clipping",
                path=names[j],
                step=h.tele_steps[-1],
                extra={"ratio": float(peak[j]), "band": [low, high], "direction": "high"},
            )
        )
    if lo:
        j = min(lo, key=lambda j: med[j])
        out.append(
            Finding(
                "train.update_ratio",
                f"updates are too small: median |update|/|param| of {names[j]} is {med[j]:.3g} "
                f"(< {low:g}; {len(lo)} of {len(idx)} kernels below the band)",
                "raise the learning rate (is it 0?); check the parameters are not frozen and the optimizer "
                "updates are applied",
                path=names[j],
                step=h.tele_steps[-1],
                extra={"ratio": float(med[j]), "band": [low, high], "direction": "low"},
            )
        )
    return out


def _gradless(leaves: list[int], names: list[str], kernels: int, step: int, band: tuple[float, float]) -> Finding:
    """The warning that ``leaves`` never moved because their gradient is zero (:func:`gradless_leaves`)."""
    shown = [names[j] for j in leaves]
    return Finding(
        "train.update_ratio",
        f"{len(leaves)} of {kernels} kernels got exactly zero gradient on every sampled step, e.g. {shown[0]}, so "
        "nothing moves them: the loss does not depend on them (an output computed and never used, a "
        "stop_gradient, a branch never taken); no learning rate is the cause",
        "make the loss use what they compute, or remove them; if a stop_gradient freezes them on purpose, "
        "nothing to do",
        path=shown[0],
        step=step,
        extra={"band": list(band), "direction": "no_gradient", "leaves": shown},
    )


def _held(held: list[int], names: list[str], kernels: int, step: int) -> Finding:
    """The info that the optimizer holds ``held`` kernels still though they have gradients (:func:`held_leaves`)."""
    return Finding(
        "train.update_ratio",
        f"{len(held)} of {kernels} kernels never moved though their gradients are not zero, e.g. {names[held[0]]}: "
        "the optimizer holds them (a frozen backbone: optax.set_to_zero or optax.masked in a multi_transform, "
        "nnx.Optimizer(wrt=...))",
        "nothing to do if they are frozen on purpose; if they should train, check the optimizer's labels or mask",
        severity="info",
        path=names[held[0]],
        step=step,
        extra={"direction": "held", "held": [names[j] for j in held]},
    )


def _check_gradients(
    h: History, vanishing_ratio: float, vanishing_first: float, exploding_ratio: float, growth: float
) -> list[Finding]:
    names, g = h.layer_grad_norms()
    if g.size == 0 or len(g) < 2 or g.shape[1] < 1:
        return []
    out = []
    first, last = g[:, 0], g[:, -1]
    if g.shape[1] >= 2:
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = _median(first / last)
        g_first = _median(first)
        if np.isfinite(ratio) and ratio < vanishing_ratio and g_first < vanishing_first:
            out.append(
                Finding(
                    "train.vanishing_grads",
                    f"gradients vanish towards the input: median |g| of {names[0]} is {g_first:.3g}, "
                    f"{ratio:.3g}x that of {names[-1]} (thresholds {vanishing_ratio:g} and {vanishing_first:g})",
                    "use ReLU-family activations instead of saturating ones, He/Glorot init, normalisation "
                    "layers or residual connections; check for dead ReLUs",
                    path=names[0],
                    step=h.grad_steps[-1],
                    extra={"ratio": ratio, "first": g_first},
                )
            )
        elif np.isfinite(ratio) and ratio > exploding_ratio:
            out.append(
                Finding(
                    "train.exploding_grads",
                    f"gradients explode towards the input: median |g| of {names[0]} is {ratio:.3g}x that of "
                    f"{names[-1]} (> {exploding_ratio:g})",
                    "clip gradients (optax.clip_by_global_norm(1.0)), lower the learning rate, check the init scale",
                    path=names[0],
                    step=h.grad_steps[-1],
                    extra={"ratio": ratio},
                )
            )
    total = np.sqrt(np.nansum(np.square(h.arrays("grad_norm")), axis=1))
    k = _window(len(total), minimum=2)
    if len(total) >= 2 * k and not out:
        g0, g1 = _median(total[:k]), _median(total[-k:])
        if g0 > 0 and g1 / g0 > growth:
            out.append(
                Finding(
                    "train.exploding_grads",
                    f"the gradient norm grew {g1 / g0:.3g}x over the run ({g0:.3g} -> {g1:.3g}; > {growth:g}x)",
                    "clip gradients (optax.clip_by_global_norm(1.0)), lower the learning rate, check the init scale",
                    step=h.grad_steps[-1],
                    extra={"growth": g1 / g0},
                )
            )
    return out


def _check_dead(h: History, threshold: float) -> list[Finding]:
    d = h.arrays("dead_fraction")
    if d.size == 0:
        return []
    out = []
    med = [_median(d[:, j]) for j in range(d.shape[1])]
    bad = [j for j, m in enumerate(med) if np.isfinite(m) and m >= threshold]
    if bad:
        j = max(bad, key=lambda j: med[j])
        site = f" ({h.relu_labels[j]})" if j < len(h.relu_labels) else ""
        out.append(
            Finding(
                "train.dead_units",
                f"{med[j]:.0%} of the units of ReLU #{j}{site} (of {len(med)}, in apply's order) are inactive on every "
                f"example of the batch (median over {len(d)} samples; threshold {threshold:.0%})",
                "check the bias init (a large negative bias kills ReLUs), lower the learning rate, or use "
                "leaky_relu/gelu",
                path=f"relu[{j}]",
                step=h.dead_steps[-1],
                extra={"fractions": [float(m) for m in med], "site": j},
            )
        )
    return out


OVERFIT_RANGE_SHARE = 0.1
"""train.overfitting also needs the eval loss to climb back at least this share of how far it fell to its best:
a CNN whose eval loss fell from 2.8 to 0.005 and then read 0.0086 (one noisy evaluation, 1920 examples into a
4096-example epoch) has not overfit; an eval loss that rises from the start (a mislabeled eval split) fell
nowhere first."""


def _check_overfitting(h: History, rise: float, min_evals: int) -> list[Finding]:
    ev = np.asarray(h.eval_loss, dtype=np.float64)
    if ev.size < min_evals or not np.isfinite(ev).all():
        return []
    best = int(np.argmin(ev))
    latest = float(np.mean(ev[-2:])) if ev.size >= 4 else float(ev[-1])
    if best >= ev.size - 1 or latest <= ev[best] * (1 + rise):
        return []
    if latest - ev[best] < OVERFIT_RANGE_SHARE * (ev[0] - ev[best]):  # noise at the bottom of a long fall
        return []
    loss = np.asarray(h.loss, dtype=np.float64)
    steps = np.asarray(h.steps)
    if loss.size < 2:
        return []
    at_best = loss[(steps < h.eval_steps[best])]
    k = _window(loss.size, minimum=2)
    train_then = _median(at_best[-k:]) if at_best.size else _median(loss[:k])
    train_now = _median(loss[-k:])
    if not train_now < train_then:
        return []
    return [
        Finding(
            "train.overfitting",
            f"the eval loss rose from its best {ev[best]:.4g} (after {h.eval_steps[best]} steps) to {latest:.4g} "
            f"while the train loss fell from {train_then:.4g} to {train_now:.4g}",
            "stop earlier (early stopping on eval loss), add data or regularisation (weight decay, dropout); "
            "if it happens from the start, check the eval split for leakage or mislabeled examples",
            step=h.eval_steps[-1],
            extra={"best": float(ev[best]), "latest": latest, "best_step": h.eval_steps[best]},
        )
    ]
