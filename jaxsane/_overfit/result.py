"""The result of :func:`jaxsane.overfit`: :class:`OverfitConfig` (one seed x learning rate x init
scale) and :class:`OverfitResult` (the loss curves, verdicts and findings of every configuration,
its table, and a matplotlib plot of the curves).

Not jit-safe: these are host-side records.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from .._core.finding import Finding
from .verdict import best_configuration


class OverfitConfig(NamedTuple):
    """One configuration of the sweep. ``baseline`` marks the constant-input run."""

    seed: int
    learning_rate: float | None
    init_scale: float
    baseline: bool = False
    update_scale: float | None = None  # the step's own rate, its parameter updates scaled by this

    def rate_text(self) -> str:
        """The learning rate in words: ``0.01``, ``default`` or ``default x10 (updates scaled)``."""
        if self.update_scale is not None:
            return f"default x{self.update_scale:g} (updates scaled)"
        return "default" if self.learning_rate is None else f"{self.learning_rate:.3g}"

    def label(self) -> str:
        lr = f"lr={self.rate_text()}"
        text = f"seed={self.seed} {lr} scale={self.init_scale:g}"
        return text + " (constant input)" if self.baseline else text


@dataclasses.dataclass(frozen=True, repr=False)
class OverfitResult:
    """The outcome of :func:`overfit`. Not a pytree; everything lives on the host as numpy.

    Attributes:
      configs: the :class:`OverfitConfig` of each row (the baseline, if any, is last).
      losses: float array ``[configs, steps_run]``, the loss the step reported at each step.
      accuracy: per-configuration per-example accuracy on the batch after the last step, or None
        when the Experiment has no ``apply`` or no integer labels.
      reached: bool ``[configs]``, whether the configuration reached the target.
      reached_at: int ``[configs]``, the first step that met the target (-1 when never).
      verdicts: per configuration ``"fits"`` (reached the target), ``"floor"`` (converged to a floor above
        0 after falling by at least half), ``"high_floor"``, ``"unsettled"`` (still falling), ``"fails"``
        (hardly moved), ``"unbounded"`` (falls without bound below 0), ``"diverged"`` or ``"baseline"``
        (see ``_overfit/verdict.py``).
      findings: ``overfit.failed``, ``overfit.unsettled``, ``overfit.floor``, ``model.ignores_input``,
        ``overfit.best``, ``overfit.no_lr_sweep``.
      target: the loss target as a fraction of each configuration's initial loss.
      target_accuracy: the accuracy target, or None when accuracy is not measured.
      steps_run: steps actually run (early exit stops at a chunk boundary).
      max_steps: the step budget.
      compiles: how many times the sweep program was traced (1 for a sweep).
      seconds: wall time of the sweep: initial states, compile and run.
      compile_seconds: time spent tracing and compiling (in a background thread, overlapping the
        initial states).
      groups: how many equal groups of configurations ran the compiled program side by side.
      time_cut: the sweep's time limit in seconds when it stopped the run before its steps (doctor's guard,
        ``overfit(..., time_limit=...)``), else None.
      out_of_reach: the sweep stopped before its time limit was up: at its pace no configuration could reach the
        target before it (``time_guard.py``: ``Reach``).
      lr_swept: whether learning rates were set per configuration.
      batch_size: examples in the overfit batch.
    """

    configs: tuple[OverfitConfig, ...]
    losses: np.ndarray
    accuracy: np.ndarray | None
    reached: np.ndarray
    reached_at: np.ndarray
    verdicts: tuple[str, ...]
    findings: tuple[Finding, ...]
    target: float
    target_accuracy: float | None
    steps_run: int
    max_steps: int
    compiles: int
    seconds: float
    lr_swept: bool
    batch_size: int
    compile_seconds: float = float("nan")
    groups: int = 1
    time_cut: float | None = None
    out_of_reach: bool = False

    # -- derived
    @property
    def ok(self) -> bool:
        """True when no error finding was raised (some configuration fits, inputs matter)."""
        return not any(f.severity == "error" for f in self.findings)

    @property
    def initial_loss(self) -> np.ndarray:
        return self.losses[:, 0]

    @property
    def final_loss(self) -> np.ndarray:
        return self.losses[:, -1]

    @property
    def real(self) -> np.ndarray:
        """Indices of the real-input configurations."""
        return np.array([i for i, c in enumerate(self.configs) if not c.baseline], dtype=int)

    @property
    def baseline(self) -> int | None:
        """Index of the constant-input baseline, or None."""
        return next((i for i, c in enumerate(self.configs) if c.baseline), None)

    @property
    def best(self) -> int:
        """Index of the best real configuration: earliest to reach the target, else the best verdict with
        the lowest loss ratio."""
        return best_configuration(self, self.verdicts)

    @property
    def codes(self) -> list[str]:
        return [f.code for f in self.findings]

    # -- rendering
    def table(self) -> str:
        """A plain-text table, one row per configuration. Host-side, not jit-safe."""
        head = ["#", "seed", "lr", "scale", "input", "loss[0]", "loss[-1]", "ratio", "acc", "reached@", "verdict"]
        rows = []
        for i, c in enumerate(self.configs):
            init, fin = self.losses[i, 0], self.losses[i, -1]
            ratio = fin / init if np.isfinite(init) and init != 0 else float("nan")
            rows.append(
                [
                    str(i),
                    str(c.seed),
                    c.rate_text(),
                    f"{c.init_scale:g}",
                    "constant" if c.baseline else "real",
                    f"{init:.4g}",
                    f"{fin:.4g}",
                    f"{ratio:.3g}",
                    "-" if self.accuracy is None else f"{self.accuracy[i]:.0%}",
                    str(self.reached_at[i]) if self.reached_at[i] >= 0 else "-",
                    self.verdicts[i],
                ]
            )
        widths = [max(len(r[j]) for r in [head, *rows]) for j in range(len(head))]
        line = lambda r: "  ".join(x.rjust(w) for x, w in zip(r, widths))  # noqa: E731
        target = f"loss <= {self.target:g} x initial"
        if self.target_accuracy is not None:
            target += f" or accuracy >= {self.target_accuracy:.0%}"
        out = [
            f"overfit sweep: {len(self.configs)} configurations, batch of {self.batch_size}, "
            f"{self.steps_run}/{self.max_steps} steps, target {target}, {self.compiles} compile(s), "
            f"{self.seconds:.2f}s ({self.compile_seconds:.2f}s compiling"
            + (f", {self.groups} groups in parallel)" if self.groups > 1 else ")"),
            line(head),
            line(["-" * w for w in widths]),
            *map(line, rows),
        ]
        out += [str(f) for f in self.findings]
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        fits = int(np.sum(self.reached[self.real])) if len(self.real) else 0
        return (
            f"OverfitResult({len(self.configs)} configs, {fits}/{len(self.real)} fit, steps_run={self.steps_run}, "
            f"codes={self.codes})"
        )

    def _repr_html_(self) -> str:
        from .._render.reprs import overfit_html

        return overfit_html(self)

    def plot(self, ax: Any = None):
        """Loss against step for every configuration (log scale); returns the matplotlib Figure. Not jit-safe.

        Curves are coloured by learning rate (a sequential colormap, low to high; the optimizer's own
        rate in black), dashed when the init scale is not 1; the default configuration (the optimizer's
        rate at scale 1) is drawn thickest, on top. Each curve's target, the verdict's criterion
        ``target x its own initial loss``, is a dotted tick at the right end in the curve's colour. The
        legend sits outside the axes, one entry per learning rate and per init scale.
        """
        from matplotlib.lines import Line2D

        from .._render.plots import MAX_ENTRIES, OTHERS, colours, integer_steps, legend_outside, new_figure, no_finite

        if ax is None:
            fig = new_figure(8.0, 4.2)
            ax = fig.add_subplot()
        else:
            fig = ax.figure
        steps = np.arange(self.losses.shape[1])
        real = list(self.real)
        rates = sorted({c.learning_rate for c in (self.configs[i] for i in real) if c.learning_rate is not None})
        pick = colours(len(rates), "plasma")
        colour = {None: "black", **{r: pick(k) for k, r in enumerate(rates)}}
        if len(rates) > MAX_ENTRIES:  # colours for the extreme and middle rates only in the legend
            keep = set(np.linspace(0, len(rates) - 1, MAX_ENTRIES).round().astype(int).tolist())
        else:
            keep = set(range(len(rates)))
        tail = max(1, len(steps) // 8)
        for i in real:
            c = self.configs[i]
            default = c.learning_rate is None and c.init_scale == 1
            ax.plot(
                steps,
                self.losses[i],
                color=colour[c.learning_rate],
                ls="-" if c.init_scale == 1 else "--",
                lw=2.6 if default else 1.2,
                alpha=1.0 if default or self.reached[i] else 0.6,
                zorder=4 if default else 2,
            )
            start = self.losses[i, 0]
            if np.isfinite(start) and start > 0:
                goal = self.target * start
                (line,) = ax.plot(
                    steps[-tail:],
                    np.full(len(steps[-tail:]), goal),
                    color=colour[c.learning_rate],
                    ls=":",
                    lw=1.5,
                    zorder=3,
                )
                line.set_gid(f"target-{i}")
        handles = [Line2D([], [], color=colour[r], lw=2, label=f"lr={r:.3g}") for k, r in enumerate(rates) if k in keep]
        if any(self.configs[i].learning_rate is None for i in real):
            handles.insert(0, Line2D([], [], color="black", lw=2.6, label="optimizer's lr (default)"))
        scales = sorted({self.configs[i].init_scale for i in real})
        if len(scales) > 1:
            handles += [
                Line2D([], [], color=OTHERS, ls="-" if s == 1 else "--", label=f"init scale x{s:g}") for s in scales
            ]
        handles.append(
            Line2D([], [], color="grey", ls=":", lw=1.5, label=f"target: {self.target:g} x each curve's initial loss")
        )
        if self.baseline is not None:
            ax.plot(steps, self.losses[self.baseline], color="red", ls="--", lw=1.5, zorder=3)
            handles.append(Line2D([], [], color="red", ls="--", lw=1.5, label="constant-input baseline"))
        finite = self.losses[np.isfinite(self.losses) & (self.losses > 0)]
        if finite.size:
            ax.set_yscale("log")
        else:
            no_finite(ax, "overfit loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss on the overfit batch")
        integer_steps(ax)
        ax.grid(alpha=0.3)
        verdict = "FAILED" if "overfit.failed" in self.codes else "ok"
        ax.set_title(f"overfit one batch ({self.batch_size} examples, {len(real)} configurations): {verdict}")
        legend_outside(
            ax, more=len(rates) - len(keep), handles=handles, more_text="and {n} more learning rates between"
        )
        return fig
