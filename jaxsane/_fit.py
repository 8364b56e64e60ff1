"""fit: a guarded, monitored training loop with checkpoints from the first step, early stopping and resume.

``jaxsane.fit(experiment, steps=1000, checkpoint_dir="ckpt")`` runs the experiment's step under
:func:`jaxsane.guard` and the :class:`~jaxsane._monitor.Monitor`, saves the pure train state with
orbax-checkpoint (asynchronously, keeping the last ``keep``) after the first step and every
``checkpoint_every`` steps, evaluates every ``eval_every`` steps (early stopping on the eval loss
with ``patience``/``min_delta``), writes every metric to ``metrics.jsonl`` (and TensorBoard when a
writer is installed), and ends with the ``train.*`` findings of the run.

Resume: called again with the same ``checkpoint_dir``, ``fit`` restores the latest checkpoint and
skips the batches already consumed, so a deterministic data iterator yields the same data order and
the same losses as an uninterrupted run. The step counter *is* the data position: after a NaN
rollback the failing batches are skipped, never replayed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import warnings
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from ._errors import ExperimentError, NonFiniteError
from ._experiment import Adapted, Experiment, get_inputs, get_labels, is_batch, iter_batches
from ._findings import Diagnosis
from ._guard import JaxsaneWarning, guard
from ._monitor import History, Monitor, check_training

PyTree = Any
POLICIES = ("rollback", "skip", "raise")


@dataclasses.dataclass
class FitResult:
    """What :func:`fit` returns.

    Attributes:
      state: the final pure train state (NNX: an ``nnx.State``; see :attr:`user_state`).
      history: the recorded :class:`~jaxsane._monitor.History` (train/eval losses, telemetry).
      diagnosis: ``train.*`` findings of the run plus every non-finite failure seen.
      step: steps taken, counting skipped batches (the data position).
      resumed_from: the checkpoint step the run resumed from, or None.
      stopped_early: True when early stopping ended the run.
      best_step, best_eval_loss: the best evaluation so far (None without eval).
      last_state: the state after the last step (the same object as ``state`` unless ``restore_best``
        put the best evaluation's state in ``state``).
      restored_best: True when ``state`` is the state of the best evaluation (``restore_best=True``).
      rollbacks: how many times a NaN rolled the state back to the last good checkpoint.
      checkpoint_dir, metrics_path: where the checkpoints and the JSONL metrics went (or None).
    """

    state: PyTree
    history: History
    diagnosis: Diagnosis
    step: int
    resumed_from: int | None
    stopped_early: bool
    best_step: int | None
    best_eval_loss: float | None
    rollbacks: int
    checkpoint_dir: str | None
    metrics_path: str | None
    adapted: Adapted = dataclasses.field(repr=False, default=None)
    last_state: PyTree = dataclasses.field(repr=False, default=None)
    restored_best: bool = False

    @property
    def user_state(self) -> Any:
        """The final state as the user's own objects (NNX: ``(model, optimizer)``)."""
        return self.adapted.user_state(self.state)

    @property
    def losses(self) -> list[float]:
        return list(self.history.loss)


# ----------------------------------------------------------------------------- checkpoints

def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


class _Checkpoints:
    """orbax ``CheckpointManager`` over the flattened pure state plus a JSON of loop metadata."""

    def __init__(self, directory: str, keep: int, like: PyTree):
        import orbax.checkpoint as ocp
        self.ocp = ocp
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=1,
                                               enable_async_checkpointing=True, cleanup_tmp_directories=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        leaves, self.treedef = jax.tree_util.tree_flatten(like)
        self.key_impls = [jax.random.key_impl(x) if _is_key(x) else None for x in leaves]
        self.abstract = [ocp.utils.to_shape_dtype_struct(jnp.asarray(x)) for x in self._encode(leaves)]

    def _encode(self, leaves: list) -> list:
        return [jax.random.key_data(x) if impl is not None else x for x, impl in zip(leaves, self.key_impls)]

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: PyTree, meta: dict) -> None:
        leaves = jax.tree_util.tree_leaves(state)
        args = self.ocp.args.Composite(state=self.ocp.args.StandardSave(self._encode(leaves)),
                                       meta=self.ocp.args.JsonSave(meta))
        self.manager.save(step, args=args, force=True)

    def restore(self, step: int) -> tuple[PyTree, dict]:
        args = self.ocp.args.Composite(state=self.ocp.args.StandardRestore(self.abstract),
                                       meta=self.ocp.args.JsonRestore())
        out = self.manager.restore(step, args=args)
        leaves = [jax.random.wrap_key_data(x, impl=impl) if impl is not None else x
                  for x, impl in zip(out.state, self.key_impls)]
        return jax.tree_util.tree_unflatten(self.treedef, leaves), dict(out.meta)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _keep_copy(state: PyTree) -> PyTree:
    """A copy of ``state`` that outlives donation: host numpy where the array is fully addressable,
    a device copy otherwise (typed PRNG keys, multi-host shards). Not jit-safe."""
    def copy(x):
        if not isinstance(x, jax.Array):
            return x
        if _is_key(x) or not x.is_fully_addressable:
            return x.copy()
        return np.asarray(x)
    return jax.tree_util.tree_map(copy, state)


