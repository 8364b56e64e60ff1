"""fit's training loop as an object: :class:`TrainLoop` holds the run's state in named fields (the data
position, the rollback snapshot, the last saved step, the best evaluation, the batches to replay) and its
methods are the loop's parts: one step, an evaluation, a checkpoint, a rollback, the wrap-up.

Host-side driver of compiled steps; not jit-safe.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import time
import warnings
from typing import Any

import jax

from .._core.diagnosis import Diagnosis
from .._core.errors import CheckpointError, FitArgumentError, JaxsaneWarning, NonFiniteError, Preempted
from .._core.frames import user_stacklevel
from .._core.history import History
from .._dist.hang import DEFAULT_FIT_TIMEOUT
from .._experiment.contract import PureExperiment
from .._guard.guard import Guarded
from .._monitor.monitor import Monitor, check_training
from .._render.progress import StepProgress
from . import checkpoint as _ckpt
from .args import FitOptions
from .data import Evaluator, check_first_labels, train_stream
from .metrics_log import MetricsLog, read_history, rewrite
from .prechecks import check_eval_data, record_meta, run_checks
from .preempt import StopRequests
from .result import FitResult
from .spikes import SpikeRollback, SpikeWatch
from .state import Snapshot, best_state, dtype_changes, keep_copy


@dataclasses.dataclass
class LoopMeta:
    """The loop's counters that each checkpoint's meta item carries, so a resumed run continues them."""

    best: float | None = None  # the best eval loss so far
    best_step: int | None = None
    bad_evals: int = 0  # evaluations in a row without improvement (early stopping's count)
    rollbacks: int = 0
    skipped_batches: list[int] = dataclasses.field(default_factory=list)  # data indices a rollback skipped

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def update(self, meta: dict[str, Any]) -> None:
        """Take the counters a checkpoint's meta holds."""
        for field in dataclasses.fields(self):
            if field.name in meta:
                setattr(self, field.name, meta[field.name])


