"""Overfit one small batch: many configurations of the user's own step in ONE compiled program.

Every configuration (seed x learning rate x init scale, plus one constant-input baseline) is a
slice of a ``jax.vmap``-ed train state; the steps run in a ``lax.scan`` of ``chunk`` steps inside a
``lax.while_loop`` that stops once every real configuration has reached the target (the engine is
in ``sweep.py``). The whole sweep is traced and compiled once, runs without any host round trip
between chunks, and works on CPU, GPU or TPU alike. It is Karpathy's "overfit one batch" sanity
check ("A Recipe for Training Neural Networks"), run for a whole grid at once. This module plans the sweep
(arguments, configurations, the loss step) and runs it; not jit-safe (it compiles and runs its own program).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._core.errors import ArgumentError, ExperimentError
from .._core.tree import PyTree, host_leaf, leaf_selector as _selector, scale_selected as _scale_params
from .._core.validate import require_bool, require_count_or_list, require_float, require_int, require_sequence
from .._experiment.batches import count_examples, first_batch, slice_examples
from .._experiment.contract import Experiment, PureExperiment, require_experiment
from .._render.progress import Progress
from .budget import out_of_time
from .grid import Grid, add_baseline
from .result import OverfitResult
from .setup import (
    HostPrepare,
    accuracy_fn,
    accuracy_mismatch,
    host_prepare_plan,
    inputs_or_none,
    set_learning_rate,
)
from .sweep import SweepOutput, default_groups, group_layout, memory_groups, run_sweep, stack_states, state_bytes
from .sweep_compile import compile_sweep
from .sweep_program import SweepSpec, TraceCount
from .update_scale import UPDATE_SCALES, UpdateScaled, needs_scaled_updates, with_scaled_updates
from .verdict import Ceiling, batch_ceiling, judge, loss_fit_without_accuracy, normalised_outputs

# ----------------------------------------------------------------------------- the sweep


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
    time_limit: float | None = None,
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
        default ``(0.1, 1, 10) x`` the state's rate. Without injectable hyperparameters the step runs at its
        own rate (``overfit.no_lr_sweep``, info); when that fits nothing, the sweep runs again with the step's
        parameter updates scaled by 10, 100 and 1000 (a larger rate for SGD, momentum, Adam and most optax
        chains; ``overfit.update_scaled``, ``_overfit/update_scale.py``), and a loss that even those cannot
        move is not judged (``doctor.skipped``), never an error.
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
      time_limit: seconds its compiled runs may take, the scaled-update retry included (None: no limit); a sweep
        stopped before any fit (or once out of reach: ``time_guard.py``) is not judged, never an error.

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
    require_float("overfit", "time_limit", time_limit, positive=True, optional=True)
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
    ).run(time_limit=time_limit)


class OverfitPlan(NamedTuple):
    """A planned sweep: ``compile()`` -> ``(compiled program, seconds)`` (safe in a background thread);
    ``run(precompiled=None, time_limit=None)`` -> :class:`OverfitResult` (``precompiled``: a future of
    ``compile()``; ``time_limit``: :func:`overfit`'s)."""

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
    update_scales: Sequence[float] | None = None,
    budget_flops: float | None = None,
    memory_bytes: float | None = None,
    reference_batch: PyTree | None = None,
) -> OverfitPlan:
    """Everything :func:`overfit` does before compiling: arguments checked, configurations, the step and target
    of the sweep. Returns an :class:`OverfitPlan` whose ``compile`` may start early (in a background thread) and
    whose ``run(precompiled, time_limit)`` compiles (unless given the program), runs and judges. ``update_scales``:
    sweep these factors on the step's updates instead of rates, ending at the first fit (what ``run`` does itself
    when the rate cannot be set and its own fits nothing: ``update_scale.py``). doctor adds ``budget_flops``, the
    flops the sweep may take when ``seeds`` and ``learning_rates`` are left to it (fewer configurations, an
    ``overfit.budget`` finding), ``memory_bytes``, what the stacked states running at once may hold (more, smaller
    groups run in turns: ``sweep.py``), and ``reference_batch`` (:func:`_mismatch_check`). Not jit-safe."""
    options = {k: v for k, v in locals().items() if k not in ("experiment", "batch", "learning_rates")}
    _check_arguments(
        experiment,
        seeds=seeds,
        learning_rates=learning_rates,
        init_scales=init_scales,
        steps=steps,
        chunk=chunk,
        batch_size=batch_size,
        groups=groups,
        target=target,
        target_accuracy=target_accuracy,
        ignores_input_ratio=ignores_input_ratio,
        baseline=baseline,
        early_exit=early_exit,
        progress=progress,
        scale_leaves=scale_leaves,
    )
    adapted = experiment if isinstance(experiment, PureExperiment) else PureExperiment(experiment)
    if update_scales is not None:
        adapted = UpdateScaled(adapted)
    exp = adapted.experiment
    if batch is None:
        batch = slice_examples(exp, first_batch(exp.train, "train"), batch_size)  # raises on an uncuttable batch
    batch = jax.tree_util.tree_map(host_leaf, batch)  # host numpy: no per-leaf eager XLA compiles
    n_examples = count_examples(exp, batch)
    scales = [1.0] if init_scales is None else [float(s) for s in init_scales]
    if not scales:
        raise ArgumentError("[jaxsane] overfit(init_scales=...) is empty. Fix: pass None or a few multipliers.")
    grid = Grid.build(adapted, batch, seeds, learning_rates, scales, steps, update_scales, budget_flops, baseline)
    const_batch, baseline_reason = add_baseline(grid, exp, batch) if baseline else (None, None)
    one_step = _loss_step(adapted, grid.step_reports_loss)
    accuracy = accuracy_fn(adapted, adapted.params(grid.example), batch)
    ceiling = batch_ceiling(exp, batch) if accuracy is not None else None
    if ceiling is not None:  # an ambiguous batch caps the reachable accuracy: ask for no more than it allows
        target_accuracy = min(target_accuracy, ceiling.accuracy - 1e-6)
    seed, reports = grid.seed_list[0], grid.step_reports_loss  # can apply's accuracy judge? (found while compiling)
    mismatch = _mismatch_check(adapted, seed, batch, reports, reference_batch) if accuracy else None
    select = _selector(scale_leaves)
    host_plan = host_prepare_plan(adapted, grid.example, select, grid.lr_paths)
    spec = SweepSpec(
        one_step,
        None if host_plan is not None else _in_program_prepare(adapted, grid, select, update_scales is not None),
        None if accuracy is None else _on_state(adapted, accuracy),
        chunk=chunk,
        n_chunks=max(1, math.ceil(steps / chunk)),
        target=target,
        target_accuracy=target_accuracy,
        first_fit_ends=update_scales is not None,  # the rescue asks only whether some factor fits
    )
    layout = _layout(grid, groups, memory_bytes)
    sweep = _Sweep(
        adapted,
        grid,
        batch,
        const_batch,
        spec,
        layout,
        host_plan,
        _Judging(ceiling, baseline_reason, ignores_input_ratio, n_examples, accuracy is not None),
        early_exit=early_exit,
        progress=progress,
        mismatch=mismatch,
    )
    if grid.lr_paths or update_scales is not None or learning_rates is not None:
        return OverfitPlan(sweep.compile, sweep.run)
    # the rate cannot be set: if its own fits nothing, the same sweep (options: as given) with scaled updates, in the
    # time the first one left
    return OverfitPlan(sweep.compile, _with_retry(sweep, batch, {**options, "update_scales": UPDATE_SCALES}))


