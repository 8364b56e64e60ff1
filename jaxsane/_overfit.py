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
from collections.abc import Sequence
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from ._errors import DataError, ExperimentError, JaxsaneError
from ._experiment import Adapted, Experiment, require_experiment
from ._experiment_data import first_batch, get_inputs, get_labels, get_mask, slice_examples
from ._findings import Finding
from ._overfit_verdict import (batch_ceiling, best_configuration, judge, normalised_outputs,
                               targets_follow_inputs)
from ._progress import Progress
from ._sweep import SweepSpec, compile_sweep, default_groups, group_layout, run_sweep, stack_states
from ._tree import (PyTree, host_leaf, is_inexact, leaf_selector as _selector, path_str,
                    scale_selected as _scale_params)
from ._validate import require_bool, require_count_or_list, require_float, require_int, require_sequence


class OverfitConfig(NamedTuple):
    """One configuration of the sweep. ``baseline`` marks the constant-input run."""

    seed: int
    learning_rate: float | None
    init_scale: float
    baseline: bool = False

    def label(self) -> str:
        lr = "lr=default" if self.learning_rate is None else f"lr={self.learning_rate:.3g}"
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
        (see ``jaxsane._overfit_verdict``).
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
        """A plain-text table, one row per configuration."""
        head = ["#", "seed", "lr", "scale", "input", "loss[0]", "loss[-1]", "ratio", "acc", "reached@", "verdict"]
        rows = []
        for i, c in enumerate(self.configs):
            init, fin = self.losses[i, 0], self.losses[i, -1]
            ratio = fin / init if np.isfinite(init) and init != 0 else float("nan")
            rows.append([str(i), str(c.seed), "default" if c.learning_rate is None else f"{c.learning_rate:.3g}",
                         f"{c.init_scale:g}", "constant" if c.baseline else "real", f"{init:.4g}", f"{fin:.4g}",
                         f"{ratio:.3g}", "-" if self.accuracy is None else f"{self.accuracy[i]:.0%}",
                         str(self.reached_at[i]) if self.reached_at[i] >= 0 else "-", self.verdicts[i]])
        widths = [max(len(r[j]) for r in [head, *rows]) for j in range(len(head))]
        line = lambda r: "  ".join(x.rjust(w) for x, w in zip(r, widths))  # noqa: E731
        target = f"loss <= {self.target:g} x initial"
        if self.target_accuracy is not None:
            target += f" or accuracy >= {self.target_accuracy:.0%}"
        out = [f"overfit sweep: {len(self.configs)} configurations, batch of {self.batch_size}, "
               f"{self.steps_run}/{self.max_steps} steps, target {target}, {self.compiles} compile(s), "
               f"{self.seconds:.2f}s ({self.compile_seconds:.2f}s compiling"
               + (f", {self.groups} groups in parallel)" if self.groups > 1 else ")"), line(head), line(["-" * w for w in widths]), *map(line, rows)]
        out += [str(f) for f in self.findings]
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        fits = int(np.sum(self.reached[self.real])) if len(self.real) else 0
        return (f"OverfitResult({len(self.configs)} configs, {fits}/{len(self.real)} fit, steps_run={self.steps_run}, "
                f"codes={self.codes})")

    def plot(self, ax: Any = None):
        """Loss against step for every configuration (log scale); returns the matplotlib Figure."""
        import matplotlib.pyplot as plt

        if ax is None:
            fig, ax = plt.subplots(figsize=(7, 4))
        else:
            fig = ax.figure
        steps = np.arange(self.losses.shape[1])
        cmap = plt.get_cmap("viridis")
        real = list(self.real)
        for n, i in enumerate(real):
            c = self.configs[i]
            colour = cmap(n / max(1, len(real) - 1))
            ax.plot(steps, self.losses[i], color=colour, lw=1.2, alpha=0.9 if self.reached[i] else 0.5,
                    label=c.label() + ("" if self.reached[i] else " (fails)"))
        if self.baseline is not None:
            ax.plot(steps, self.losses[self.baseline], color="red", ls="--", lw=1.5, label="constant-input baseline")
        best = self.best
        ax.axhline(self.losses[best, 0] * self.target, color="grey", ls=":", lw=1,
                   label=f"target ({self.target:g} x initial of best)")
        finite = self.losses[np.isfinite(self.losses) & (self.losses > 0)]
        if finite.size:
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("loss on the overfit batch")
        verdict = "FAILED" if "overfit.failed" in self.codes else "ok"
        ax.set_title(f"overfit one batch ({self.batch_size} examples): {verdict}")
        if len(self.configs) <= 17:
            ax.legend(fontsize=6, loc="best")
        fig.tight_layout()
        return fig


