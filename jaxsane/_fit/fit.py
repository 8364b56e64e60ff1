"""fit: a guarded, monitored training loop with checkpoints from the first step, early stopping and resume.

``jaxsane.fit(experiment, steps=1000, checkpoint_dir="ckpt")`` runs the experiment's step under
:func:`jaxsane.guard` and the :class:`jaxsane.Monitor`, saves the pure train state with
orbax-checkpoint (asynchronously, keeping the last ``keep``) after the first step and every
``checkpoint_every`` steps, evaluates every ``eval_every`` steps (early stopping on the eval loss
with ``patience``/``min_delta``), writes every metric to ``metrics.jsonl`` (and TensorBoard when a
writer is installed), and ends with the ``train.*`` findings of the run.

Resume: called again with the same ``checkpoint_dir``, ``fit`` restores the newest *intact* checkpoint
(see ``_fit/checkpoint.py``) and skips the batches already consumed, so a deterministic data iterator
yields the same data order and the same losses as an uninterrupted run. The step counter *is* the data
position.

The loop itself is :class:`TrainLoop` in ``_fit/loop.py``; its arguments are checked by ``_fit/args.py``.
Host-side driver; not jit-safe.

Preemption: while fit runs, SIGTERM and Ctrl-C (and, under ``jax.distributed``, the coordination service's
preemption notice) stop every process after the same step, with one verified checkpoint there, the report
and the metrics written; fit then raises :class:`~jaxsane.Preempted` (``exit_code`` 82) and the next call
resumes bitwise. The handlers live in ``_fit/preempt.py``; a second Ctrl-C stops at once.

Rollback: every ``rollback_every`` steps (and at each checkpoint and evaluation) the guard's flags are
read and a host copy of the state is kept. A non-finite step restores that copy, replays the batches
consumed since then (kept in memory) and skips only the failing batch, so the run equals one on the same
data minus that batch.
"""

from __future__ import annotations

from typing import Any

import jax

from .._experiment.contract import Experiment
from .args import POLICIES as POLICIES, FitOptions
from .loop import TrainLoop
from .result import FitResult


def fit(
    experiment: Experiment, *, steps: int, eval_every: int | None = None,
    checkpoint_dir: str | None = None, checkpoint_every: int = 100, keep: int = 3, resume: bool = True,
    key: jax.Array | None = None, on_nonfinite: str = "rollback", max_rollbacks: int = 3,
    patience: int | None = None, min_delta: float = 0.0, eval_batches: int = 10,
    telemetry_every: int | None = None, dead_every: int | None = None, log_every: int = 100,
    metrics_path: str | None = None, tensorboard_dir: str | None = None, writer: Any = None,
    progress: bool = True, report: str | None = None, dump_dir: str | None = None, thresholds: dict | None = None,
    restore_best: bool = False, repeat: bool = False, rollback_every: int | None = None, checks: bool = False,
    hang_timeout: float | None | str = "auto", on_spike: str = "warn",
) -> FitResult:  # fmt: skip
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
      on_spike: on a loss spike (``train.loss_spike``; ``spike_*`` thresholds of check_training, overridable in
        ``thresholds``), seen when the loop verifies its steps: ``"warn"`` records it with its forensics (examples
        carrying the gradient, update-ratio jumps, Adam's second-moment lag; the batch dumped under ``dump_dir``);
        ``"rollback"`` (or ``"skip"``, the same) also restores the last verified state and skips only that batch.

    Returns:
      A :class:`FitResult`.

    Raises:
      Preempted: SIGTERM, Ctrl-C or a preemption notice stopped the run after a step: its ``step``, verified
        ``checkpoint``, ``signal`` and ``result``; a script should ``sys.exit(e.exit_code)`` (82), and calling fit
        again resumes. A second Ctrl-C raises KeyboardInterrupt at once (the newest intact checkpoint stays).
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
    # every parameter by name: FitOptions has one field per parameter (so this must stay the first line)
    options = FitOptions(**locals()).checked()
    return TrainLoop(options).run()
