"""Setting up :func:`jaxsane.overfit`'s configurations: the learning-rate leaves of an optax state
(found, read and set: :func:`learning_rate_paths`, :func:`current_learning_rate`,
:func:`set_learning_rate`), the constant-input baseline batch and the accuracy function, and the
host-side plan that scales init leaves and sets learning rates on the stacked states before the
sweep compiles (:func:`host_prepare_plan`), and how many seeds a large model's sweep can afford
(:func:`budget_seeds`).

:func:`set_learning_rate` is jit-safe; the rest runs on the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from .._checks.init_loss import is_one_of, mean_cross_entropies
from .._core.accuracy import class_accuracy
from .._core.errors import DataError
from .._core.finding import Finding
from .._core.tree import PyTree, host_leaf, is_inexact, path_str
from .._experiment.batches import get_inputs, get_labels, get_mask
from .._experiment.contract import Experiment, PureExperiment
from .._jaxpr.compile_level import program_cost

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


def set_learning_rate(state: PyTree, paths: set, lr: jax.Array) -> PyTree:
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
        raise DataError(
            "cannot find the inputs among the batch's leaves, so the constant-input baseline cannot "
            "be built: pass Experiment(inputs=lambda batch: batch[...]) returning a leaf of the batch."
        )
    return jax.tree_util.tree_unflatten(treedef, [make(x) if id(x) in ids else x for x in leaves])


def inputs_or_none(exp: Experiment, batch: PyTree) -> Any:
    """The inputs of ``batch``, or None when they cannot be found. Not jit-safe."""
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


def accuracy_fn(adapted: PureExperiment, params: PyTree, batch: PyTree) -> Callable | None:
    """``(params, batch) -> per-example accuracy`` when ``apply`` and integer class labels exist. Built on
    the host; the returned function is jit-safe (it runs in the sweep program)."""
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
    if (
        labels_dtype is None
        or not jnp.issubdtype(labels_dtype, jnp.integer)
        or not hasattr(out, "ndim")
        or out.ndim != np.ndim(labels) + 1
        or out.shape[:-1] != np.shape(labels)
    ):
        return None

    def accuracy(p, b):  # an ignored label (-100) or a padded position is not scored
        return class_accuracy(apply(p, get_inputs(exp, b)), get_labels(exp, b), get_mask(exp, b))

    return accuracy


def accuracy_mismatch(adapted: PureExperiment, seed: int, batch: PyTree, step_reports_loss: bool) -> str | None:
    """Why apply's accuracy cannot judge the same fit as the sweep's loss, or None when it can. Not jit-safe.

    The sweep's loss is the step's (train mode: BatchNorm on batch statistics, dropout on) or
    ``Experiment.loss``; the accuracy comes from ``apply``, which may run in eval mode (running statistics,
    possibly stale) or belong to another loss. At init (seed ``seed``, one call of the step) the two must
    agree: the loss must be the mean cross-entropy of apply's outputs. When they do not, the fit is judged by
    the loss alone and the accuracy is shown as apply's."""
    exp = adapted.experiment
    apply, loss_fn = adapted.jitted("apply"), adapted.jitted("loss")
    if apply is None or (loss_fn is None and not step_reports_loss):
        return None
    try:
        # own buffers: a donating step must not delete arrays that other stages share (doctor's reused init)
        state = jax.tree_util.tree_map(
            lambda x: x.copy() if isinstance(x, jax.Array) else x, adapted.init(jax.random.key(seed))
        )
        params = adapted.params(state)
        candidates = mean_cross_entropies(
            apply(params, get_inputs(exp, batch)), get_labels(exp, batch), get_mask(exp, batch)
        )
        if step_reports_loss:
            source, metrics = "the step's loss", adapted.step(state, batch)[1]  # after apply: a step may donate
            loss = float(np.mean(np.asarray(metrics["loss"], np.float64)))
        else:
            assert loss_fn is not None  # checked above
            source, loss = "Experiment.loss", float(np.asarray(loss_fn(params, batch)))
    except Exception:  # noqa: BLE001 - a handle that does not run here: the other stages report it
        return None
    if not np.isfinite(loss) or is_one_of(loss, candidates):
        return None
    return (
        f"{source} at init ({loss:.4g}) is not the cross-entropy of apply's outputs ({candidates[0]:.4g}): apply "
        "runs in another mode than the loss (BatchNorm running statistics, dropout) or the loss is another one, "
        "so the fit is judged by the loss alone"
    )