# ----------------------------------------------------------------------------- learning-rate leaves

def _key_name(k: Any) -> Any:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return None


def learning_rate_paths(state: PyTree) -> list[tuple]:
    """Key paths of ``optax.inject_hyperparams`` learning-rate leaves in a pure state. Not jit-safe.

    A leaf qualifies when its path holds ``hyperparams`` immediately followed by ``learning_rate``
    (``InjectHyperparamsState.hyperparams['learning_rate']``; for NNX the optimizer's
    ``opt_state['hyperparams']['learning_rate']`` inside the ``nnx.State``).
    """
    found = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        names = [_key_name(k) for k in path]
        if any(a == "hyperparams" and b == "learning_rate" for a, b in zip(names, names[1:])) and is_inexact(leaf):
            found.append(path)
    return found


def current_learning_rate(state: PyTree) -> float | None:
    """The injected learning rate of a pure state, or None when there is none. Not jit-safe."""
    paths = set(learning_rate_paths(state))
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if path in paths:
            return float(np.asarray(leaf).reshape(-1)[0])
    return None


def _set_learning_rate(state: PyTree, paths: set, lr: jax.Array) -> PyTree:
    """``state`` with the learning-rate leaves at ``paths`` set to ``lr`` (NaN: left as they are). Jit-safe."""
    def set_leaf(path, x):
        if path not in paths:
            return x
        return jnp.where(jnp.isnan(lr), x, jnp.broadcast_to(lr, jnp.shape(x)).astype(x.dtype))
    return jax.tree_util.tree_map_with_path(set_leaf, state)


# ----------------------------------------------------------------------------- batches

def _replace_inputs(exp: Experiment, batch: PyTree, make: Callable[[Any], Any]) -> PyTree:
    """``batch`` with every leaf of its inputs replaced by ``make(leaf)``."""
    inputs = get_inputs(exp, batch)
    ids = {id(x) for x in jax.tree_util.tree_leaves(inputs)}
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    if not any(id(x) in ids for x in leaves):
        raise DataError("cannot find the inputs among the batch's leaves, so the constant-input baseline cannot "
                        "be built: pass Experiment(inputs=lambda batch: batch[...]) returning a leaf of the batch.")
    return jax.tree_util.tree_unflatten(treedef, [make(x) if id(x) in ids else x for x in leaves])


def _inputs_or_none(exp: Experiment, batch: PyTree) -> Any:
    try:
        return get_inputs(exp, batch)
    except Exception:
        return None


def constant_input_batch(exp: Experiment, batch: PyTree) -> PyTree:
    """``batch`` with constant inputs: float inputs become their mean over the batch axis, integer
    inputs (tokens) the first example's, repeated; labels unchanged. Not jit-safe."""
    def make(x):
        x = host_leaf(x)
        if x.ndim == 0:
            return x
        row = np.mean(x, axis=0) if np.issubdtype(x.dtype, np.inexact) else x[0]
        return np.broadcast_to(row.astype(x.dtype), x.shape).copy()
    return _replace_inputs(exp, batch, make)