def _best_state(kept: tuple | None, best_step: int, *, ckpt_dir: str | None, keep: int, like: PyTree,
                init: Any) -> PyTree:
    """The state of the best evaluation, placed like ``like``: the kept copy, else (after a resume) ``init()``
    for step 0 or its checkpoint, else ``like`` itself with a warning. Not jit-safe."""
    if kept is None and best_step == 0:
        return init()
    if kept is not None and kept[0] == best_step:
        return jax.tree_util.tree_map(
            lambda h, x: jax.device_put(h, x.sharding) if isinstance(x, jax.Array) and isinstance(h, np.ndarray)
            else h, kept[1], like)
    if ckpt_dir is not None:
        ckpt = _Checkpoints(ckpt_dir, keep, like)
        try:
            if best_step in ckpt.manager.all_steps():
                return ckpt.restore(best_step)[0]
        finally:
            ckpt.close()
    warnings.warn(f"[jaxsane] restore_best: the state of the best evaluation (step {best_step}) is neither in "
                  "memory nor among the kept checkpoints; returning the last state. Raise keep=... so the "
                  "best checkpoint survives a resume.", JaxsaneWarning, stacklevel=3)
    return like


# ----------------------------------------------------------------------------- metrics sinks

class _MetricsLog:
    """Appends the History's new entries to a JSONL file (and TensorBoard), one record per line.

    Records: ``{"kind": "train", "step", "loss", ...}``, ``{"kind": "telemetry", "step", "param_norm",
    "update_norm"}``, ``{"kind": "grad", ...}``, ``{"kind": "dead", ...}``, ``{"kind": "eval", "step",
    "loss", ...}``. :func:`read_history` rebuilds a History from them.
    """

    _SERIES = (("steps", "train"), ("tele_steps", "telemetry"), ("grad_steps", "grad"),
               ("dead_steps", "dead"), ("eval_steps", "eval"))

    def __init__(self, path: str | None, tensorboard_dir: str | None, history: History):
        self.path = path
        self.written = {name: len(getattr(history, name)) for name, _ in self._SERIES}
        self.tb = _tensorboard_writer(tensorboard_dir) if tensorboard_dir else None

    def sync(self, h: History) -> None:
        records = []
        for i in range(self.written["steps"], len(h.steps)):
            rec = {"kind": "train", "step": h.steps[i], "loss": h.loss[i]}
            rec.update({k: v[i] for k, v in h.train_metrics.items() if i < len(v)})
            records.append(rec)
        for i in range(self.written["tele_steps"], len(h.tele_steps)):
            records.append({"kind": "telemetry", "step": h.tele_steps[i], "param_norm": h.param_norm[i],
                            "update_norm": h.update_norm[i]})
        for i in range(self.written["grad_steps"], len(h.grad_steps)):
            records.append({"kind": "grad", "step": h.grad_steps[i], "grad_norm": h.grad_norm[i]})
        for i in range(self.written["dead_steps"], len(h.dead_steps)):
            records.append({"kind": "dead", "step": h.dead_steps[i], "dead_fraction": h.dead_fraction[i]})
        for i in range(self.written["eval_steps"], len(h.eval_steps)):
            rec = {"kind": "eval", "step": h.eval_steps[i], "loss": h.eval_loss[i]}
            rec.update({k: v[i] for k, v in h.eval_metrics.items() if i < len(v)})
            records.append(rec)
        self.written = {name: len(getattr(h, name)) for name, _ in self._SERIES}
        if self.path and records:
            with open(self.path, "a") as fh:
                for rec in records:
                    fh.write(json.dumps(_finite_or_none(rec)) + "\n")
        if self.tb is not None:
            for rec in records:
                if rec["kind"] in ("train", "eval"):
                    for k, v in rec.items():
                        if k not in ("kind", "step") and isinstance(v, (int, float)):
                            self.tb(f"{rec['kind']}/{k}", v, rec["step"])
                elif rec["kind"] == "grad":
                    for j, v in enumerate(rec["grad_norm"]):
                        path = h.leaf_paths[j] if j < len(h.leaf_paths) else str(j)
                        self.tb(f"grad_norm/{path}", v, rec["step"])


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _tensorboard_writer(logdir: str):
    """``(tag, value, step) -> None`` through tensorboardX / torch / tf when installed; else None and a warning."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        try:
            from torch.utils.tensorboard import SummaryWriter  # type: ignore
        except ImportError:
            SummaryWriter = None
    if SummaryWriter is not None:
        writer = SummaryWriter(logdir)
        return lambda tag, value, step: writer.add_scalar(tag, value, step)
    try:
        import tensorflow as tf  # type: ignore
    except ImportError:
        warnings.warn("[jaxsane] fit(tensorboard_dir=...) needs tensorboardX, torch or tensorflow installed; "
                      "writing JSONL metrics only.", JaxsaneWarning, stacklevel=4)
        return None
    writer = tf.summary.create_file_writer(logdir)

    def write(tag, value, step):
        with writer.as_default():
            tf.summary.scalar(tag, value, step=step)
    return write


def read_history(path: str, before: int | None = None) -> History:
    """Rebuild a :class:`History` from a ``metrics.jsonl`` written by :func:`fit`; keep steps ``< before``."""
    h = History()
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a crash
                continue
            kind, step = rec.pop("kind", None), rec.pop("step", None)
            if step is None or (before is not None and (step > before if kind == "eval" else step >= before)):
                continue
            nan = lambda v: float("nan") if v is None else v
            if kind == "train":
                h.steps.append(step)
                h.loss.append(nan(rec.pop("loss", None)))
                for k, v in rec.items():
                    h.train_metrics.setdefault(k, []).append(nan(v))
            elif kind == "telemetry":
                h.tele_steps.append(step)
                h.param_norm.append([nan(v) for v in rec["param_norm"]])
                h.update_norm.append([nan(v) for v in rec["update_norm"]])
            elif kind == "grad":
                h.grad_steps.append(step)
                h.grad_norm.append([nan(v) for v in rec["grad_norm"]])
            elif kind == "dead":
                h.dead_steps.append(step)
                h.dead_fraction.append([nan(v) for v in rec["dead_fraction"]])
            elif kind == "eval":
                h.eval_steps.append(step)
                h.eval_loss.append(nan(rec.pop("loss", None)))
                for k, v in rec.items():
                    h.eval_metrics.setdefault(k, []).append(nan(v))
    return h


def _rewrite(path: str, h: History) -> None:
    """Rewrite ``path`` to hold exactly ``h`` (drops what a crashed run logged past its checkpoint)."""
    open(path, "w").close()
    _MetricsLog(path, None, History()).sync(h)


# ----------------------------------------------------------------------------- data and eval

def _train_stream(data: Any, skip: int) -> Iterator:
    """The train batches, with the first ``skip`` consumed (a deterministic iterator resumes exactly)."""
    if is_batch(data):
        return iter_batches(data, None)
    it = iter_batches(data, None)
    for _ in range(skip):
        try:
            next(it)
        except StopIteration:
            break
    return it


class _Evaluator:
    """Mean loss (and accuracy when ``apply`` and integer labels allow) over a fixed list of eval batches."""

    def __init__(self, adapted: Adapted, data: Any, max_batches: int):
        self.adapted = adapted
        self.batches = [data] if is_batch(data) else list(iter_batches(data, max_batches, "eval"))
        self.loss = jax.jit(adapted.loss_fn)
        self.acc = None
        apply = adapted.apply_fn
        if apply is not None:
            exp = adapted.experiment

            def accuracy(params, batch):
                logits, labels = apply(params, get_inputs(exp, batch)), get_labels(exp, batch)
                return jnp.mean((jnp.argmax(logits, -1) == labels).astype(jnp.float32))
            try:
                b = self.batches[0]
                labels = get_labels(exp, b)
                out = jax.eval_shape(apply, adapted.params(adapted.example_state), get_inputs(exp, b))
                if (jnp.issubdtype(labels.dtype, jnp.integer) and out.ndim == labels.ndim + 1):
                    self.acc = jax.jit(accuracy)
            except Exception:
                self.acc = None

    def __call__(self, params: PyTree) -> dict[str, float]:
        losses = [self.loss(params, b) for b in self.batches]
        out = {"loss": float(np.mean(jax.device_get(losses)))}
        if self.acc is not None:
            out["accuracy"] = float(np.mean(jax.device_get([self.acc(params, b) for b in self.batches])))
        return out


class _Progress:
    """A rich progress bar on stderr; nothing when disabled or stderr is not a terminal."""

    def __init__(self, enabled: bool, total: int, start: int, name: str):
        self.bar = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                                console=Console(stderr=True), transient=False)
            self.task = self.bar.add_task(f"[jaxsane] fit {name}", total=total, completed=start, info="")
            self.bar.start()

    def update(self, completed: int, info: str = "") -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=completed, info=info)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


# ----------------------------------------------------------------------------- fit

def fit(experiment: Experiment, *, steps: int, eval_every: int | None = None, checkpoint_dir: str | None = None,
        checkpoint_every: int = 100, keep: int = 3, resume: bool = True, key: jax.Array | None = None,
        on_nonfinite: str = "rollback", max_rollbacks: int = 3, patience: int | None = None,
        min_delta: float = 0.0, eval_batches: int = 10, telemetry_every: int | None = None,
        dead_every: int | None = None,
        log_every: int = 100, metrics_path: str | None = None, tensorboard_dir: str | None = None,
        progress: bool = True, report: str | None = None, dump_dir: str | None = None,
        thresholds: dict | None = None, restore_best: bool = False) -> FitResult:
    """Train ``experiment`` for ``steps`` steps under guard and the monitor, with checkpoints and early stopping.

    Args:
      experiment: the :class:`Experiment`; its ``train`` data is consumed one batch per step.
      steps: total steps (batches), counting those done before a resume.
      eval_every: evaluate on ``experiment.eval`` every this many steps (needs ``loss``); default
        ``steps // 20`` when eval data and a loss are given; 0 disables. Also evaluated before step 1.
      checkpoint_dir: where orbax checkpoints go (None: no checkpoints, no resume).
      checkpoint_every: save after the first step and every this many steps (and at the end).
      keep: how many checkpoints to keep (orbax ``max_to_keep``).
      resume: continue from the latest checkpoint in ``checkpoint_dir`` when there is one.
      key: PRNG key for ``init`` (default ``jax.random.key(0)``).
      on_nonfinite: on a NaN/Inf step (always caught, and located when ``jaxsane.locate`` exists):
        ``"rollback"`` restores the last good checkpoint and skips the offending batches (at most
        ``max_rollbacks`` times); ``"skip"`` keeps the previous state in-graph (guard's skip policy);
        ``"raise"`` stops with :class:`NonFiniteError`.
      patience, min_delta: stop when the eval loss has not improved by more than ``min_delta`` for
        ``patience`` evaluations in a row (None: no early stopping).
      eval_batches: at most this many batches of an eval iterable are used (a single batch is used as is).
      telemetry_every, dead_every, log_every: :class:`Monitor` sampling (norms/gradients, dead ReLUs)
        and how often telemetry is moved to the host. Defaults: ``steps // 40`` clipped to [1, 50] (at
        least 40 samples for the detectors, at most one telemetry step in 50 on long runs) and
        5x that for dead ReLUs.
      metrics_path: the JSONL metrics file (default ``checkpoint_dir/metrics.jsonl``; None without a dir).
      tensorboard_dir: also write scalars there through tensorboardX/torch/tensorflow if installed.
      progress: a progress bar on stderr (only when stderr is a terminal).
      report: write a self-contained HTML report of the run there.
      dump_dir: where guard dumps the inputs of a failing step.
      thresholds: keyword overrides for :func:`jaxsane.check_training`.
      restore_best: return the state of the best evaluation as ``FitResult.state`` (the last one stays
        in ``last_state``), like Keras' ``restore_best_weights``. A copy is kept on the host at each
        improvement and, with ``checkpoint_dir``, checkpointed at that step, so a resumed run finds it
        too (unless ``keep`` pruned it: then the last state is returned, with a warning).

    Returns:
      A :class:`FitResult`.

    Raises:
      NonFiniteError: with ``on_nonfinite="raise"``, after ``max_rollbacks`` rollbacks, or when
        ``"skip"`` skipped too many steps in a row.
      ExperimentError: bad arguments.

    Not jit-safe.

    Example:
      >>> from jaxsane.examples import load
      >>> result = fit(load("digits_optax"), steps=20, progress=False)  # doctest: +SKIP
      >>> result.diagnosis.by_code("train")  # doctest: +SKIP
      []
    """
    if not isinstance(experiment, Experiment):
        raise ExperimentError(f"fit needs a jaxsane.Experiment, got {type(experiment).__name__}.")
    if on_nonfinite not in POLICIES:
        raise ExperimentError(f"fit(on_nonfinite=...) must be one of {POLICIES}, got {on_nonfinite!r}.")
    if steps < 1 or checkpoint_every < 1 or keep < 1:
        raise ExperimentError("fit needs steps >= 1, checkpoint_every >= 1 and keep >= 1.")
    key = jax.random.key(0) if key is None else key
    adapted = Adapted(experiment, key=key)
    state = adapted.init(key)
    can_eval = experiment.eval is not None and adapted.loss_fn is not None
    if eval_every is None:
        eval_every = max(1, steps // 20) if can_eval else 0
    if eval_every and not can_eval:
        raise ExperimentError("fit(eval_every=...) needs Experiment(eval=..., loss=...).")
    if patience is not None and not eval_every:
        raise ExperimentError("early stopping (patience=...) needs evaluation: pass eval data, a loss and eval_every.")
    if checkpoint_dir is not None and metrics_path is None:
        metrics_path = os.path.join(checkpoint_dir, "metrics.jsonl")
    if checkpoint_dir is not None:
        os.makedirs(checkpoint_dir, exist_ok=True)
    if metrics_path and os.path.dirname(metrics_path):
        os.makedirs(os.path.dirname(metrics_path), exist_ok=True)

    if telemetry_every is None:
        telemetry_every = max(1, min(50, steps // 40))
    if dead_every is None:
        dead_every = 5 * telemetry_every
    monitor = Monitor(adapted, every=telemetry_every, dead_every=dead_every, log_every=log_every)
    ckpt = _Checkpoints(checkpoint_dir, keep, state) if checkpoint_dir else None
    loop = {"best": None, "best_step": None, "bad_evals": 0, "rollbacks": 0}
    start, resumed_from = 0, None
    if ckpt is not None and resume and ckpt.latest() is not None:
        resumed_from = ckpt.latest()
        state, meta = ckpt.restore(resumed_from)
        start = int(meta.get("position", resumed_from))
        loop.update({k: meta[k] for k in loop if k in meta})
        if metrics_path and os.path.exists(metrics_path):
            monitor.history = read_history(metrics_path, before=start)
            _rewrite(metrics_path, monitor.history)
    elif metrics_path:
        open(metrics_path, "w").close()
    log = _MetricsLog(metrics_path, tensorboard_dir, monitor.history)

    guarded = guard(monitor.compiled_step, on_nonfinite="skip" if on_nonfinite == "skip" else "raise", dump_dir=dump_dir)
    positions: list[int] = []     # guard call index -> data position
    diagnosis = Diagnosis(name=experiment.name)
    evaluator = _Evaluator(adapted, experiment.eval, eval_batches) if eval_every else None
    good = (start, state)         # last state known finite (flushed), for rollback
    bar = _Progress(progress, steps, start, experiment.name)
    stopped_early = False
    seen_failures = 0

    def note_failures() -> None:
        nonlocal seen_failures
        for f in guarded.failures[seen_failures:]:
            at = positions[f.step] if f.step is not None and f.step < len(positions) else f.step
            diagnosis.add(dataclasses.replace(f, step=at))
        seen_failures = len(guarded.failures)

    saved = [start]
    best: list = [None]           # (position, host copy of the state) at the best evaluation

    def checkpoint(position: int) -> None:
        nonlocal good
        guarded.flush()
        note_failures()
        good = (position, state)
        monitor.pull()
        log.sync(monitor.history)
        if ckpt is not None and saved[0] != position:
            ckpt.save(position, state, {"position": position, **loop})
        saved[0] = position

    def evaluate(position: int) -> bool:
        """Evaluate; True when early stopping says stop."""
        result = evaluator(adapted.params(state))
        monitor.record_eval(position, result.pop("loss"), **result)
        value = monitor.history.eval_loss[-1]
        if loop["best"] is None or value < loop["best"] - min_delta:
            loop["best"], loop["best_step"], loop["bad_evals"] = value, position, 0
            if restore_best:
                best[0] = (position, _keep_copy(state))
                if position > 0:
                    checkpoint(position)
        else:
            loop["bad_evals"] += 1
        return patience is not None and loop["bad_evals"] >= patience

    def handle(error: NonFiniteError) -> None:
        """A non-finite step: record it, then roll back to the last good state or re-raise, by policy."""
        nonlocal state
        note_failures()
        if on_nonfinite != "rollback" or loop["rollbacks"] >= max_rollbacks:
            raise error
        loop["rollbacks"] += 1
        back, state = good
        warnings.warn(f"[jaxsane] non-finite step: rolled back to the state after step {back} "
                      f"({loop['rollbacks']}/{max_rollbacks} rollbacks); batches {back}..{position - 1} "
                      f"are skipped.\n{error}", JaxsaneWarning, stacklevel=3)

    if patience is not None and loop["bad_evals"] >= patience:
        stopped_early = True      # resumed after early stopping: nothing left to do
        steps = start
    batches = _train_stream(experiment.train, start)
    position = start              # batches consumed so far: the data position and the step count
    try:
        if eval_every and start == 0:
            evaluate(0)
        while position < steps:
            try:
                batch = next(batches)
            except StopIteration:
                break
            i, position = position, position + 1
            try:
                new_state, metrics = guarded(state, batch, monitor.mode_for(i))
                positions.append(i)
                state = new_state
                monitor.record(i, metrics, state, batch)
                stop = False
                if eval_every and position % eval_every == 0:
                    guarded.flush()
                    stop = stopped_early = evaluate(position)
                if stop or position == 1 or position % checkpoint_every == 0 or position == steps:
                    checkpoint(position)
                if position % log_every == 0:
                    bar.update(position, _bar_info(monitor.history))
                if stop:
                    break
            except NonFiniteError as e:
                handle(e)
        while True:               # the last steps' flags, and the final checkpoint
            try:
                guarded.flush()
                note_failures()
                if saved[0] != position:
                    checkpoint(position)
                break
            except NonFiniteError as e:
                handle(e)
    finally:
        bar.close()
        monitor.pull()
        log.sync(monitor.history)
        if ckpt is not None:
            ckpt.close()
    last_state = state
    if restore_best:
        state = _best_state(best[0], loop["best_step"], ckpt_dir=checkpoint_dir, keep=keep, like=state,
                            init=lambda: adapted.init(key)) if loop["best_step"] is not None else state
    diagnosis.add(check_training(monitor.history, **(thresholds or {})))
    if loop["rollbacks"]:
        diagnosis.artifacts["rollbacks"] = loop["rollbacks"]
    diagnosis.artifacts["run"] = monitor.history
    result = FitResult(state=state, history=monitor.history, diagnosis=diagnosis, step=position,
                       resumed_from=resumed_from, stopped_early=stopped_early, best_step=loop["best_step"],
                       best_eval_loss=loop["best"], rollbacks=loop["rollbacks"], checkpoint_dir=checkpoint_dir,
                       metrics_path=metrics_path, adapted=adapted, last_state=last_state,
                       restored_best=state is not last_state)
    if report is not None:
        from ._report import write_html
        write_html(report, [diagnosis])
    return result


def _bar_info(h: History) -> str:
    parts = []
    if h.loss:
        parts.append(f"loss {h.loss[-1]:.4g}")
    if h.eval_loss:
        parts.append(f"eval {h.eval_loss[-1]:.4g}")
    return "  ".join(parts)