# ----------------------------------------------------------------------------- per-configuration setup


@dataclasses.dataclass(frozen=True)
class HostPrepare:
    """Init scales and learning rates applied on the host to stacked numpy states, so the compiled
    sweep program does not carry that setup (less to compile). ``scaled``/``rates``: indices of the
    state leaves to multiply by the init scale / to set to the learning rate."""

    scaled: tuple[int, ...]
    rates: tuple[int, ...]

    def apply(self, states: PyTree, lrs: np.ndarray, scales: np.ndarray) -> PyTree:
        """``states`` (leaves stacked ``[rows, ...]``) with row ``r`` scaled by ``scales[r]`` and its rate
        set to ``lrs[r]`` (NaN: kept). Not jit-safe (numpy, as ``scale_selected`` in ``_core/tree.py`` and
        :func:`set_learning_rate` compute it in a program)."""
        leaves, treedef = jax.tree_util.tree_flatten(states)
        for i in self.scaled:
            x = np.asarray(leaves[i])
            leaves[i] = (x * scales.reshape((-1,) + (1,) * (x.ndim - 1))).astype(x.dtype)
        for i in self.rates:
            x = np.asarray(leaves[i])
            lr = lrs.reshape((-1,) + (1,) * (x.ndim - 1))
            leaves[i] = np.where(np.isnan(lr), x, np.broadcast_to(lr, x.shape).astype(x.dtype))
        return jax.tree_util.tree_unflatten(treedef, leaves)


def host_prepare_plan(
    adapted: PureExperiment, example: PyTree, select: Callable[[str], bool], lr_paths: set
) -> HostPrepare | None:
    """Which state leaves the init scales and learning rates touch, when the parameters are state leaves
    passed through unchanged (``adapted.params`` forwards them: pure sub-trees, NNX ``Param`` states);
    None otherwise (the sweep program then applies them itself). Not jit-safe."""
    flat = jax.tree_util.tree_flatten_with_path(example)[0]
    leaves = [leaf for _, leaf in flat]
    try:
        closed = jax.make_jaxpr(adapted.params)(example)
        param_paths = [
            path_str(p, "params")
            for p, _ in jax.tree_util.tree_flatten_with_path(jax.eval_shape(adapted.params, example))[0]
        ]
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
    return HostPrepare(tuple(scaled), tuple(rates))


# ----------------------------------------------------------------------------- the seed budget

DEFAULT_SEEDS = 2
LARGE_CONFIGURATION_FLOPS = 3e10
"""Flops of one configuration (one step's x the steps) above which ``seeds=None`` sweeps one seed on the
CPU backend: about 2 s of a CPU core at the 15 GFLOP/s the small causal LM's sweep ran at. On GPU and
TPU the budget is 1000x larger."""


def budget_seeds(step_jaxpr: Any, steps: int, backend: str | None = None) -> tuple[int, Finding | None]:
    """``(seeds, finding)`` for ``overfit(seeds=None)``: :data:`DEFAULT_SEEDS`, or one seed when one
    configuration would cost more than :data:`LARGE_CONFIGURATION_FLOPS` (x1000 off the CPU), with an
    ``overfit.budget`` info finding that says so. From the step's jaxpr; deterministic. Not jit-safe."""
    backend = backend or jax.default_backend()
    per_step = program_cost(step_jaxpr).flops
    budget = LARGE_CONFIGURATION_FLOPS * (1 if backend == "cpu" else 1000)
    if per_step * steps <= budget:
        return DEFAULT_SEEDS, None
    return 1, Finding(
        "overfit.budget",
        f"the sweep ran 1 seed, not {DEFAULT_SEEDS}: one step of this model is about {per_step / 1e9:.2g} GFLOP, "
        f"so one configuration of {steps} steps is {per_step * steps / 1e12:.2g} TFLOP, above the "
        f"{budget / 1e12:.2g} TFLOP a configuration may take on {backend}",
        f"to sweep {DEFAULT_SEEDS} seeds anyway, pass overfit_seeds={DEFAULT_SEEDS} "
        f"(jaxsane doctor -o overfit_seeds={DEFAULT_SEEDS}) or seeds={DEFAULT_SEEDS} to overfit",
        extra={"step_flops": per_step, "steps": steps, "budget_flops": budget, "backend": backend},
    )