def _accuracy_fn(adapted: Adapted, params: PyTree, batch: PyTree) -> Callable | None:
    """``(params, batch) -> per-example accuracy`` when ``apply`` and integer class labels exist."""
    exp = adapted.experiment
    apply = adapted.apply_fn
    if apply is None:
        return None
    try:
        labels = get_labels(exp, batch)
        inputs = get_inputs(exp, batch)
        out = jax.eval_shape(apply, params, inputs)
    except Exception:
        return None
    labels_dtype = getattr(labels, "dtype", None)
    if (labels_dtype is None or not jnp.issubdtype(labels_dtype, jnp.integer) or not hasattr(out, "ndim")
            or out.ndim != np.ndim(labels) + 1 or out.shape[:-1] != np.shape(labels)):
        return None

    def accuracy(p, b):
        logits = apply(p, get_inputs(exp, b))
        correct = (jnp.argmax(logits, axis=-1) == get_labels(exp, b)).astype(jnp.float32)
        mask = get_mask(exp, b)
        if mask is not None and np.shape(mask) == np.shape(correct):
            m = jnp.asarray(mask).astype(jnp.float32)
            return jnp.sum(correct * m) / jnp.maximum(jnp.sum(m), 1.0)
        return jnp.mean(correct)
    return accuracy


# ----------------------------------------------------------------------------- per-configuration setup

@dataclasses.dataclass(frozen=True)
class _HostPrepare:
    """Init scales and learning rates applied on the host to stacked numpy states, so the compiled
    sweep program does not carry that setup (less to compile). ``scaled``/``rates``: indices of the
    state leaves to multiply by the init scale / to set to the learning rate."""

    scaled: tuple[int, ...]
    rates: tuple[int, ...]

    def apply(self, states: PyTree, lrs: np.ndarray, scales: np.ndarray) -> PyTree:
        """``states`` (leaves stacked ``[rows, ...]``) with row ``r`` scaled by ``scales[r]`` and its rate
        set to ``lrs[r]`` (NaN: kept). Not jit-safe (numpy, as :func:`_scale_params` and
        :func:`_set_learning_rate` compute it in a program)."""
        leaves, treedef = jax.tree_util.tree_flatten(states)
        for i in self.scaled:
            x = np.asarray(leaves[i])
            leaves[i] = (x * scales.reshape((-1,) + (1,) * (x.ndim - 1))).astype(x.dtype)
        for i in self.rates:
            x = np.asarray(leaves[i])
            lr = lrs.reshape((-1,) + (1,) * (x.ndim - 1))
            leaves[i] = np.where(np.isnan(lr), x, np.broadcast_to(lr, x.shape).astype(x.dtype))
        return jax.tree_util.tree_unflatten(treedef, leaves)


def _host_prepare_plan(adapted: Adapted, example: PyTree, select: Callable[[str], bool],
                       lr_paths: set) -> _HostPrepare | None:
    """Which state leaves the init scales and learning rates touch, when the parameters are state leaves
    passed through unchanged (``adapted.params`` forwards them: pure sub-trees, NNX ``Param`` states);
    None otherwise (the sweep program then applies them itself). Not jit-safe."""
    flat = jax.tree_util.tree_flatten_with_path(example)[0]
    leaves = [leaf for _, leaf in flat]
    try:
        closed = jax.make_jaxpr(adapted.params)(example)
        param_paths = [path_str(p, "params") for p, _ in
                       jax.tree_util.tree_flatten_with_path(jax.eval_shape(adapted.params, example))[0]]
    except Exception:  # noqa: BLE001 - any failure: leave the setup to the compiled program
        return None
    if len(closed.jaxpr.invars) != len(leaves):
        return None
    position = {v: i for i, v in enumerate(closed.jaxpr.invars)}
    scaled = []
    for var, path in zip(closed.jaxpr.outvars, param_paths):
        if not isinstance(var, jcore.Var) or var not in position:
            return None  # a parameter the state does not hold as is: the program scales it
        i = position[var]
        if is_inexact(leaves[i]) and select(path):
            scaled.append(i)
    rates = [i for i, (p, _) in enumerate(flat) if p in lr_paths]
    return _HostPrepare(tuple(scaled), tuple(rates))


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


