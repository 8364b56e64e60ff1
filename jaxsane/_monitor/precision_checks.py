"""Two ``train.*`` detectors for silent low-precision failures: ``train.update_underflow`` (bf16/fp16 updates
that round away, from the Monitor's ``update_lost`` telemetry) and ``train.loss_spike`` (a step whose loss
jumps far above its recent robust level).

Spike rule (documented, overridable through :func:`jaxsane.check_training` / ``fit(thresholds=...)``): step
``t`` spikes when, with at least ``spike_min_history`` finite losses before it,

    loss_t > level + margin  and  loss_t - loss_prev > margin / 2,   margin = max(spike_k * sigma, spike_rel * |level|)

where ``level`` is the median of the last ``spike_min_history`` losses (the recent level, not pulled up by a
falling start) and ``sigma = 1.4826 * median|l_i - l_{i-1}| / sqrt(2)`` over the previous ``spike_window``
losses: the MAD-based robust standard deviation of the minibatch noise, taken on successive differences so
that the loss's own downward trend does not inflate it. ``spike_k = 6`` is a six-sigma jump that ordinary
minibatch noise does not reach; the relative floor keeps a near-constant loss (sigma ~ 0) from
spiking on rounding noise. The jump from the previous finite loss must itself be large: a loss that climbs smoothly
(a few percent a step, as a diverging run does) is ``train.diverging``, not a spike.
Host-side only (numpy), not jit-safe.
"""

from __future__ import annotations

import numpy as np

from .._core.finding import Finding
from .._core.history import History
from .._precision.underflow import underflow_finding

MAD_TO_SIGMA = 1.4826


def spike_steps(
    loss, *, window: int = 50, k: float = 6.0, rel: float = 0.5, min_history: int = 10
) -> list[tuple[int, float, float]]:
    """Indices into ``loss`` that spike, as ``(index, loss, level)`` where level is the robust threshold it
    crossed. Every finite loss enters the baseline of later steps (medians shrug off a few spikes, and a
    lasting level shift stops counting once it fills half of the last ``min_history`` steps). Host-side, not
    jit-safe."""
    values = np.asarray(loss, dtype=np.float64)
    base: list[float] = []
    out = []
    for i, v in enumerate(values):
        if not np.isfinite(v):
            continue
        recent = np.asarray(base[-window:])
        if recent.size >= min_history:
            level = float(np.median(recent[-min_history:]))
            sigma = MAD_TO_SIGMA * float(np.median(np.abs(np.diff(recent)))) / np.sqrt(2.0)
            margin = max(k * sigma, rel * abs(level))
            threshold = level + margin
            if v > threshold and v - base[-1] > margin / 2:
                out.append((i, float(v), threshold))
        base.append(float(v))
    return out


def check_loss_spikes(
    h: History, *, window: int = 50, k: float = 6.0, rel: float = 0.5, min_history: int = 10
) -> list[Finding]:
    """``train.loss_spike`` for the recorded steps whose loss spiked (one finding, the worst step first; every
    spike in ``extra["spikes"]``). Host-side, not jit-safe."""
    spikes = spike_steps(h.loss, window=window, k=k, rel=rel, min_history=min_history)
    if not spikes:
        return []
    worst = max(spikes, key=lambda s: s[1] / max(s[2], 1e-30))
    i, value, level = worst
    step = h.steps[i]
    more = f"; {len(spikes)} spiking steps in all: {[h.steps[j] for j, _, _ in spikes][:8]}" if len(spikes) > 1 else ""
    return [
        Finding(
            "train.loss_spike",
            f"the train loss spiked at step {step}: {value:.4g}, above its recent robust level {level:.4g} "
            f"(recent median + {k:g} robust sigmas of the step-to-step noise){more}",
            "look at that step's batch (fit(on_spike='rollback') keeps it, names the examples that carry the "
            "gradient and skips it); for corrupt data drop the examples; for an Adam second-moment lag raise eps "
            "(1e-8 -> 1e-6) or lower beta2 (0.999 -> 0.95); clip the gradient norm (optax.clip_by_global_norm)",
            step=step,
            extra={"spikes": [{"step": h.steps[j], "loss": v, "level": lv} for j, v, lv in spikes], "k": k},
        )
    ]


def check_update_underflow(h: History, fraction: float = 0.25) -> list[Finding]:
    """``train.update_underflow`` when a bf16/fp16 leaf's median fraction of lost updates (over the sampled
    steps) is at least ``fraction``; names every such leaf, the worst first. Host-side, not jit-safe."""
    lost = h.arrays("update_lost")
    if lost.size == 0:
        return []
    with np.errstate(all="ignore"):
        med = np.array(
            [float(np.median(c[np.isfinite(c)])) if np.isfinite(c).any() else np.nan for c in lost.T],
        )
    found = underflow_finding(
        h.leaf_paths, [float(m) for m in med], len(lost), fraction, step=h.lost_steps[-1] if h.lost_steps else None
    )
    return [found] if found is not None else []