def _with_retry(sweep: _Sweep, batch: PyTree, options: dict[str, Any]) -> Callable[..., OverfitResult]:
    """``run(precompiled, time_limit)`` of a sweep at the step's own rate: when that fits nothing, the same sweep
    again with scaled updates (``plan_overfit(**options)``, on the same batch), in the time the first one left;
    with none left, the own-rate curve alone is not judged. Not jit-safe."""

    def run(precompiled: Any = None, time_limit: float | None = None) -> OverfitResult:
        first = sweep.run(precompiled, time_limit)
        left = _time_left(time_limit, first)
        if time_limit is not None and left is not None and left <= 0 and needs_scaled_updates(first):
            infos = [f for f in first.findings if f.severity == "info"]
            return dataclasses.replace(first, findings=(*infos, *out_of_time(first, time_limit, retry=True)))
        retry = lambda: plan_overfit(sweep.adapted, batch, **options).run(time_limit=left)  # noqa: E731
        return with_scaled_updates(first, retry)

    return run


def _time_left(limit: float | None, first: OverfitResult) -> float | None:
    """The seconds a retry's runs may take after ``first`` ran: the limit less what ``first`` took and less its
    compile again (the retry compiles a program of the same size); None without a limit."""
    if limit is None:
        return None
    return limit - first.seconds - (0.0 if math.isnan(first.compile_seconds) else first.compile_seconds)