class TrainLoop:
    """One :func:`jaxsane.fit` run: built from the checked :class:`FitOptions` (init, resume, guard, monitor,
    metrics files), then :meth:`run` trains and returns the :class:`FitResult`. Not jit-safe.

    The step counter *is* the data position (``position``: batches consumed, skipped ones included). A host
    copy of the last state known finite (``snapshot``) and the batches consumed since (``consumed``) let
    :meth:`rollback` undo a non-finite step and replay the good batches (``replay``).
    """

    def __init__(self, options: FitOptions):
        o = self.options = options
        self.started = time.perf_counter()
        self.timings: dict[str, float] = {}  # seconds of the checks run before training
        self.key = jax.random.key(0) if o.key is None else o.key
        self.adapted = PureExperiment(o.experiment, key=self.key)
        self.state = self.adapted.init(self.key)
        can_eval = o.experiment.eval is not None and self.adapted.loss_fn is not None
        self.eval_every = (max(1, o.steps // 20) if can_eval else 0) if o.eval_every is None else o.eval_every
        if self.eval_every and not can_eval:
            raise FitArgumentError("fit(eval_every=...) needs Experiment(eval=..., loss=...).")
        if o.patience is not None and not self.eval_every:
            raise FitArgumentError(
                "early stopping (patience=...) needs evaluation: pass eval data, a loss and eval_every."
            )
        every, dead_every, rollback_every = o.telemetry_every, o.dead_every, o.rollback_every
        assert every is not None and dead_every is not None and rollback_every is not None, "checked() sets them"
        self.rollback_every: int = rollback_every
        self.monitor = Monitor(self.adapted, every=every, dead_every=dead_every, log_every=o.log_every)
        self.ckpt = _ckpt.Checkpoints(o.checkpoint_dir, o.keep, self.state) if o.checkpoint_dir else None
        self.meta = LoopMeta()
        self.start = 0
        self.resumed_from: int | None = None
        self.skipped_checkpoints: list[tuple[int, str]] = []
        self._resume()
        self.log = MetricsLog(
            o.metrics_path,
            o.tensorboard_dir,
            self.monitor.history,
            o.checkpoint_dir,
            self.ckpt.complete_steps if self.ckpt is not None else None,
            writer=o.writer,
        )
        self.guarded = self._guard()
        self.positions: list[int] = []  # guard call index -> data position
        self.seen_failures = 0  # guard failures already in the diagnosis
        self.diagnosis = Diagnosis(name=o.experiment.name)
        self.evaluator = Evaluator(self.adapted, o.experiment.eval, o.eval_batches) if self.eval_every else None
        self.rollback_on = o.on_nonfinite == "rollback"
        self.spikes = SpikeWatch(o.on_spike, o.thresholds, o.dump_dir)
        # the last state known finite, on the host
        self.snapshot = Snapshot(self.start, self.state) if self.rollback_on or self.spikes.rolls_back else None
        if o.checks and self.start == 0:
            run_checks(self.adapted, self.diagnosis, self.timings, o.progress)
        self.bar = StepProgress(o.progress, o.steps, self.start, o.experiment.name)
        self.steps = o.steps
        self.stopped_early = False
        self.exhausted_at: int | None = None
        self.skip = set(self.meta.skipped_batches)
        self.replay: collections.deque = collections.deque()  # (index, batch) to run again after a rollback
        self.consumed: list = []  # (index, batch) consumed since the last snapshot
        self.dtype_checked = False
        self.saved = self.start  # the position of the last checkpoint
        self.best_kept: tuple[int, Any] | None = None  # (position, host copy of the state) at the best evaluation
        if o.patience is not None and self.meta.bad_evals >= o.patience:
            self.stopped_early = True  # resumed after early stopping: nothing left to do
            self.steps = self.start
        self.batches = train_stream(o.experiment.train, self.start, o.repeat)
        self.position = self.start  # batches consumed so far: the data position and the step count
        self.failure: BaseException | None = None
        self.stops = StopRequests()  # SIGTERM/SIGINT/JAX's preemption notice, while run() runs
        self.preempted: str | None = None  # what stopped the run at ``position``, once all processes agreed

    # ------------------------------------------------------------------------- setup

    def _resume(self) -> None:
        """Restore the newest intact checkpoint and the metric history saved with it (or start the metrics
        file afresh); on failure close the checkpoint manager, a failed write becoming a CheckpointError."""
        o, ckpt = self.options, self.ckpt
        try:
            if ckpt is not None and o.resume and ckpt.steps():
                step, self.state, meta, self.skipped_checkpoints = ckpt.restore_verified()
                self.resumed_from = step
                if self.skipped_checkpoints:
                    names = "; ".join(f"step {s}: {why}" for s, why in self.skipped_checkpoints)
                    warnings.warn(
                        f"[jaxsane] resuming from checkpoint step {step}, the newest intact one; "
                        f"skipped damaged checkpoints ({names}). They were renamed to "
                        f"<step>{_ckpt.DAMAGED_SUFFIX} in {ckpt.directory}, not deleted.",
                        JaxsaneWarning,
                        stacklevel=user_stacklevel(),
                    )
                self.start = int(meta.get("position", step))
                self.meta.update(meta)
                stored = _ckpt.history_from_meta(meta, self.start)
                if stored is None and o.metrics_path and os.path.exists(o.metrics_path):  # a checkpoint from
                    stored = read_history(o.metrics_path, before=self.start)  # before histories were saved
                self.monitor.history = stored if stored is not None else History()
                if o.metrics_path:
                    rewrite(o.metrics_path, self.monitor.history)
            elif o.metrics_path:
                _ckpt.replace_lines(o.metrics_path, [])
        except BaseException as e:
            complete = ckpt.complete_steps() if ckpt is not None else None
            if ckpt is not None:
                ckpt.shutdown()
            if isinstance(e, OSError):
                raise _ckpt.disk_error(
                    e, "metrics file or checkpoint directory at start", o.checkpoint_dir, complete
                ) from e
            raise

    def _guard(self) -> Guarded:
        """The monitored step under guard. It compiles one variant per telemetry mode (a static argument): not
        worth a warning. Guarded, not guard(): JAXSANE_ON_NONFINITE is for the user's own guard() calls; fit
        keeps its policy."""
        o = self.options
        if o.hang_timeout == "auto":
            hang_timeout = DEFAULT_FIT_TIMEOUT if jax.process_count() > 1 else None
        else:
            assert not isinstance(o.hang_timeout, str), "FitOptions.checked turned it into seconds or None"
            hang_timeout = o.hang_timeout
        return Guarded(
            self.monitor.compiled_step,
            on_nonfinite="skip" if o.on_nonfinite == "skip" else "raise",
            dump_dir=o.dump_dir,
            warn_recompiles=False,
            hang_timeout=hang_timeout,
        )

    # ------------------------------------------------------------------------- the loop's parts

    def note_failures(self) -> None:
        """Add the guard's new failures to the diagnosis, at their data positions."""
        for f in self.guarded.failures[self.seen_failures :]:
            at = self.positions[f.step] if f.step is not None and f.step < len(self.positions) else f.step
            self.diagnosis.add(dataclasses.replace(f, step=at))
        self.seen_failures = len(self.guarded.failures)

    def verified(self, position: int) -> None:
        """Wait for every step's flags (may raise NonFiniteError); the state is then known finite."""
        self.guarded.flush()
        self.note_failures()
        spiked = self.spikes.find(self)
        if spiked is not None:
            raise SpikeRollback(spiked)
        if self.snapshot is not None and self.snapshot.position != position:
            self.snapshot = Snapshot(position, self.state)
        self.consumed = []

    def checkpoint(self, position: int) -> None:
        """Verify, sync the metrics files and save a checkpoint (once per position)."""
        self.verified(position)
        self.monitor.pull()
        self.log.sync(self.monitor.history)
        if self.ckpt is not None and self.saved != position:
            history = _ckpt.history_json(self.monitor.history)
            self.ckpt.save(position, self.state, {"position": position, **self.meta.as_dict(), "history": history})
        self.saved = position

    def evaluate(self, position: int) -> bool:
        """Evaluate; True when early stopping says stop."""
        o, meta = self.options, self.meta
        self.verified(position)
        assert self.evaluator is not None, "evaluate runs only when eval_every is set"
        result = self.evaluator(self.adapted.params(self.state))
        self.monitor.record_eval(position, result.pop("loss"), **result)
        value = self.monitor.history.eval_loss[-1]
        if meta.best is None or value < meta.best - o.min_delta:
            meta.best, meta.best_step, meta.bad_evals = value, position, 0
            if o.restore_best:
                self.best_kept = (position, keep_copy(self.state))
                if position > 0:
                    self.checkpoint(position)
        else:
            meta.bad_evals += 1
        return o.patience is not None and meta.bad_evals >= o.patience

    def run_step(self, index: int, batch: Any) -> None:
        """One guarded, monitored step on the batch at data index ``index`` (the first one's labels and the
        dtypes its update leaves are checked)."""
        if not self.dtype_checked:
            check_first_labels(self.options.experiment, batch, index)
        new_state, metrics = self.guarded(self.state, batch, self.monitor.mode_for(index))
        self.positions.append(index)
        if not self.dtype_checked:
            self.dtype_checked = True
            _warn_dtype(index, dtype_changes(self.adapted, self.state, new_state))
        self.state = new_state
        self.monitor.record(index, metrics, self.state, batch)

    def maybe_checkpoint(self, stop: bool) -> None:
        """After a step: a checkpoint after the first step, every ``checkpoint_every``, at the last step and
        when stopping early; else every ``rollback_every`` a verified state for rollbacks."""
        o, position = self.options, self.position
        if stop or position == 1 or position % o.checkpoint_every == 0 or position == self.steps:
            self.checkpoint(position)
        elif position % self.rollback_every == 0:  # also where no rollback is kept: the spike watch reads losses
            self.verified(position)

    def advance(self, item: tuple[int, Any]) -> bool:
        """Consume one batch: step (unless a rollback skipped it), evaluate, checkpoint, show; True to stop."""
        index, batch = item
        self.consumed.append(item)
        self.position = index + 1
        if index not in self.skip:
            self.run_step(index, batch)
        stop = False
        if self.eval_every and self.position % self.eval_every == 0:
            stop = self.stopped_early = self.evaluate(self.position)
        # every process asks at every step, and all agree; a stop after the last step is just the end
        if self.stops.stop_here(self.position) and self.position < self.steps:
            self.preempted, stop = self.stops.reason(), True
            print(
                f"[jaxsane] fit: {self.preempted}: stopping after step {self.position} on every process; saving "
                "a checkpoint there (Ctrl-C again stops at once, keeping the newest intact checkpoint)",
                file=sys.stderr,
                flush=True,
            )
        self.maybe_checkpoint(stop)
        self.bar.update(self.position, self._bar_info)
        return stop

    def train_steps(self) -> None:
        """Steps until ``steps`` (or early stopping, or the data running out), then the final checkpoint."""
        while self.position < self.steps:
            item = self.replay.popleft() if self.replay else next(self.batches, None)
            if item is None:
                self.exhausted_at = self.position
                break
            if self.advance(item):
                break
        self.verified(self.position)  # the last steps' flags, and the final checkpoint
        if self.saved != self.position:
            self.checkpoint(self.position)

    def rollback(self, error: NonFiniteError) -> int:
        """A non-finite step: roll back to the last verified state and skip the failing batch (returns the
        new data position), or re-raise, by policy."""
        o, meta = self.options, self.meta
        self.note_failures()
        if not self.rollback_on or meta.rollbacks >= o.max_rollbacks:
            raise error
        assert self.snapshot is not None, "rollback keeps a snapshot from the start"
        meta.rollbacks += 1
        finding = error.finding
        call = getattr(finding, "step", None)
        bad = self.positions[call] if isinstance(call, int) and call < len(self.positions) else None
        back, what = self.restore_snapshot(bad)
        where = f"{getattr(finding, 'code', 'nonfinite')} at {getattr(finding, 'path', None) or 'step'}"
        line = (
            f"[jaxsane] non-finite step ({where}): rolled back to the state after step {back} "
            f"({meta.rollbacks}/{o.max_rollbacks} rollbacks); {what} is skipped, the good batches since "
            f"step {back} are replayed."
        )
        warnings.warn(
            line + (f"\n{error}" if meta.rollbacks == 1 else ""), JaxsaneWarning, stacklevel=user_stacklevel()
        )
        return back

    def rollback_spike(self, spike: SpikeRollback) -> int:
        """A loss spike under ``on_spike="rollback"``/``"skip"``: restore the last verified state, skip the spiking
        batch and replay the others (the new data position); past ``max_rollbacks`` the spike is only recorded."""
        o, meta = self.options, self.meta
        if meta.rollbacks >= o.max_rollbacks or self.snapshot is None:
            self.snapshot = Snapshot(self.position, self.state) if self.snapshot is not None else None
            self.consumed = []
            return self.position
        meta.rollbacks += 1
        back, what = self.restore_snapshot(spike.position)
        warnings.warn(
            f"[jaxsane] loss spike (train.loss_spike) at step {spike.position}: rolled back to the state after step "
            f"{back} ({meta.rollbacks}/{o.max_rollbacks} rollbacks); {what} is skipped, the good batches since "
            f"step {back} are replayed.",
            JaxsaneWarning,
            stacklevel=user_stacklevel(),
        )
        return back

    def restore_snapshot(self, bad: int | None) -> tuple[int, str]:
        """Put the last verified state back, skip batch ``bad`` (every batch since the snapshot when it cannot
        be told) and queue the others for replay; returns (the snapshot's position, what was skipped)."""
        meta = self.meta
        assert self.snapshot is not None, "a rollback keeps a snapshot from the start"
        back = self.snapshot.position
        self.state = self.snapshot.restore()
        self.monitor.pull()
        history = self.monitor.history
        _ckpt.truncate_history(history, back)
        self.log.written = {name: min(n, len(getattr(history, name))) for name, n in self.log.written.items()}
        if bad is None or bad < back:  # cannot tell which batch: skip everything consumed since the snapshot
            bad_batches = [i for i, _ in self.consumed]
        else:
            bad_batches = [bad]
        self.skip.update(bad_batches)
        meta.skipped_batches = sorted(self.skip)
        self.replay.extendleft(reversed(self.consumed))
        self.consumed = []
        return back, f"batch {bad_batches[0]}" if len(bad_batches) == 1 else f"batches {bad_batches}"

    # ------------------------------------------------------------------------- the run

    def run(self) -> FitResult:
        """Train (a failure, Ctrl-C included, is kept until the metrics and checkpoints are closed), wrap up,
        and return the result (or raise the failure, naming the report)."""
        with self.stops:  # signal handlers for the duration of the run only
            try:
                if self.evaluator is not None:  # the eval batches against the first train batch, stepped first
                    self.replay.extend(check_eval_data(self.adapted, self.batches, self.evaluator.batches))
                if self.eval_every and self.start == 0:
                    self.evaluate(0)
                while True:
                    try:
                        self.train_steps()
                        break
                    except NonFiniteError as e:
                        self.position = self.rollback(e)
                        self.exhausted_at, self.stopped_early = None, False
                    except SpikeRollback as e:
                        self.position = self.rollback_spike(e)
                        self.exhausted_at, self.stopped_early = None, False
                if self.preempted is not None:
                    self.verify_stop_checkpoint()
            except BaseException as e:  # KeyboardInterrupt too: the report and the metrics are still written
                self.failure = e
            finally:
                self.bar.close(self._bar_info)
            self.close()
            return self.finish()

    def verify_stop_checkpoint(self) -> None:
        """After a stop request: wait for the checkpoint of the stop step and read it back (checksums, finite
        values), so that the next fit resumes from it; a damaged one is a CheckpointError."""
        if self.ckpt is None:
            return
        try:
            self.ckpt.manager.wait_until_finished()
            self.ckpt.manager.check_for_errors()
        except Exception as e:
            raise self.ckpt.write_error(e, f"checkpoint of step {self.position} (saved on {self.preempted})") from e
        out = self.ckpt.verify(self.position)
        if isinstance(out, str):
            raise CheckpointError(
                f"fit stopped on {self.preempted} at step {self.position}, but its checkpoint {out}. "
                "fix: resume from the checkpoint before it (fit does so itself: call it again).",
                skipped=[(self.position, out)],
            )

    def close(self) -> None:
        """Pull the telemetry, sync the metrics files, close the checkpoints (the first error is kept), and
        record the run in the diagnosis."""
        o, ckpt = self.options, self.ckpt
        wrap_ups = (
            self.monitor.pull,
            lambda: self.log.sync(self.monitor.history),
            ckpt.close if ckpt is not None else None,
        )
        for wrap_up in wrap_ups:
            if wrap_up is None:
                continue
            try:
                wrap_up()
            except Exception as e:
                if self.failure is None:
                    self.failure = e
        self.note_failures()
        self.diagnosis.artifacts["run"] = self.monitor.history
        if self.meta.rollbacks:
            self.diagnosis.artifacts["rollbacks"] = self.meta.rollbacks
            self.diagnosis.artifacts["skipped_batches"] = sorted(self.skip)
        record_meta(
            self.diagnosis,
            steps=self.steps,
            position=self.position,
            started=self.started,
            timings=self.timings,
            checkpoint_dir=o.checkpoint_dir,
            metrics_path=o.metrics_path,
            loop=self.meta.as_dict(),
            resumed_from=self.resumed_from,
            stopped_early=self.stopped_early,
            skipped=sorted(self.skip),
            error=self.failure,
        )
        if self.preempted is not None:  # the report's metadata block says why the run ended there
            self.diagnosis.artifacts["meta"]["stopped_on"] = f"{self.preempted} after step {self.position}"

    def finish(self) -> FitResult:
        """Raise the run's failure (naming the report), or warn when the data ran out early, pick the state to
        return, add the ``train.*`` findings, write the report and return the :class:`FitResult`."""
        o, meta = self.options, self.meta
        if self.failure is not None:
            raised = _failed(self.failure, self.diagnosis, o.report)
            if raised is self.failure:
                raise self.failure
            raise raised from self.failure
        if self.exhausted_at is not None and self.exhausted_at < self.steps:
            warnings.warn(
                f"[jaxsane] the training data ran out after {self.exhausted_at} batches, before steps={self.steps}: "
                f"fit stopped at step {self.exhausted_at}. fix: pass more data, steps={self.exhausted_at}, or "
                "repeat=True to read the data again from its start.",
                JaxsaneWarning,
                stacklevel=user_stacklevel(),
            )
        state = last_state = self.state
        if o.restore_best and meta.best_step is not None:
            state = best_state(
                self.best_kept,
                meta.best_step,
                ckpt_dir=o.checkpoint_dir,
                keep=o.keep,
                like=last_state,
                init=lambda: self.adapted.init(self.key),
            )
        self.diagnosis.add(self.spikes.drop_repeats(check_training(self.monitor.history, **(o.thresholds or {}))))
        result = FitResult(
            state=state,
            history=self.monitor.history,
            diagnosis=self.diagnosis,
            step=self.position,
            resumed_from=self.resumed_from,
            stopped_early=self.stopped_early,
            best_step=meta.best_step,
            best_eval_loss=meta.best,
            rollbacks=meta.rollbacks,
            checkpoint_dir=o.checkpoint_dir,
            metrics_path=o.metrics_path,
            adapted=self.adapted,
            last_state=last_state,
            restored_best=state is not last_state,
            skipped_batches=sorted(self.skip),
            skipped_checkpoints=self.skipped_checkpoints,
            data_exhausted_at=self.exhausted_at,
        )
        if o.report is not None:
            from .._render.html import write_html

            write_html(o.report, [self.diagnosis])
        if self.preempted is not None:
            raise _preempted(self.preempted, result, o.report)
        return result

    def _bar_info(self) -> str:
        h = self.monitor.history
        parts = []
        if h.loss:
            parts.append(f"loss {h.loss[-1]:.4g}")
        if h.eval_loss:
            parts.append(f"eval {h.eval_loss[-1]:.4g}")
        return "  ".join(parts)


def _warn_dtype(step: int, changed: list[str]) -> None:
    if changed:
        warnings.warn(
            f"[jaxsane] step {step} changed the dtype of {len(changed)} parameter(s): "
            f"{'; '.join(changed[:4])}{' ...' if len(changed) > 4 else ''}. Later steps then run in "
            "the new dtype (and the step compiles again). fix: cast updates back to the parameter's "
            "dtype (e.g. (p + u).astype(p.dtype)).",
            JaxsaneWarning,
            stacklevel=user_stacklevel(),
        )


def _preempted(reason: str, result: FitResult, report: str | None) -> Preempted:
    """The Preempted error of a run stopped on ``reason`` at ``result.step``."""
    step = result.step
    path = os.path.join(os.path.abspath(result.checkpoint_dir), str(step)) if result.checkpoint_dir else None
    saved = (
        f"the verified checkpoint of step {step} is {path}; call fit again with the same arguments to resume "
        "from it (same data order, same losses)"
        if path
        else "no checkpoint_dir was given, so nothing was saved; FitResult is on this error's .result"
    )
    where = f"; report: {os.path.abspath(report)}" if report else ""
    return Preempted(
        f"fit stopped on {reason} after step {step} (every process at the same step): {saved}{where}. "
        f"In a script, exit with sys.exit(error.exit_code) ({Preempted.exit_code}: stopped cleanly, resume me).",
        step=step,
        checkpoint=path,
        signal=reason,
        result=result,
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
