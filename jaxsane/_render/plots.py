"""Plots that read at any size: the run's panels (loss, gradient norms, update ratios, dead ReLUs) and the
helpers every jaxsane plot shares.

The shared rules: legends sit outside the axes, to the right, and list at most ``max_entries`` curves
(the most extreme ones, coloured; the rest are drawn thin and grey and summed up as "and N more"), so a
legend never covers a curve, a tick or a title; a panel whose values are all NaN/Inf says "no finite
values" instead of showing empty axes; step axes get integer ticks. Figures are built with
``matplotlib.figure.Figure`` (no pyplot state) and the constrained layout, which makes room for the
outside legend. Host-side only (not jit-safe); matplotlib is imported when a plot is drawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

MAX_ENTRIES = 12  # legend entries before "and N more"
OTHERS = "#b0b0b0"  # the colour of the curves beyond the legend


def new_figure(width: float = 7.5, height: float = 3.6):
    """A pyplot-free Figure with the constrained layout (room for a legend outside the axes)."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def colours(n: int, name: str = "viridis"):
    """``j -> colour`` over a sequential colormap, light end left out (readable on white)."""
    import matplotlib

    cmap = matplotlib.colormaps[name]
    return lambda j: cmap(0.85 * j / max(1, n - 1))


def legend_outside(
    ax: Any,
    more: int = 0,
    fontsize: float = 7,
    title: str | None = None,
    handles: Sequence[Any] | None = None,
    more_text: str = "and {n} more (grey)",
) -> None:
    """The axes' legend (or one of ``handles``) to the right of the axes, never over the curves, with
    "and N more" when ``more`` entries were left out of it."""
    entries: list[Any]
    if handles is None:
        entries, labels = ax.get_legend_handles_labels()
    else:
        entries, labels = list(handles), [h.get_label() for h in handles]
    if more:
        from matplotlib.lines import Line2D

        entries.append(Line2D([], [], color=OTHERS, lw=1))
        labels.append(more_text.format(n=more))
    if entries:
        ax.legend(
            entries,
            labels,
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            borderaxespad=0.0,
            fontsize=fontsize,
            title=title,
            title_fontsize=fontsize,
            frameon=False,
        )


def top_k(scores: Sequence[float], k: int = MAX_ENTRIES) -> set[int]:
    """Indices of the ``k`` largest finite scores (NaN last); all of them when there are at most ``k``."""
    values = np.asarray(scores, dtype=float)
    if len(values) <= k:
        return set(range(len(values)))
    order = np.argsort(np.where(np.isfinite(values), -values, np.inf), kind="stable")
    return set(int(i) for i in order[:k])


def integer_steps(ax: Any) -> None:
    """Integer ticks on the step axis (a run of one step gets no 0.25-step ticks)."""
    from matplotlib.ticker import FixedLocator, MaxNLocator

    lo, hi = ax.get_xlim()
    if hi - lo < 2:  # one step (or none): a single tick at it, not 0.25-step ticks around it
        c = int(round((lo + hi) / 2))
        ax.set_xlim(c - 1, c + 1)
        ax.xaxis.set_major_locator(FixedLocator([c]))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def no_finite(ax: Any, what: str) -> None:
    """Write "no finite values" over empty axes, with no meaningless ticks."""
    ax.text(
        0.5,
        0.5,
        f"no finite values: every {what} is NaN/Inf",
        transform=ax.transAxes,
        ha="center",
        va="center",
        fontsize=10,
        color="#b00020",
        wrap=True,
    )
    ax.set_yticks([])


def _finite(values: Any) -> np.ndarray:
    a = np.asarray(values, dtype=float)
    return a[np.isfinite(a)]


def _curves(
    ax: Any, steps: Sequence[int], ys: np.ndarray, labels: Sequence[str], positive: bool = True, **style: Any
) -> int:
    """One curve per column of ``ys`` (non-positive values hidden when ``positive``: a log axis); the ``MAX_ENTRIES``
    columns with the largest median are coloured and labelled, the rest grey. Returns how many are grey."""
    with np.errstate(all="ignore"):
        ys = np.where(ys > 0, ys, np.nan) if positive else np.asarray(ys, dtype=float)
        med = [np.nanmedian(ys[:, j]) if np.isfinite(ys[:, j]).any() else np.nan for j in range(ys.shape[1])]
    keep = top_k(med)
    pick = colours(len(keep))
    shown = 0
    for j in range(ys.shape[1]):
        if j in keep:
            ax.plot(steps, ys[:, j], color=pick(shown), label=labels[j], **style)
            shown += 1
        else:
            ax.plot(steps, ys[:, j], color=OTHERS, lw=0.8, alpha=0.8)
    return ys.shape[1] - len(keep)


def _finish(ax: Any, title: str, ylabel: str, more: int = 0, log: bool = True) -> None:
    if log and _finite([c for line in ax.get_lines() for c in line.get_ydata() if c > 0]).size:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    integer_steps(ax)
    ax.grid(alpha=0.3)
    legend_outside(ax, more)


