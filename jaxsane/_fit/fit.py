"""fit: a guarded, monitored training loop with checkpoints from the first step, early stopping and resume.

``jaxsane.fit(experiment, steps=1000, checkpoint_dir="ckpt")`` runs the experiment's step under
:func:`jaxsane.guard` and the :class:`~jaxsane._monitor.monitor.Monitor`, saves the pure train state with
orbax-checkpoint (asynchronously, keeping the last ``keep``) after the first step and every
``checkpoint_every`` steps, evaluates every ``eval_every`` steps (early stopping on the eval loss
with ``patience``/``min_delta``), writes every metric to ``metrics.jsonl`` (and TensorBoard when a
writer is installed), and ends with the ``train.*`` findings of the run.

Resume: called again with the same ``checkpoint_dir``, ``fit`` restores the newest *intact* checkpoint
(see :mod:`jaxsane._fit.checkpoint`) and skips the batches already consumed, so a deterministic data iterator
yields the same data order and the same losses as an uninterrupted run. The step counter *is* the data
position.

Rollback: every ``rollback_every`` steps (and at each checkpoint and evaluation) the guard's flags are
read and a host copy of the state is kept. A non-finite step restores that copy, replays the batches
consumed since then (kept in memory) and skips only the failing batch, so the run equals one on the same
data minus that batch.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
import warnings
from typing import Any

import jax

from .._core.diagnosis import Diagnosis
from .._core.errors import CheckpointError, ExperimentError, FitArgumentError, JaxsaneWarning, NonFiniteError
from .._core.history import History
from .._core.tree import PyTree
from .._dist.hang import DEFAULT_FIT_TIMEOUT, check_hang_timeout
from .._experiment.contract import Experiment, PureExperiment
from .._guard.guard import Guarded
from .._monitor.monitor import Monitor, check_training
from .._monitor.writers import require_writer
from .._render.progress import StepProgress
from . import checkpoint as _ckpt
from .args import POLICIES as POLICIES, check_dir_arg, check_file_arg, check_fit_arguments
from .data import Evaluator, check_first_labels, train_stream
from .metrics_log import MetricsLog as _MetricsLog, read_history as read_history, rewrite as _rewrite
from .prechecks import record_meta, run_checks
from .state import Snapshot, best_state, dtype_changes, keep_copy


@dataclasses.dataclass
class FitResult:
    """What :func:`fit` returns.

    Attributes:
      state: the final pure train state (NNX: an ``nnx.State``; see :attr:`user_state`).
      history: the recorded :class:`~jaxsane._monitor.monitor.History` (train/eval losses, telemetry).
      diagnosis: ``train.*`` findings of the run plus every non-finite failure seen.
      step: steps taken, counting skipped batches (the data position).
      resumed_from: the checkpoint step the run resumed from, or None.
      stopped_early: True when early stopping ended the run.
      best_step, best_eval_loss: the best evaluation so far (None without eval).
      last_state: the state after the last step (the same object as ``state`` unless ``restore_best``
        put the best evaluation's state in ``state``).
      restored_best: True when ``state`` is the state of the best evaluation (``restore_best=True``).
      rollbacks: how many times a NaN rolled the state back to the last verified state.
      checkpoint_dir, metrics_path: where the checkpoints and the JSONL metrics went (or None).
      skipped_batches: data indices of the batches a rollback skipped (over the whole run, resumes included).
      skipped_checkpoints: ``(step, reason)`` of the damaged checkpoints passed over on resume.
      data_exhausted_at: the step at which the train data ran out before ``steps`` (None when it did not).
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
    adapted: PureExperiment = dataclasses.field(repr=False, default=None)
    last_state: PyTree = dataclasses.field(repr=False, default=None)
    restored_best: bool = False
    skipped_batches: list = dataclasses.field(default_factory=list)
    skipped_checkpoints: list = dataclasses.field(default_factory=list)
    data_exhausted_at: int | None = None

    @property
    def user_state(self) -> Any:
        """The final state as the user's own objects (NNX: ``(model, optimizer)``)."""
        return self.adapted.user_state(self.state)

    @property
    def losses(self) -> list[float]:
        return list(self.history.loss)

    def __repr__(self) -> str:
        from .._render.reprs import fit_repr

        return fit_repr(self)

    def _repr_html_(self) -> str:
        from .._render.html import plot_losses
        from .._render.reprs import fit_html

        return fit_html(self, plot_losses)


# ----------------------------------------------------------------------------- fit


def fit(
    experiment: Experiment,
    *,
    steps: int,
    eval_every: int | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 100,
    keep: int = 3,
    resume: bool = True,
    key: jax.Array | None = None,
    on_nonfinite: str = "rollback",
    max_rollbacks: int = 3,
    patience: int | None = None,
    min_delta: float = 0.0,
    eval_batches: int = 10,
    telemetry_every: int | None = None,
    dead_every: int | None = None,
    log_every: int = 100,
    metrics_path: str | None = None,
    tensorboard_dir: str | None = None,
    writer: Any = None,
    progress: bool = True,
    report: str | None = None,
    dump_dir: str | None = None,
    thresholds: dict | None = None,
    restore_best: bool = False,
    repeat: bool = False,
    rollback_every: int | None = None,
    checks: bool = False,
    hang_timeout: float | None | str = "auto",
) -> FitResult:
    """Train ``experiment`` for ``steps`` steps under guard and the monitor, with checkpoints and early stopping.

    Args:
      experiment: the :class:`Experiment`; its ``train`` data is consumed one batch per step.
      steps: total steps (batches), counting those done before a resume.
      eval_every: evaluate on ``experiment.eval`` every this many steps (needs ``loss``); default
        ``steps // 20`` when eval data and a loss are given; 0 disables. Also evaluated before step 1.
      checkpoint_dir: where orbax checkpoints go (None: no checkpoints, no resume).
      checkpoint_every: save after the first step and every this many steps (and at the end).
      keep: how many checkpoints to keep (orbax ``max_to_keep``).
      resume: continue from the newest intact checkpoint in ``checkpoint_dir`` when there is one. Each
        checkpoint is verified (readable, every item present, per-leaf crc32 equal to the one saved, every
        float finite); damaged newer ones are skipped with a warning and renamed ``<step>.jaxsane-damaged``
        (never deleted); :class:`CheckpointError` when none is intact (no file touched).
      key: PRNG key for ``init`` (default ``jax.random.key(0)``).
      on_nonfinite: on a NaN/Inf step (always caught, and located when ``jaxsane.locate`` exists):
        ``"rollback"`` restores the last verified state kept on the host (see ``rollback_every``), replays
        the good batches since then and skips only the offending batch (at most ``max_rollbacks`` times);
        ``"skip"`` keeps the previous state in-graph (guard's skip policy); ``"raise"`` stops with
        :class:`NonFiniteError`. The words mean what they mean in :func:`jaxsane.guard` (one vocabulary);
        guard's ``"warn"`` is refused here, since training cannot go on from a non-finite state.
      patience, min_delta: stop when the eval loss has not improved by more than ``min_delta`` for
        ``patience`` evaluations in a row (None: no early stopping).
      eval_batches: at most this many batches of an eval iterable are used (a single batch is used as is).
      telemetry_every, dead_every, log_every: :class:`Monitor` sampling (norms/gradients, dead ReLUs)
        and how often telemetry is moved to the host. Defaults: ``steps // 40`` clipped to [1, 50] (at
        least 40 samples for the detectors, at most one telemetry step in 50 on long runs) and
        5x that for dead ReLUs.
      metrics_path: the JSONL metrics file (default ``checkpoint_dir/metrics.jsonl``; None without a dir).
        Append-only with fsync; on resume it is replaced atomically by the history saved in the checkpoint.
      tensorboard_dir: also write scalars there through tensorboardX/torch/tensorflow if installed.
      writer: also send the metrics to this object with clu's metric-writer protocol (``write_scalars(step,
        scalars)``, optional ``flush()``): a ``clu.metric_writers`` writer or your own shim; tags ``train/loss``,
        ``eval/loss``, ``grad_norm/<leaf>``. The JSONL file is written as before.
      progress: progress on stderr: steps/s and ETA, a bar on a terminal, plain lines otherwise (CI logs).
      report: write a self-contained HTML report of the run there (its directory must exist): findings,
        loss curves, telemetry plots and the run metadata (also in ``diagnosis.artifacts["meta"]`` and the
        JSON); written also when fit fails or is interrupted, and the error names it.
      dump_dir: where guard dumps the inputs of a failing step.
      thresholds: keyword overrides for :func:`jaxsane.check_training`.
      restore_best: return the state of the best evaluation as ``FitResult.state`` (the last one stays
        in ``last_state``), like Keras' ``restore_best_weights``. A copy is kept on the host at each
        improvement and, with ``checkpoint_dir``, checkpointed at that step, so a resumed run finds it
        too (unless ``keep`` pruned it: then the last state is returned, with a warning).
      repeat: read the train data again from its start when it runs out (needs re-iterable data). Without
        it, data that runs out before ``steps`` ends the run with a warning, recorded in
        ``FitResult.data_exhausted_at``.
      rollback_every: with ``on_nonfinite="rollback"``, wait for the guard's flags and keep a host copy of
        the state every this many steps (and at every checkpoint and evaluation). Default
        ``min(checkpoint_every, 20)``: one pipeline sync and one device-to-host copy of the state per 20 steps,
        and at most ~20 batches kept in memory for the replay.
      checks: first run the overfit sweep and the init-scale sweep on the first train batch (doctor's
        settings: seconds on a small model; needs ``loss``), so their findings and plots are in the
        diagnosis and the report. Not on a resumed run (they judge the init).
      hang_timeout: guard's ``dist.hang`` watchdog (see :func:`jaxsane.guard`): seconds a step may take, or
        a process may keep the others waiting, before the job is reported stuck and every process exits
        (code 75). ``"auto"`` (default): ``DEFAULT_FIT_TIMEOUT`` = 600 s (PyTorch's default NCCL timeout)
        under ``jax.distributed`` with more than one process, off otherwise; None turns it off. Evaluation
        and checkpoints run outside the guarded step, so only pauses taken by some processes count.

    Returns:
      A :class:`FitResult`.

    Raises:
      NonFiniteError: with ``on_nonfinite="raise"``, after ``max_rollbacks`` rollbacks, or when
        ``"skip"`` skipped too many steps in a row (the message names the report when one was asked).
      CheckpointError: no intact checkpoint to resume from, or a checkpoint/metrics write failed (disk
        full, read-only, no permission); the checkpoints written before are untouched.
      FitArgumentError: bad arguments (an :class:`ExperimentError`), before any work.

    Not jit-safe.

    Example:
      >>> from jaxsane.examples import load
      >>> result = fit(load("digits_optax"), steps=20, progress=False)  # doctest: +SKIP
      >>> result.diagnosis.by_code("train")  # doctest: +SKIP
      []
    """
    if not isinstance(experiment, Experiment):
        raise ExperimentError(f"fit needs a jaxsane.Experiment, got {type(experiment).__name__}.")
    check_fit_arguments(
        steps=steps,
        eval_every=eval_every,
        checkpoint_every=checkpoint_every,
        keep=keep,
        on_nonfinite=on_nonfinite,
        max_rollbacks=max_rollbacks,
        patience=patience,
        min_delta=min_delta,
        eval_batches=eval_batches,
        telemetry_every=telemetry_every,
        dead_every=dead_every,
        log_every=log_every,
        rollback_every=rollback_every,
        thresholds=thresholds,
    )
    steps = int(steps)
    writer = require_writer("jaxsane.fit", writer)
    if hang_timeout != "auto":
        hang_timeout = check_hang_timeout(hang_timeout, "fit", FitArgumentError)
    if report is not None:
        check_file_arg("report", report, create_parent=False)
    if dump_dir is not None:
        check_dir_arg("dump_dir", dump_dir, create=False)
    if checkpoint_dir is not None:
        check_dir_arg("checkpoint_dir", checkpoint_dir, create=True)
    if checkpoint_dir is not None and metrics_path is None:
        metrics_path = os.path.join(checkpoint_dir, "metrics.jsonl")
    if metrics_path is not None:
        check_file_arg("metrics_path", metrics_path, create_parent=True)
    if not isinstance(checks, bool):
        raise FitArgumentError(f"fit(checks=...) must be True or False, got {checks!r}.")
    started, timings = time.perf_counter(), {}
    key = jax.random.key(0) if key is None else key
    adapted = PureExperiment(experiment, key=key)
    state = adapted.init(key)
    can_eval = experiment.eval is not None and adapted.loss_fn is not None
    if eval_every is None:
        eval_every = max(1, steps // 20) if can_eval else 0
    if eval_every and not can_eval:
        raise FitArgumentError("fit(eval_every=...) needs Experiment(eval=..., loss=...).")
    if patience is not None and not eval_every:
        raise FitArgumentError("early stopping (patience=...) needs evaluation: pass eval data, a loss and eval_every.")

    if telemetry_every is None:
        telemetry_every = max(1, min(50, steps // 40))
    if dead_every is None:
        dead_every = 5 * telemetry_every
    if rollback_every is None:
        rollback_every = min(checkpoint_every, 20)
    monitor = Monitor(adapted, every=telemetry_every, dead_every=dead_every, log_every=log_every)
    ckpt = _ckpt.Checkpoints(checkpoint_dir, keep, state) if checkpoint_dir else None
    loop = {"best": None, "best_step": None, "bad_evals": 0, "rollbacks": 0, "skipped_batches": []}
    start, resumed_from, skipped_ckpts = 0, None, []
    try:
        if ckpt is not None and resume and ckpt.steps():
            resumed_from, state, meta, skipped_ckpts = ckpt.restore_verified()
            if skipped_ckpts:
                names = "; ".join(f"step {s}: {why}" for s, why in skipped_ckpts)
                warnings.warn(
                    f"[jaxsane] resuming from checkpoint step {resumed_from}, the newest intact one; "
                    f"skipped damaged checkpoints ({names}). They were renamed to "
                    f"<step>{_ckpt.DAMAGED_SUFFIX} in {ckpt.directory}, not deleted.",
                    JaxsaneWarning,
                    stacklevel=2,
                )
            start = int(meta.get("position", resumed_from))
            loop.update({k: meta[k] for k in loop if k in meta})
            stored = _ckpt.history_from_meta(meta, start)
            if stored is None and metrics_path and os.path.exists(metrics_path):  # a checkpoint from before
                stored = read_history(metrics_path, before=start)  # histories were saved
            monitor.history = stored if stored is not None else History()
            if metrics_path:
                _rewrite(metrics_path, monitor.history)
        elif metrics_path:
            _ckpt.replace_lines(metrics_path, [])
    except BaseException as e:
        complete = ckpt.complete_steps() if ckpt is not None else None
        if ckpt is not None:
            ckpt.manager.close()
        if isinstance(e, OSError):
            raise _ckpt.disk_error(e, "metrics file or checkpoint directory at start", checkpoint_dir, complete) from e
        raise
    log = _MetricsLog(
        metrics_path,
        tensorboard_dir,
        monitor.history,
        checkpoint_dir,
        ckpt.complete_steps if ckpt is not None else None,
        writer=writer,
    )

    # the monitored step compiles one variant per telemetry mode (a static argument): not worth a warning.
    # Guarded, not guard(): JAXSANE_ON_NONFINITE is for the user's own guard() calls; fit keeps its policy
    guarded = Guarded(
        monitor.compiled_step,
        on_nonfinite="skip" if on_nonfinite == "skip" else "raise",
        dump_dir=dump_dir,
        warn_recompiles=False,
        hang_timeout=(DEFAULT_FIT_TIMEOUT if jax.process_count() > 1 else None)
        if hang_timeout == "auto"
        else hang_timeout,
    )
    positions: list[int] = []  # guard call index -> data position
    diagnosis = Diagnosis(name=experiment.name)
    evaluator = Evaluator(adapted, experiment.eval, eval_batches) if eval_every else None
    rollback = on_nonfinite == "rollback"
    snap = [Snapshot(start, state) if rollback else None]  # the last state known finite, on the host
    if checks and start == 0:
        run_checks(adapted, diagnosis, timings, progress)
    bar = StepProgress(progress, steps, start, experiment.name)
    stopped_early = False
    seen_failures = 0
    exhausted_at = None
    skip_set = set(loop["skipped_batches"])
    replay: collections.deque = collections.deque()  # (index, batch) to run again after a rollback
    consumed: list = []  # (index, batch) consumed since the last snapshot
    dtype_checked = False

    def note_failures() -> None:
        nonlocal seen_failures
        for f in guarded.failures[seen_failures:]:
            at = positions[f.step] if f.step is not None and f.step < len(positions) else f.step
            diagnosis.add(dataclasses.replace(f, step=at))
        seen_failures = len(guarded.failures)

    saved = [start]
    best: list = [None]  # (position, host copy of the state) at the best evaluation

    def verified(position: int) -> None:
        """Wait for every step's flags (may raise NonFiniteError); the state is then known finite."""
        nonlocal consumed
        guarded.flush()
        note_failures()
        if rollback and snap[0].position != position:
            snap[0] = Snapshot(position, state)
        consumed = []

    def checkpoint(position: int) -> None:
        verified(position)
        monitor.pull()
        log.sync(monitor.history)
        if ckpt is not None and saved[0] != position:
            ckpt.save(position, state, {"position": position, **loop, "history": _ckpt.history_json(monitor.history)})
        saved[0] = position

    def evaluate(position: int) -> bool:
        """Evaluate; True when early stopping says stop."""
        verified(position)
        result = evaluator(adapted.params(state))
        monitor.record_eval(position, result.pop("loss"), **result)
        value = monitor.history.eval_loss[-1]
        if loop["best"] is None or value < loop["best"] - min_delta:
            loop["best"], loop["best_step"], loop["bad_evals"] = value, position, 0
            if restore_best:
                best[0] = (position, keep_copy(state))
                if position > 0:
                    checkpoint(position)
        else:
            loop["bad_evals"] += 1
        return patience is not None and loop["bad_evals"] >= patience

    def handle(error: NonFiniteError) -> int:
        """A non-finite step: roll back to the last verified state and skip the failing batch (returns the
        new data position), or re-raise, by policy."""
        nonlocal state, consumed
        note_failures()
        if not rollback or loop["rollbacks"] >= max_rollbacks:
            raise error
        loop["rollbacks"] += 1
        finding = error.finding
        call = getattr(finding, "step", None)
        bad = positions[call] if isinstance(call, int) and call < len(positions) else None
        back = snap[0].position
        state = snap[0].restore()
        monitor.pull()
        _ckpt.truncate_history(monitor.history, back)
        log.written = {name: min(n, len(getattr(monitor.history, name))) for name, n in log.written.items()}
        if bad is None or bad < back:  # cannot tell which batch: skip everything consumed since the snapshot
            bad_batches = [i for i, _ in consumed]
        else:
            bad_batches = [bad]
        skip_set.update(bad_batches)
        loop["skipped_batches"] = sorted(skip_set)
        replay.extendleft(reversed(consumed))
        consumed = []
        what = f"batch {bad_batches[0]}" if len(bad_batches) == 1 else f"batches {bad_batches}"
        where = f"{getattr(finding, 'code', 'nonfinite')} at {getattr(finding, 'path', None) or 'step'}"
        line = (
            f"[jaxsane] non-finite step ({where}): rolled back to the state after step {back} "
            f"({loop['rollbacks']}/{max_rollbacks} rollbacks); {what} is skipped, the good batches since "
            f"step {back} are replayed."
        )
        warnings.warn(line + (f"\n{error}" if loop["rollbacks"] == 1 else ""), JaxsaneWarning, stacklevel=3)
        return back

    def next_batch():
        return replay.popleft() if replay else next(batches, None)

    if patience is not None and loop["bad_evals"] >= patience:
        stopped_early = True  # resumed after early stopping: nothing left to do
        steps = start
    batches = train_stream(experiment.train, start, repeat)
    position = start  # batches consumed so far: the data position and the step count
    failure: BaseException | None = None
    try:
        if eval_every and start == 0:
            evaluate(0)
        while True:
            try:
                while position < steps:
                    item = next_batch()
                    if item is None:
                        exhausted_at = position
                        break
                    i, batch = item
                    consumed.append(item)
                    position = i + 1
                    if i not in skip_set:
                        if not dtype_checked:
                            check_first_labels(experiment, batch, i)
                        new_state, metrics = guarded(state, batch, monitor.mode_for(i))
                        positions.append(i)
                        if not dtype_checked:
                            dtype_checked = True
                            _warn_dtype(i, dtype_changes(adapted, state, new_state))
                        state = new_state
                        monitor.record(i, metrics, state, batch)
                    stop = False
                    if eval_every and position % eval_every == 0:
                        stop = stopped_early = evaluate(position)
                    if stop or position == 1 or position % checkpoint_every == 0 or position == steps:
                        checkpoint(position)
                    elif rollback and position % rollback_every == 0:
                        verified(position)
                    bar.update(position, lambda: _bar_info(monitor.history))
                    if stop:
                        break
                verified(position)  # the last steps' flags, and the final checkpoint
                if saved[0] != position:
                    checkpoint(position)
                break
            except NonFiniteError as e:
                position = handle(e)
                exhausted_at, stopped_early = None, False
    except BaseException as e:  # KeyboardInterrupt too: the report and the metrics are still written
        failure = e
    finally:
        bar.close(lambda: _bar_info(monitor.history))
    for wrap_up in (monitor.pull, lambda: log.sync(monitor.history), ckpt.close if ckpt is not None else None):
        if wrap_up is None:
            continue
        try:
            wrap_up()
        except Exception as e:
            if failure is None:
                failure = e
    note_failures()
    diagnosis.artifacts["run"] = monitor.history
    if loop["rollbacks"]:
        diagnosis.artifacts["rollbacks"] = loop["rollbacks"]
        diagnosis.artifacts["skipped_batches"] = sorted(skip_set)
    record_meta(
        diagnosis,
        steps=steps,
        position=position,
        started=started,
        timings=timings,
        checkpoint_dir=checkpoint_dir,
        metrics_path=metrics_path,
        loop=loop,
        resumed_from=resumed_from,
        stopped_early=stopped_early,
        skipped=sorted(skip_set),
        error=failure,
    )
    if failure is not None:
        raised = _failed(failure, diagnosis, report)
        if raised is failure:
            raise failure
        raise raised from failure
    if exhausted_at is not None and exhausted_at < steps:
        warnings.warn(
            f"[jaxsane] the training data ran out after {exhausted_at} batches, before steps={steps}: "
            f"fit stopped at step {exhausted_at}. fix: pass more data, steps={exhausted_at}, or "
            "repeat=True to read the data again from its start.",
            JaxsaneWarning,
            stacklevel=2,
        )
    last_state = state
    if restore_best:
        state = (
            best_state(
                best[0],
                loop["best_step"],
                ckpt_dir=checkpoint_dir,
                keep=keep,
                like=state,
                init=lambda: adapted.init(key),
            )
            if loop["best_step"] is not None
            else state
        )
    diagnosis.add(check_training(monitor.history, **(thresholds or {})))
    result = FitResult(
        state=state,
        history=monitor.history,
        diagnosis=diagnosis,
        step=position,
        resumed_from=resumed_from,
        stopped_early=stopped_early,
        best_step=loop["best_step"],
        best_eval_loss=loop["best"],
        rollbacks=loop["rollbacks"],
        checkpoint_dir=checkpoint_dir,
        metrics_path=metrics_path,
        adapted=adapted,
        last_state=last_state,
        restored_best=state is not last_state,
        skipped_batches=sorted(skip_set),
        skipped_checkpoints=skipped_ckpts,
        data_exhausted_at=exhausted_at,
    )
    if report is not None:
        from .._render.html import write_html

        write_html(report, [diagnosis])
    return result


def _warn_dtype(step: int, changed: list[str]) -> None:
    if changed:
        warnings.warn(
            f"[jaxsane] step {step} changed the dtype of {len(changed)} parameter(s): "
            f"{'; '.join(changed[:4])}{' ...' if len(changed) > 4 else ''}. Later steps then run in "
            "the new dtype (and the step compiles again). fix: cast updates back to the parameter's "
            "dtype (e.g. (p + u).astype(p.dtype)).",
            JaxsaneWarning,
            stacklevel=3,
        )


def _failed(error: BaseException, diagnosis: Diagnosis, report: str | None) -> BaseException:
    """Write the report of a failed run (when one was asked) and return the error to raise, naming it."""
    if report is None:
        return error
    try:
        from .._render.html import write_html

        write_html(report, [diagnosis])
    except Exception as e:  # the report must never hide the failure
        where = f"  report: could not be written to {report} ({type(e).__name__}: {e})"
    else:
        where = f"  report: {os.path.abspath(report)}"
    if isinstance(error, NonFiniteError):
        return NonFiniteError(
            f"{error}\n{where}", error.finding, dump_path=error.dump_path, inputs=error.inputs, located=error.located
        )
    if isinstance(error, CheckpointError):
        return CheckpointError(f"{error}\n{where}", skipped=error.skipped)
    if hasattr(error, "add_note"):
        error.add_note(f"[jaxsane] {where.strip()}")
    return error


def _bar_info(h: History) -> str:
    parts = []
    if h.loss:
        parts.append(f"loss {h.loss[-1]:.4g}")
    if h.eval_loss:
        parts.append(f"eval {h.eval_loss[-1]:.4g}")
    return "  ".join(parts)
