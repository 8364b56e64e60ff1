"""How many overfit configurations a model affords: seeds and learning rates within a flop budget.

doctor passes the sweep a budget in flops (``_doctor/budget.py`` derives it from the user's own step: a
number of the user's steps). :func:`budget_configurations` keeps the grid (2 seeds x the learning rates
0.1, 1 and 10 x the optimizer's rate) when it fits and otherwise drops, in this order, the second seed, the
lowest rate (0.1x: the one least able to fit a batch within the steps) and the highest (10x), never below
one seed at the optimizer's own rate; an ``overfit.budget`` info finding says what was dropped and why.
From flops counted in the step's jaxpr, so the plan is deterministic. Not jit-safe (host only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .._core.finding import Finding
from .result import OverfitResult

LR_MULTIPLIERS = (0.1, 1.0, 10.0)

# the grids tried in order, largest first: (seeds, learning-rate multipliers)
_LADDER: tuple[tuple[int, tuple[float, ...]], ...] = (
    (2, LR_MULTIPLIERS),
    (1, LR_MULTIPLIERS),
    (1, (1.0, 10.0)),
    (1, (1.0,)),
)


class ConfigurationBudget(NamedTuple):
    """The grid chosen: ``seeds`` (a count), ``multipliers`` of the optimizer's rate, and the finding that
    says what was dropped (None when nothing was)."""

    seeds: int
    multipliers: tuple[float, ...]
    finding: Finding | None


def budget_configurations(
    config_flops: float, budget_flops: float, *, sweeps_lr: bool, baseline: bool, examples: int, steps: int
) -> ConfigurationBudget:
    """The largest grid of :data:`_LADDER` whose configurations (plus the constant-input baseline when
    ``baseline``) cost at most ``budget_flops``, at ``config_flops`` a configuration (one step on the
    overfit batch x ``steps``). ``sweeps_lr``: the optimizer's rate can be set per configuration (otherwise
    only seeds are swept). Deterministic. Not jit-safe."""
    ladder = _LADDER if sweeps_lr else ((2, (1.0,)), (1, (1.0,)))
    chosen = ladder[-1]
    for seeds, multipliers in ladder:
        if (seeds * len(multipliers) + baseline) * config_flops <= budget_flops:
            chosen = (seeds, multipliers)
            break
    seeds, multipliers = chosen
    full_seeds, full_lrs = ladder[0]
    if chosen == ladder[0]:
        return ConfigurationBudget(seeds, multipliers, None)
    dropped = []
    if seeds < full_seeds:
        dropped.append(f"{full_seeds - seeds} seed(s)")
    missing = [m for m in full_lrs if m not in multipliers]
    if missing:
        dropped.append("learning rate(s) " + ", ".join(f"{m:g}x" for m in missing))
    n = seeds * len(multipliers)
    finding = Finding(
        "overfit.budget",
        f"the sweep ran {n} configuration(s) ({seeds} seed(s) x learning rate(s) "
        f"{', '.join(f'{m:g}x' for m in multipliers)} the optimizer's), not {full_seeds * len(full_lrs)}: one "
        f"configuration ({steps} steps on {examples} examples) is about {config_flops / 1e12:.2g} TFLOP, so the "
        f"whole grid{' with its constant-input baseline' if baseline else ''} would take "
        f"{(full_seeds * len(full_lrs) + baseline) * config_flops / 1e12:.2g} TFLOP of the sweep's "
        f"{budget_flops / 1e12:.2g}; it dropped {' and '.join(dropped)}",
        "to sweep the whole grid anyway, pass overfit_seeds=2 and overfit_learning_rates=... "
        "(jaxsane doctor -o overfit_seeds=2), or a larger --budget",
        extra={
            "config_flops": config_flops,
            "budget_flops": budget_flops,
            "seeds": seeds,
            "lr_multipliers": list(multipliers),
            "steps": steps,
        },
    )
    return ConfigurationBudget(seeds, multipliers, finding)


def scaled_rates(default_lr: float, multipliers: Sequence[float]) -> list[float]:
    """The swept learning rates: ``multipliers`` x the optimizer's own rate."""
    return [default_lr * m for m in multipliers]


def out_of_time(
    result: OverfitResult, limit: float, *, retry: bool = False, out_of_reach: bool = False
) -> list[Finding]:
    """Why a sweep that ran out of its ``limit`` seconds is not judged: an ``overfit.budget`` info finding and
    the ``doctor.skipped`` that stands in for its verdict (a curve cut short is no evidence that the model cannot
    fit). ``retry``: the sweep at the step's own rate ran all its steps without a fit, and the time left no room
    for the retry with scaled updates (``update_scale.py``); ``out_of_reach``: it stopped before its time was up,
    when at its pace no configuration could reach the target before the limit. Not jit-safe."""
    if retry:
        what = (
            f"at the step's own rate no configuration fit in {result.steps_run} steps, and the sweep's time limit "
            f"({limit:.0f} s) left no room for the retry with larger updates"
        )
    elif out_of_reach:
        what = (
            f"the sweep stopped after {result.steps_run} of {result.max_steps} steps, before any configuration "
            f"fit: at the pace of its latest steps none would reach the target within its time limit ({limit:.0f} s)"
        )
    else:
        what = (
            f"the sweep stopped at its time limit ({limit:.0f} s) after {result.steps_run} of {result.max_steps} "
            "steps, before any configuration fit"
        )
    fix = (
        "give the sweep more time (jaxsane doctor -o overfit_seconds=SECONDS, 0 for no limit), or build the "
        "optimizer with optax.inject_hyperparams so that the sweep can try larger rates itself"
    )
    extra = {"time_limit": limit, "steps_run": result.steps_run, "max_steps": result.max_steps,
             "out_of_reach": out_of_reach}  # fmt: skip
    return [
        Finding("overfit.budget", what, fix, extra=extra),
        Finding("doctor.skipped", "overfit not judged: a curve cut short is no evidence that a model cannot fit", fix),
    ]