def plot_losses(h: Any, skipped: Sequence[int] = ()):
    """Train loss per step (and its moving median) with eval loss; steps whose loss is NaN/Inf and
    batches a rollback skipped are marked with vertical lines. Returns a Figure or None."""
    if not h.loss and not h.eval_loss:
        return None
    fig = new_figure()
    ax = fig.add_subplot()
    loss = np.asarray(h.loss, dtype=float)
    finite = _finite([*h.loss, *h.eval_loss])
    if h.loss:
        ax.plot(
            h.steps, loss, color="#1f77b4", alpha=0.35, lw=1, marker="." if len(loss) < 30 else None, label="train loss"
        )
        w = max(1, len(loss) // 20)
        if w > 1:
            with np.errstate(all="ignore"):
                smooth = np.array(
                    [
                        np.nanmedian(loss[max(0, i - w) : i + 1])
                        if np.isfinite(loss[max(0, i - w) : i + 1]).any()
                        else np.nan
                        for i in range(len(loss))
                    ]
                )
            ax.plot(h.steps, smooth, color="#1f77b4", lw=2, label=f"train (moving median, {w})")
    if h.eval_loss:
        ax.plot(h.eval_steps, h.eval_loss, "o-", color="#d62728", lw=2, ms=4, label="eval loss")
    bad = [s for s, v in zip(h.steps, loss) if not np.isfinite(v)]
    for n, s in enumerate(bad):
        ax.axvline(
            s,
            color="#b00020",
            lw=1,
            alpha=0.6,
            label=f"NaN/Inf loss ({len(bad)} step{'s' if len(bad) != 1 else ''})" if n == 0 else None,
        )
    for n, s in enumerate(sorted(skipped)):
        ax.axvline(
            s,
            color="#ff7f0e",
            ls="--",
            lw=1.2,
            label=f"skipped batch ({len(skipped)}: {_few(sorted(skipped))})" if n == 0 else None,
        )
    if not finite.size:
        no_finite(ax, "loss")
    elif finite.min() > 0 and finite.max() / finite.min() > 50:
        ax.set_yscale("log")
    _finish(ax, "train and eval loss", "loss", log=False)
    return fig


def _few(xs: Sequence[int], n: int = 5) -> str:
    return ", ".join(map(str, xs[:n])) + (f", ... {len(xs) - n} more" if len(xs) > n else "")


def plot_grad_norms(h: Any):
    """Gradient norm per layer (kernels, input side first) over the sampled steps. Figure or None."""
    names, g = h.layer_grad_norms()
    if g.size == 0:
        return None
    fig = new_figure()
    ax = fig.add_subplot()
    more = _curves(ax, h.grad_steps, g, names, lw=1.5)
    if not _finite(np.where(g > 0, g, np.nan)).size:
        no_finite(ax, "gradient norm")
    _finish(ax, "gradient norm per layer (input side first)", "‖gradient‖", more)
    return fig


def plot_update_ratio(h: Any):
    """‖update‖/‖param‖ per kernel with the sane band. Figure or None."""
    p, u = h.arrays("param_norm"), h.arrays("update_norm")
    if p.size == 0:
        return None
    idx = [i for i in h.depth if i in set(h.weight_leaves)] or list(range(p.shape[1]))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = u[:, idx] / np.where(p[:, idx] > 0, p[:, idx], np.nan)
    fig = new_figure()
    ax = fig.add_subplot()
    labels = [h.leaf_paths[i] if i < len(h.leaf_paths) else str(i) for i in idx]
    more = _curves(ax, h.tele_steps, ratio, labels, lw=1.5)
    ax.axhspan(1e-5, 1e-1, color="green", alpha=0.06, label="sane band [1e-5, 1e-1]")
    if not _finite(np.where(ratio > 0, ratio, np.nan)).size:
        no_finite(ax, "update/parameter ratio")
    _finish(ax, "update / parameter norm ratio per kernel", "‖Δθ‖ / ‖θ‖", more)
    return fig


def plot_dead(h: Any):
    """Fraction of dead units per ReLU-family activation (labelled by layer), or None when the model has none."""
    d = h.arrays("dead_fraction")
    if d.size == 0 or d.shape[1] == 0:
        return None
    fig = new_figure(7.5, 3.0)
    ax = fig.add_subplot()
    labels = [h.relu_labels[j] if j < len(h.relu_labels) else f"ReLU #{j}" for j in range(d.shape[1])]
    more = _curves(ax, h.dead_steps, d, labels, positive=False, marker="o", ms=3)
    ax.axhline(0.7, color="#b00020", ls="--", lw=1, label="70% threshold")
    ax.set_ylim(-0.02, 1.02)
    if not _finite(d).size:
        no_finite(ax, "dead fraction")
    _finish(ax, "dead ReLU units (inactive on the whole batch)", "fraction dead", more, log=False)
    return fig