def _layout(grid: Grid, groups: int | None, memory_bytes: float | None) -> Any:
    """The sweep's groups: one per core (or ``groups``), more and run in turns when their states exceed
    ``memory_bytes``."""
    n_groups = default_groups(grid.n_real) if groups is None else int(groups)
    if n_groups < 1:
        raise ArgumentError(f"[jaxsane] overfit(groups=...) must be >= 1 or None, got {groups}. Fix: pass None.")
    n_real, configs = grid.n_real, grid.configs
    n_groups, parallel = memory_groups(n_groups, len(configs), state_bytes(grid.example), memory_bytes)
    return group_layout(n_real, n_real if len(configs) > n_real else None, n_groups, parallel)


def _check_arguments(
    experiment: Any,
    *,
    seeds: Any,
    learning_rates: Any,
    init_scales: Any,
    steps: Any,
    chunk: Any,
    batch_size: Any,
    groups: Any,
    target: Any,
    target_accuracy: Any,
    ignores_input_ratio: Any,
    baseline: Any,
    early_exit: Any,
    progress: Any,
    scale_leaves: Any,
) -> None:
    """Raise the :class:`~jaxsane.ArgumentError` of a bad argument of :func:`jaxsane.overfit`, before any work."""
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
    if not 0 < target < 1:
        raise ArgumentError(
            f"[jaxsane] overfit(target=...) is a fraction of the initial loss in (0, 1), got {target}. "
            "Fix: pass e.g. target=0.05."
        )


def _loss_step(adapted: PureExperiment, step_reports_loss: bool) -> Callable[[PyTree, PyTree], tuple[PyTree, Any]]:
    """``(state, batch) -> (state, loss)`` of one configuration: the loss the step reports, else
    ``Experiment.loss`` on the parameters before the step. Jit-safe (it runs in the sweep program)."""
    loss_fn = adapted.loss_fn
    if not step_reports_loss and loss_fn is None:
        raise ExperimentError(
            "overfit needs a loss: the step's metrics have no 'loss' and the Experiment has no "
            "loss. Return {'loss': value} from the step or pass Experiment(loss=...)."
        )

    def one_step(state, b):
        new_state, metrics = adapted.step(state, b)
        # the loop's carry keeps the state's structure: a step that changes a non-array field each call (an
        # Equinox model's Python-int counter rides in the treedef) runs with the field as init made it
        # (step.recompiles reports such a step); the arrays are the step's own
        new_state = jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(state), jax.tree_util.tree_leaves(new_state)
        )
        if step_reports_loss:
            loss = jnp.mean(jnp.asarray(metrics["loss"], jnp.float32))
        else:
            assert loss_fn is not None  # checked above: a step without a loss needs Experiment.loss
            loss = jnp.asarray(loss_fn(adapted.params(state), b), jnp.float32)
        return new_state, loss

    return one_step


def _mismatch_check(
    adapted: PureExperiment, seed: int, batch: PyTree, reports: bool, reference_batch: PyTree | None
) -> concurrent.futures.Future | _Deferred:
    """Whether apply's accuracy can judge the fit (``setup.accuracy_mismatch``), as a future: on the overfit batch
    in a thread while the sweep compiles, or, given a ``reference_batch`` the caller runs the user's step and apply
    on anyway (doctor's first train batch), there once the sweep runs: on the overfit batch it compiles the user's
    step once more at that batch's shape (a full compile: 10 s of a 3.5M-parameter CNN's on 2 cores). Not jit-safe."""
    if reference_batch is None:
        return _in_thread(accuracy_mismatch, adapted, seed, batch, reports)
    return _Deferred(functools.partial(accuracy_mismatch, adapted, seed, reference_batch, reports))


