"""The overfit sweep's grid: its configurations (seed x learning rate or update scale x init scale, then the
constant-input baseline), what the step reports, where the optimizer holds its rate, and the setup's findings.
Host-side planning; nothing here is jit-safe."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import jax
import numpy as np

from .._core.errors import ArgumentError, DataError
from .._core.finding import Finding
from .._core.tree import PyTree
from .._experiment.batches import count_examples
from .._experiment.contract import Experiment, PureExperiment
from .._jaxpr.compile_level import program_cost
from .budget import budget_configurations, scaled_rates
from .result import OverfitConfig
from .setup import (
    budget_seeds,
    constant_input_batch,
    current_learning_rate,
    learning_rate_paths,
)
from .verdict import targets_follow_inputs


def as_seeds(seeds: int | Sequence[int]) -> list[int]:
    if isinstance(seeds, (int, np.integer)):
        if seeds < 1:
            raise ArgumentError(f"[jaxsane] overfit(seeds=...) must be >= 1, got {seeds}. Fix: pass seeds=1 or more.")
        return list(range(int(seeds)))
    out = [int(s) for s in seeds]
    if not out:
        raise ArgumentError("[jaxsane] overfit(seeds=...) is empty. Fix: pass a count or a list of ints.")
    return out


@dataclasses.dataclass
class Grid:
    """The configurations of the sweep (seed x learning rate x init scale, then the baseline if any), what
    the step reports, where the optimizer state holds its injectable learning rate, and the findings of
    the setup (``overfit.budget``, ``overfit.no_lr_sweep``)."""

    example: PyTree  # one pure state: the abstract shapes of every configuration's
    step_reports_loss: bool
    seed_list: list[int]
    lr_paths: set
    default_lr: float | None
    configs: list[OverfitConfig]
    findings: list[Finding]
    scaled: bool = False  # the configurations sweep factors on the step's updates (update_scale.py)

    @property
    def n_real(self) -> int:
        return sum(not c.baseline for c in self.configs)

    @classmethod
    def build(
        cls,
        adapted: PureExperiment,
        batch: PyTree,
        seeds: int | Sequence[int] | None,
        learning_rates: Sequence[float] | None,
        scales: list[float],
        steps: int,
        update_scales: Sequence[float] | None = None,
        budget_flops: float | None = None,
        baseline: bool = True,
    ) -> Grid:
        example = adapted.example_state
        findings: list[Finding] = []
        step_jaxpr, (_, metrics_shape) = jax.make_jaxpr(adapted.step, return_shape=True)(example, batch)
        lr_paths = set(learning_rate_paths(example))
        default_lr = current_learning_rate(example) if lr_paths else None
        multipliers: tuple[float, ...] = (0.1, 1.0, 10.0)
        if seeds is None and budget_flops is not None and learning_rates is None:  # doctor's planned budget
            per_config = program_cost(step_jaxpr).flops * steps * len(scales)
            chosen = budget_configurations(
                per_config,
                budget_flops,
                sweeps_lr=default_lr is not None,
                baseline=baseline,
                examples=count_examples(adapted.experiment, batch),
                steps=steps,
            )
            seeds, multipliers = chosen.seeds, chosen.multipliers
            findings += [chosen.finding] if chosen.finding is not None else []
        elif seeds is None:  # as many as the model's size affords
            seeds, budget = budget_seeds(step_jaxpr, steps)
            findings += [budget] if budget is not None else []
        seed_list = as_seeds(seeds)
        lrs: list[float | None]
        if update_scales is not None:  # the rate is the step's own; the factor on its updates is swept
            configs = [
                OverfitConfig(s, None, sc, update_scale=float(k))
                for s, k, sc in itertools.product(seed_list, update_scales, scales)
            ]
            reports = "loss" in metrics_shape
            return cls(example, reports, seed_list, lr_paths, default_lr, configs, findings, scaled=True)
        if default_lr is not None:  # found exactly when lr_paths is not empty
            lrs = (
                list(scaled_rates(default_lr, multipliers))
                if learning_rates is None
                else [float(x) for x in learning_rates]
            )
        else:
            lrs = [None]
            findings.append(
                Finding(
                    "overfit.no_lr_sweep",
                    "learning rates were not swept: the optimizer state holds no optax.inject_hyperparams "
                    "'learning_rate'"
                    + (f" (asked for {list(learning_rates)})" if learning_rates else "")
                    + f"; swept {len(seed_list)} seed(s) x {len(scales)} init scale(s) at the step's own rate (and, "
                    "when that fits nothing, with the step's updates scaled as larger rates)",
                    "build the optimizer as optax.inject_hyperparams(optax.adam)(learning_rate=...) so the sweep can "
                    "set the rate per configuration",
                )
            )
        configs = [OverfitConfig(s, lr, sc) for s, lr, sc in itertools.product(seed_list, lrs, scales)]
        reports = "loss" in metrics_shape
        return cls(example, reports, seed_list, lr_paths, default_lr, configs, findings)


def add_baseline(grid: Grid, exp: Experiment, batch: PyTree) -> tuple[PyTree | None, str | None]:
    """``(constant-input batch, None)`` with the baseline configuration added to ``grid``, or ``(None, why
    not)`` when the targets follow the inputs (``(None, None)`` when the inputs cannot be replaced)."""
    try:
        const_batch = constant_input_batch(exp, batch)
    except DataError:
        return None, None
    baseline_reason = targets_follow_inputs(exp, batch, const_batch)
    if baseline_reason is not None:
        return None, baseline_reason
    if grid.scaled:
        grid.configs.append(OverfitConfig(grid.seed_list[0], None, 1.0, baseline=True, update_scale=grid.default_lr))
    else:
        grid.configs.append(OverfitConfig(grid.seed_list[0], grid.default_lr, 1.0, baseline=True))
    return const_batch, None
