"""Overfit one small batch: many configurations of the user's own step in ONE compiled program.

Every configuration (seed x learning rate x init scale, plus one constant-input baseline) is a
slice of a ``jax.vmap``-ed train state; the steps run in a ``lax.scan`` of ``chunk`` steps inside a
``lax.while_loop`` that stops once every real configuration has reached the target (the engine is
in ``_sweep.py``). The whole sweep is traced and compiled once, runs without any host round trip
between chunks, and works on CPU, GPU or TPU alike. It is Karpathy's "overfit one batch" sanity
check ("A Recipe for Training Neural Networks"), run for a whole grid at once.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._core.errors import DataError, ExperimentError, JaxsaneError
from .._core.finding import Finding
from .._core.tree import PyTree, host_leaf, leaf_selector as _selector, scale_selected as _scale_params
from .._core.validate import require_bool, require_count_or_list, require_float, require_int, require_sequence
from .._experiment.batches import first_batch, slice_examples
from .._experiment.contract import Experiment, PureExperiment, require_experiment
from .._render.progress import Progress
from .result import OverfitConfig, OverfitResult
from .setup import (
    accuracy_fn,
    budget_seeds,
    constant_input_batch,
    current_learning_rate,
    host_prepare_plan,
    inputs_or_none,
    learning_rate_paths,
    set_learning_rate,
)
from .sweep import SweepSpec, compile_sweep, default_groups, group_layout, run_sweep, stack_states
from .verdict import batch_ceiling, judge, normalised_outputs, targets_follow_inputs

# ----------------------------------------------------------------------------- the sweep


def _as_seeds(seeds: int | Sequence[int]) -> list[int]:
    if isinstance(seeds, (int, np.integer)):
        if seeds < 1:
            raise JaxsaneError(f"[jaxsane] overfit(seeds=...) must be >= 1, got {seeds}.")
        return list(range(int(seeds)))
    out = [int(s) for s in seeds]
    if not out:
        raise JaxsaneError("[jaxsane] overfit(seeds=...) is empty; pass a count or a list of ints.")
    return out


def overfit(
    experiment: Experiment | PureExperiment,
    batch: PyTree | None = None,
    *,
    seeds: int | Sequence[int] | None = 4,
    learning_rates: Sequence[float] | None = None,
    init_scales: Sequence[float] | None = None,
    steps: int = 500,
    target: float = 0.01,
    target_accuracy: float = 1.0,
    batch_size: int = 16,
    baseline: bool = True,
    ignores_input_ratio: float = 0.5,
    chunk: int = 25,
    early_exit: bool = True,
    scale_leaves: str | Callable[[str], bool] | None = None,
    groups: int | None = None,
    progress: bool = True,
) -> OverfitResult:
    """Overfit one small batch with many configurations at once; return an :class:`OverfitResult`.

    Runs the user's own step (any style, through :class:`PureExperiment`) for every configuration
    ``seeds x learning_rates x init_scales`` plus one constant-input baseline, vmapped inside one
    compiled ``while_loop`` over chunks of ``chunk`` steps that exits once every real configuration
    has reached the target. On CPU the configurations are split into one equal group per core, each
    running the same compiled program in its own thread; the program compiles while the initial
    states are built (Karpathy, "A Recipe for Training Neural Networks": a healthy model
    drives the loss on one small batch to almost zero).

    Args:
      experiment: an :class:`Experiment` (or its :class:`PureExperiment` view).
      batch: the batch to overfit (default: the first ``batch_size`` examples of the train data).
      seeds: a number of seeds (``0..seeds-1``) or a list of seeds; each seed is ``init(jax.random.key(seed))``.
        None (doctor's default): 2, or 1 for a model whose one configuration (one step's flops x ``steps``)
        would cost more than 3e10 flops on the CPU, 3e13 on GPU/TPU; an ``overfit.budget`` info finding says so.
      learning_rates: learning rates to try. They need an optimizer built with
        ``optax.inject_hyperparams`` (the rate is then set per configuration in the optimizer state);
        default ``(0.1, 1, 10) x`` the state's rate. Without injectable hyperparameters only seeds are
        swept and an ``overfit.no_lr_sweep`` info finding says so.
      init_scales: multipliers applied to the initial parameters (default ``(1.0,)``).
      steps: step budget per configuration (rounded up to a multiple of ``chunk``).
      target: a configuration fits when its loss falls to ``target`` x its initial loss (default 1%).
      target_accuracy: ... or when its per-example accuracy on the batch reaches this value (default
        100%; only measured when the Experiment has ``apply`` and integer labels).
      batch_size: examples taken from the train data when ``batch`` is None (default 16).
      baseline: add the constant-input baseline configuration (seed of the first config, default
        learning rate, scale 1) to the same vmap.
      ignores_input_ratio: ``model.ignores_input`` when no real configuration fits and the best real
        final loss is above ``ignores_input_ratio`` x the baseline's final loss (default 0.5: real
        inputs must fit at least twice as well as constant ones).
      chunk: steps per compiled scan between early-exit checks (default 25).
      early_exit: stop once every real configuration has reached the target.
      scale_leaves: which parameter leaves ``init_scales`` multiplies: None (all float leaves), a regex
        searched in the leaf path (``params['dense_0']['kernel']``), or ``callable(path) -> bool``.
      groups: split the configurations into this many equal vmapped groups that run the same compiled
        program side by side in host threads. Default: one per CPU core on the CPU backend (XLA:CPU
        runs a small vmapped program on one core), one on GPU/TPU. Results do not depend on it.
      progress: show progress on stderr (a spinner on a terminal, plain lines otherwise; doctor shows its own).

    Returns:
      An :class:`OverfitResult` (losses ``[configs, steps]``, verdicts, ``.table()``, ``.plot()``,
      ``.findings``).

    Raises:
      ExperimentError: the step reports no ``"loss"`` and the Experiment has no ``loss``.

    Not jit-safe (it compiles and runs its own program).

    Example:
      >>> from jaxsane.examples import load
      >>> result = overfit(load("digits_optax"), seeds=2, steps=100)  # doctest: +SKIP
      >>> result.ok  # doctest: +SKIP
      True
    """
    return plan_overfit(
        experiment,
        batch,
        seeds=seeds,
        learning_rates=learning_rates,
        init_scales=init_scales,
        steps=steps,
        target=target,
        target_accuracy=target_accuracy,
        batch_size=batch_size,
        baseline=baseline,
        ignores_input_ratio=ignores_input_ratio,
        chunk=chunk,
        early_exit=early_exit,
        scale_leaves=scale_leaves,
        groups=groups,
        progress=progress,
    ).run()


class OverfitPlan(NamedTuple):
    """A planned sweep: ``compile()`` -> ``(compiled program, seconds)`` (safe in a background thread);
    ``run(precompiled=None)`` -> :class:`OverfitResult` (``precompiled``: a future of ``compile()``)."""

    compile: Callable[[], tuple[Any, float]]
    run: Callable[..., OverfitResult]


def plan_overfit(
    experiment: Experiment | PureExperiment,
    batch: PyTree | None = None,
    *,
    seeds: int | Sequence[int] | None = 4,
    learning_rates: Sequence[float] | None = None,
    init_scales: Sequence[float] | None = None,
    steps: int = 500,
    target: float = 0.01,
    target_accuracy: float = 1.0,
    batch_size: int = 16,
    baseline: bool = True,
    ignores_input_ratio: float = 0.5,
    chunk: int = 25,
    early_exit: bool = True,
    scale_leaves: str | Callable[[str], bool] | None = None,
    groups: int | None = None,
    progress: bool = True,
) -> OverfitPlan:
    """Everything :func:`overfit` does before compiling: arguments checked, configurations, the step and
    target of the sweep. Returns an :class:`OverfitPlan` whose ``compile`` may be started early (in a
    background thread) and whose ``run`` compiles (unless given the compiled program), runs and judges.
    Not jit-safe."""
    fn = "overfit"
    require_experiment(fn, experiment)
    if seeds is not None:
        require_count_or_list(fn, "seeds", seeds)
    require_sequence(fn, "learning_rates", learning_rates, min=0.0, optional=True)
    require_sequence(fn, "init_scales", init_scales, min=0.0, optional=True)
    require_int(fn, "steps", steps, min=1)
    require_int(fn, "chunk", chunk, min=1)
    require_int(fn, "batch_size", batch_size, min=1)
    require_int(fn, "groups", groups, optional=True)
    require_float(fn, "target", target)
    require_float(fn, "target_accuracy", target_accuracy, min=0.0, max=1.0)
    require_float(fn, "ignores_input_ratio", ignores_input_ratio, positive=True)
    require_bool(fn, "baseline", baseline)
    require_bool(fn, "early_exit", early_exit)
    require_bool(fn, "progress", progress)
    _selector(scale_leaves)  # None, a regex string or a callable; raises a JaxsaneError otherwise
    adapted = experiment if isinstance(experiment, PureExperiment) else PureExperiment(experiment)
    exp = adapted.experiment
    if not 0 < target < 1:
        raise JaxsaneError(f"[jaxsane] overfit(target=...) is a fraction of the initial loss in (0, 1), got {target}.")
    if steps < 1 or chunk < 1:
        raise JaxsaneError(f"[jaxsane] overfit needs steps >= 1 and chunk >= 1, got steps={steps}, chunk={chunk}.")
    if batch is None:
        batch = slice_examples(exp, first_batch(exp.train, "train"), batch_size)  # raises on an uncuttable batch
    batch = jax.tree_util.tree_map(host_leaf, batch)  # host numpy: no per-leaf eager XLA compiles
    from .._experiment.batches import count_examples

    n_examples = count_examples(exp, batch)
    scales = [1.0] if init_scales is None else [float(s) for s in init_scales]
    if not scales:
        raise JaxsaneError("[jaxsane] overfit(init_scales=...) is empty.")

    example = adapted.example_state
    findings: list[Finding] = []
    step_jaxpr, (_, metrics_shape) = jax.make_jaxpr(adapted.step, return_shape=True)(example, batch)
    if seeds is None:  # as many as the model's size affords
        seeds, budget = budget_seeds(step_jaxpr, steps)
        findings += [budget] if budget is not None else []
    seed_list = _as_seeds(seeds)
    lr_paths = set(learning_rate_paths(example))
    default_lr = current_learning_rate(example) if lr_paths else None
    if lr_paths:
        lrs = (
            [default_lr * m for m in (0.1, 1.0, 10.0)] if learning_rates is None else [float(x) for x in learning_rates]
        )
    else:
        lrs = [None]
        findings.append(
            Finding(
                "overfit.no_lr_sweep",
                "learning rates were not swept: the optimizer state holds no optax.inject_hyperparams "
                "'learning_rate'"
                + (f" (asked for {list(learning_rates)})" if learning_rates else "")
                + f"; swept {len(seed_list)} seed(s) x {len(scales)} init scale(s) at the step's own rate",
                "build the optimizer as optax.inject_hyperparams(optax.adam)(learning_rate=...) so the sweep can set "
                "the rate per configuration",
            )
        )

    configs = [OverfitConfig(s, lr, sc) for s, lr, sc in itertools.product(seed_list, lrs, scales)]
    n_real = len(configs)
    const_batch, baseline_reason = None, None
    if baseline:
        try:
            const_batch = constant_input_batch(exp, batch)
        except DataError:
            const_batch = None
        if const_batch is not None:
            baseline_reason = targets_follow_inputs(exp, batch, const_batch)
            if baseline_reason is not None:
                const_batch = None
        if const_batch is not None:
            configs.append(OverfitConfig(seed_list[0], default_lr, 1.0, baseline=True))

    # -- what the loss is: the step's reported loss, else Experiment.loss on the params before the step
    step_reports_loss = "loss" in metrics_shape
    loss_fn = adapted.loss_fn
    if not step_reports_loss and loss_fn is None:
        raise ExperimentError(
            "overfit needs a loss: the step's metrics have no 'loss' and the Experiment has no "
            "loss. Return {'loss': value} from the step or pass Experiment(loss=...)."
        )
    accuracy = accuracy_fn(adapted, adapted.params(example), batch)
    ceiling = batch_ceiling(exp, batch) if accuracy is not None else None
    if ceiling is not None:  # an ambiguous batch caps the reachable accuracy: ask for no more than it allows
        target_accuracy = min(target_accuracy, ceiling.accuracy - 1e-6)
    select = _selector(scale_leaves)

    host_plan = host_prepare_plan(adapted, example, select, lr_paths)

    def prepare(state, lr, scale):  # in the compiled program, only when the host cannot do it
        state = adapted.with_params(state, _scale_params(adapted.params(state), scale, select))
        return set_learning_rate(state, lr_paths, lr) if lr_paths else state

    def one_step(state, b):
        new_state, metrics = adapted.step(state, b)
        if step_reports_loss:
            loss = jnp.mean(jnp.asarray(metrics["loss"], jnp.float32))
        else:
            loss = jnp.asarray(loss_fn(adapted.params(state), b), jnp.float32)
        return new_state, loss

    spec = SweepSpec(
        one_step,
        None if host_plan is not None else prepare,
        None if accuracy is None else lambda s, b: accuracy(adapted.params(s), b),
        chunk=chunk,
        n_chunks=max(1, math.ceil(steps / chunk)),
        target=target,
        target_accuracy=target_accuracy,
    )
    n_groups = default_groups(n_real) if groups is None else int(groups)
    if n_groups < 1:
        raise JaxsaneError(f"[jaxsane] overfit(groups=...) must be >= 1 or None, got {groups}.")
    layout = group_layout(n_real, n_real if len(configs) > n_real else None, n_groups)
    seed_index = np.asarray([seed_list.index(c.seed) for c in configs])
    lr_values = np.asarray([np.nan if c.learning_rate is None else c.learning_rate for c in configs], np.float32)
    scale_values = np.asarray([c.init_scale for c in configs], np.float32)
    treedef = jax.tree_util.tree_structure(example)

    per_seed: list[list[Any]] = []

    def build_states(rows: np.ndarray):
        # one pure state per seed, built on the host (NNX init builds objects: not vmappable), once; stacked
        # leaf by leaf under the example's treedef (static metadata such as a linen TrainState's tx may differ
        # by identity between init calls)
        if not per_seed:
            per_seed.extend(jax.tree_util.tree_leaves(adapted.init(jax.random.key(s))) for s in seed_list)
        if any(len(leaves) != treedef.num_leaves for leaves in per_seed):
            raise ExperimentError(
                "init(key) returns states of different structure for different seeds; overfit "
                "stacks one state per seed, so init must build the same pytree for every key."
            )
        states = stack_states(per_seed, treedef, seed_index[rows])
        return states if host_plan is None else host_plan.apply(states, lr_values[rows], scale_values[rows])

    traces = [0]
    batch_for = lambda c: const_batch if configs[c].baseline else batch  # noqa: E731

    def compile_now() -> tuple[Any, float]:
        return compile_sweep(spec, layout, example_state=example, batch_for=batch_for, traces=traces)

    def run(precompiled: Any = None) -> OverfitResult:
        with warnings.catch_warnings(), Progress(progress, "overfit") as show:
            warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
            out = run_sweep(
                spec,
                layout,
                build_states=build_states,
                example_state=example,
                batch_for=batch_for,
                lrs=lr_values,
                scales=scale_values,
                real=np.asarray([not c.baseline for c in configs]),
                early_exit=early_exit,
                traces=traces,
                say=show.say,
                precompiled=precompiled,
            )
            show.say(
                f"{int(np.sum(out.reached_at[:n_real] >= 0))} of {n_real} configuration(s) fit in {out.steps_run} steps"
            )
        losses, reached_at, steps_run = out.losses, out.reached_at, out.steps_run
        acc_np = out.accuracy if accuracy is not None else None
        reached = reached_at >= 0
        result = OverfitResult(
            tuple(configs),
            losses,
            acc_np,
            reached,
            reached_at,
            (),
            (),
            target,
            target_accuracy if accuracy is not None else None,
            steps_run,
            spec.n_chunks * chunk,
            traces[0],
            out.seconds,
            bool(lr_paths),
            n_examples,
            out.compile_seconds,
            layout.groups,
        )
        params, inputs = adapted.params(example), inputs_or_none(exp, batch)
        verdicts, judged = judge(
            result,
            ceiling=ceiling,
            baseline_reason=baseline_reason,
            normalised=lambda: normalised_outputs(adapted.jitted("apply"), params, inputs),
            ignores_input_ratio=ignores_input_ratio,
        )
        result = dataclasses.replace(result, verdicts=verdicts)
        return dataclasses.replace(result, findings=(*findings, *judged))

    return OverfitPlan(compile_now, run)