def _in_program_prepare(adapted: PureExperiment, grid: Grid, select: Callable[[str], bool], scaled: bool) -> Any:
    """``(state, lr, scale) -> state`` that the compiled program applies when the host cannot, or None when no
    configuration sets a rate or an init scale (a large model's sweep at the step's own rate: no preparing program
    to compile, 2.6 s of a 3.5M-parameter CNN's). Jit-safe."""
    lr_paths = grid.lr_paths
    if not (lr_paths or scaled or any(c.init_scale != 1.0 for c in grid.configs)):
        return None

    def prepare(state, lr, scale):  # in the compiled program, only when the host cannot do it
        state = adapted.with_params(state, _scale_params(adapted.params(state), scale, select))
        return set_learning_rate(state, lr_paths, lr) if lr_paths else state

    return prepare


def _in_thread(fn: Callable, *args: Any) -> concurrent.futures.Future:
    """``fn(*args)`` started in a daemon thread (never joined at exit); its future. The thread's name starts with
    its parent's, so its compiles count where the parent's do (doctor's background or the stage). Not jit-safe."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def work() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # the caller's result() raises it
            future.set_exception(e)

    threading.Thread(target=work, name=f"{threading.current_thread().name}/overfit-setup", daemon=True).start()
    return future


class _Deferred:
    """``fn()``, called once, by the first ``result()`` (a future's interface, for work that should run where and
    when its result is first needed). Thread-safe; not jit-safe."""

    def __init__(self, fn: Callable[[], Any]):
        self._fn, self._lock, self._done, self._value = fn, threading.Lock(), False, None

    def result(self) -> Any:
        with self._lock:
            if not self._done:
                self._value, self._done = self._fn(), True
            return self._value


def _on_state(adapted: PureExperiment, accuracy: Callable) -> Callable:
    """``(state, batch) -> accuracy`` of the parameters in ``state``. Jit-safe."""
    return lambda s, b: accuracy(adapted.params(s), b)


class _Judging(NamedTuple):
    """What the verdict needs besides the curves."""

    ceiling: Ceiling | None
    baseline_reason: str | None
    ignores_input_ratio: float
    n_examples: int
    measures_accuracy: bool
    accuracy_mismatch: str | None = None  # why apply's accuracy does not judge the loss's fit (setup.py)


@dataclasses.dataclass
class _Sweep:
    """A planned sweep: the configurations, the spec and layout of the compiled program, and how to build
    the stacked initial states (one pure state per seed, built once). :meth:`compile` and :meth:`run` are
    the :class:`OverfitPlan`'s."""

    adapted: PureExperiment
    grid: Grid
    batch: PyTree
    const_batch: PyTree | None
    spec: SweepSpec
    layout: Any
    host_plan: HostPrepare | None
    judging: _Judging
    early_exit: bool
    progress: bool
    mismatch: concurrent.futures.Future | _Deferred | None = None  # of setup.accuracy_mismatch (plan_overfit)
    traces: TraceCount = dataclasses.field(default_factory=TraceCount)
    per_seed: list[list[Any]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        configs, seed_list = self.grid.configs, self.grid.seed_list
        self.seed_index = np.asarray([seed_list.index(c.seed) for c in configs])
        self.lr_values = np.asarray(
            [
                c.update_scale if c.update_scale is not None else np.nan if c.learning_rate is None else c.learning_rate
                for c in configs
            ],
            np.float32,
        )
        self.scale_values = np.asarray([c.init_scale for c in configs], np.float32)
        self.treedef: Any = jax.tree_util.tree_structure(self.grid.example)  # jaxlib ships no PyTreeDef stub

    def batch_for(self, c: int) -> PyTree:
        return self.const_batch if self.grid.configs[c].baseline else self.batch

    def build_states(self, rows: np.ndarray) -> PyTree:
        # one pure state per seed, built on the host (NNX init builds objects: not vmappable), once; stacked
        # leaf by leaf under the example's treedef (static metadata such as a linen TrainState's tx may differ
        # by identity between init calls)
        if not self.per_seed:
            self.per_seed.extend(
                jax.tree_util.tree_leaves(self.adapted.init(jax.random.key(s))) for s in self.grid.seed_list
            )
        if any(len(leaves) != self.treedef.num_leaves for leaves in self.per_seed):
            raise ExperimentError(
                "init(key) returns states of different structure for different seeds; overfit "
                "stacks one state per seed, so init must build the same pytree for every key."
            )
        states = stack_states(self.per_seed, self.treedef, self.seed_index[rows])
        if self.host_plan is None:
            return states
        return self.host_plan.apply(states, self.lr_values[rows], self.scale_values[rows])

    def compile(self) -> tuple[Any, float]:
        return compile_sweep(
            self.spec, self.layout, example_state=self.grid.example, batch_for=self.batch_for, traces=self.traces
        )

    def run(self, precompiled: Any = None, time_limit: float | None = None) -> OverfitResult:
        configs, n_real = self.grid.configs, self.grid.n_real
        mismatch = self.mismatch
        with warnings.catch_warnings(), Progress(self.progress, "overfit") as show:
            warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
            out = run_sweep(
                self.spec,
                self.layout,
                build_states=self.build_states,
                example_state=self.grid.example,
                batch_for=self.batch_for,
                lrs=self.lr_values,
                scales=self.scale_values,
                real=np.asarray([not c.baseline for c in configs]),
                early_exit=self.early_exit,
                traces=self.traces,
                say=show.say,
                precompiled=precompiled,
                target_accuracy=None if mismatch is None else lambda: self._accuracy_target(mismatch.result()),
                time_limit=time_limit,
            )
            if mismatch is not None:  # the verdict says why apply's accuracy did not judge the fit
                self.judging = self.judging._replace(accuracy_mismatch=mismatch.result())
            show.say(
                f"{int(np.sum(out.reached_at[:n_real] >= 0))} of {n_real} configuration(s) fit in {out.steps_run} steps"
            )
        return self.judged(self.result_of(out, time_limit))

    def _accuracy_target(self, mismatch: str | None) -> float:
        """The accuracy target the program uses: the one asked for, or none it can reach (2) when apply's accuracy
        cannot judge the fit (``mismatch`` says why)."""
        return self.spec.target_accuracy if mismatch is None else 2.0

    def result_of(self, out: SweepOutput, time_limit: float | None = None) -> OverfitResult:
        """The sweep's curves as an :class:`OverfitResult`, not judged yet (``time_limit``: the one it ran under)."""
        spec, judging = self.spec, self.judging
        return OverfitResult(
            tuple(self.grid.configs),
            out.losses,
            out.accuracy if judging.measures_accuracy else None,
            out.reached_at >= 0,
            out.reached_at,
            (),
            (),
            spec.target,
            spec.target_accuracy if judging.measures_accuracy and judging.accuracy_mismatch is None else None,
            out.steps_run,
            spec.n_chunks * spec.chunk,
            self.traces.count,
            out.seconds,
            bool(self.grid.lr_paths),
            judging.n_examples,
            out.compile_seconds,
            self.layout.groups,
            time_limit if out.cut else None,
            out.out_of_reach,
        )

    def judged(self, result: OverfitResult) -> OverfitResult:
        """``result`` with its verdicts and findings (the setup's, then the verdict's)."""
        adapted, judging = self.adapted, self.judging
        params, inputs = adapted.params(self.grid.example), inputs_or_none(adapted.experiment, self.batch)
        mismatch = judging.accuracy_mismatch or loss_fit_without_accuracy(result)
        if mismatch is not None and judging.accuracy_mismatch is None:
            judging = judging._replace(accuracy_mismatch=mismatch)
            result = dataclasses.replace(result, target_accuracy=None)
        verdicts, judged = judge(
            result,
            ceiling=judging.ceiling,
            baseline_reason=judging.baseline_reason,
            normalised=lambda: normalised_outputs(adapted.jitted("apply"), params, inputs),
            ignores_input_ratio=judging.ignores_input_ratio,
            accuracy_mismatch=judging.accuracy_mismatch,
        )
        result = dataclasses.replace(result, verdicts=verdicts)
        if result.time_cut is not None and not any(verdicts[i] == "fits" for i in result.real):
            # a curve cut short that did not reach the target judges nothing: one still falling steadily after a
            # steep start reads as a floor (a 7M LSTM LM cut at step 150: "a floor at 15% of its start", then a
            # fit at step 286 with no limit)
            kept = [f for f in judged if f.severity == "info" and f.code not in ("overfit.floor", "overfit.best")]
            judged = kept + out_of_time(result, result.time_cut, out_of_reach=result.out_of_reach)
        return dataclasses.replace(result, findings=(*self.grid.findings, *judged))