def overfit(experiment: Experiment | Adapted, batch: PyTree | None = None, *, seeds: int | Sequence[int] = 4,
            learning_rates: Sequence[float] | None = None, init_scales: Sequence[float] | None = None,
            steps: int = 500, target: float = 0.01, target_accuracy: float = 1.0, batch_size: int = 16,
            baseline: bool = True, ignores_input_ratio: float = 0.5, chunk: int = 25, early_exit: bool = True,
            scale_leaves: str | Callable[[str], bool] | None = None, groups: int | None = None,
            progress: bool = True) -> OverfitResult:
    """Overfit one small batch with many configurations at once; return an :class:`OverfitResult`.

    Runs the user's own step (any style, through :class:`Adapted`) for every configuration
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
    return plan_overfit(experiment, batch, seeds=seeds, learning_rates=learning_rates, init_scales=init_scales,
                         steps=steps, target=target, target_accuracy=target_accuracy, batch_size=batch_size,
                         baseline=baseline, ignores_input_ratio=ignores_input_ratio, chunk=chunk,
                         early_exit=early_exit, scale_leaves=scale_leaves, groups=groups, progress=progress).run()


class OverfitPlan(NamedTuple):
    """A planned sweep: ``compile()`` -> ``(compiled program, seconds)`` (safe in a background thread);
    ``run(precompiled=None)`` -> :class:`OverfitResult` (``precompiled``: a future of ``compile()``)."""

    compile: Callable[[], tuple[Any, float]]
    run: Callable[..., "OverfitResult"]


def plan_overfit(experiment: Experiment | Adapted, batch: PyTree | None = None, *, seeds: int | Sequence[int] = 4,
            learning_rates: Sequence[float] | None = None, init_scales: Sequence[float] | None = None,
            steps: int = 500, target: float = 0.01, target_accuracy: float = 1.0, batch_size: int = 16,
            baseline: bool = True, ignores_input_ratio: float = 0.5, chunk: int = 25, early_exit: bool = True,
            scale_leaves: str | Callable[[str], bool] | None = None, groups: int | None = None,
            progress: bool = True) -> OverfitPlan:
    """Everything :func:`overfit` does before compiling: arguments checked, configurations, the step and
    target of the sweep. Returns an :class:`OverfitPlan` whose ``compile`` may be started early (in a
    background thread) and whose ``run`` compiles (unless given the compiled program), runs and judges.
    Not jit-safe."""
    fn = "overfit"
    require_experiment(fn, experiment)
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
    adapted = experiment if isinstance(experiment, Adapted) else Adapted(experiment)
    exp = adapted.experiment
    if not 0 < target < 1:
        raise JaxsaneError(f"[jaxsane] overfit(target=...) is a fraction of the initial loss in (0, 1), got {target}.")
    if steps < 1 or chunk < 1:
        raise JaxsaneError(f"[jaxsane] overfit needs steps >= 1 and chunk >= 1, got steps={steps}, chunk={chunk}.")
    if batch is None:
        batch = slice_examples(exp, first_batch(exp.train, "train"), batch_size)  # raises on an uncuttable batch
    batch = jax.tree_util.tree_map(host_leaf, batch)  # host numpy: no per-leaf eager XLA compiles
    from ._experiment_data import count_examples
    n_examples = count_examples(exp, batch)
    seed_list = _as_seeds(seeds)
    scales = [1.0] if init_scales is None else [float(s) for s in init_scales]
    if not scales:
        raise JaxsaneError("[jaxsane] overfit(init_scales=...) is empty.")

    example = adapted.example_state
    lr_paths = set(learning_rate_paths(example))
    findings: list[Finding] = []
    default_lr = current_learning_rate(example) if lr_paths else None
    if lr_paths:
        lrs = ([default_lr * m for m in (0.1, 1.0, 10.0)] if learning_rates is None
               else [float(x) for x in learning_rates])
    else:
        lrs = [None]
        findings.append(Finding(
            "overfit.no_lr_sweep",
            "learning rates were not swept: the optimizer state holds no optax.inject_hyperparams "
            "'learning_rate'" + (f" (asked for {list(learning_rates)})" if learning_rates else "")
            + f"; swept {len(seed_list)} seed(s) x {len(scales)} init scale(s) at the step's own rate",
            "build the optimizer as optax.inject_hyperparams(optax.adam)(learning_rate=...) so the sweep can set "
            "the rate per configuration"))

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
    _, metrics_shape = jax.eval_shape(adapted.step, example, batch)
    step_reports_loss = "loss" in metrics_shape
    loss_fn = adapted.loss_fn
    if not step_reports_loss and loss_fn is None:
        raise ExperimentError("overfit needs a loss: the step's metrics have no 'loss' and the Experiment has no "
                              "loss. Return {'loss': value} from the step or pass Experiment(loss=...).")
    accuracy = _accuracy_fn(adapted, adapted.params(example), batch)
    ceiling = batch_ceiling(exp, batch) if accuracy is not None else None
    if ceiling is not None:  # an ambiguous batch caps the reachable accuracy: ask for no more than it allows
        target_accuracy = min(target_accuracy, ceiling.accuracy - 1e-6)
    select = _selector(scale_leaves)

    host_plan = _host_prepare_plan(adapted, example, select, lr_paths)

    def prepare(state, lr, scale):  # in the compiled program, only when the host cannot do it
        state = adapted.with_params(state, _scale_params(adapted.params(state), scale, select))
        return _set_learning_rate(state, lr_paths, lr) if lr_paths else state

    def one_step(state, b):
        new_state, metrics = adapted.step(state, b)
        if step_reports_loss:
            loss = jnp.mean(jnp.asarray(metrics["loss"], jnp.float32))
        else:
            loss = jnp.asarray(loss_fn(adapted.params(state), b), jnp.float32)
        return new_state, loss

    spec = SweepSpec(one_step, None if host_plan is not None else prepare, None if accuracy is None else lambda s, b: accuracy(adapted.params(s), b),
                     chunk=chunk, n_chunks=max(1, math.ceil(steps / chunk)), target=target,
                     target_accuracy=target_accuracy)
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
            raise ExperimentError("init(key) returns states of different structure for different seeds; overfit "
                                  "stacks one state per seed, so init must build the same pytree for every key.")
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
                spec, layout, build_states=build_states, example_state=example,
                batch_for=batch_for, lrs=lr_values, scales=scale_values,
                real=np.asarray([not c.baseline for c in configs]), early_exit=early_exit, traces=traces,
                say=show.say, precompiled=precompiled)
            show.say(f"{int(np.sum(out.reached_at[:n_real] >= 0))} of {n_real} configuration(s) fit in "
                     f"{out.steps_run} steps")
        losses, reached_at, steps_run = out.losses, out.reached_at, out.steps_run
        acc_np = out.accuracy if accuracy is not None else None
        reached = reached_at >= 0
        result = OverfitResult(tuple(configs), losses, acc_np, reached, reached_at, (), (), target,
                               target_accuracy if accuracy is not None else None, steps_run, spec.n_chunks * chunk,
                               traces[0], out.seconds, bool(lr_paths), n_examples, out.compile_seconds, layout.groups)
        verdicts, judged = judge(result, ceiling=ceiling, baseline_reason=baseline_reason,
                                 normalised=normalised_outputs(adapted.jitted("apply"), adapted.params(example),
                                                               _inputs_or_none(exp, batch)),
                                 ignores_input_ratio=ignores_input_ratio)
        result = dataclasses.replace(result, verdicts=verdicts)
        return dataclasses.replace(result, findings=(*findings, *judged))

    return OverfitPlan(compile_now, run)


