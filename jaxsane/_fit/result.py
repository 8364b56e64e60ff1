"""What :func:`jaxsane.fit` returns: the final state, the history, the diagnosis and the run's bookkeeping
(a plain dataclass, host-side; not a pytree, not for use inside ``jit``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .._core.diagnosis import Diagnosis
from .._core.history import History
from .._core.tree import PyTree
from .._experiment.contract import PureExperiment


@dataclasses.dataclass
class FitResult:
    """What :func:`jaxsane.fit` returns (host-side; not jit-safe).

    Attributes:
      state: the final pure train state (NNX: an ``nnx.State``; see :attr:`user_state`).
      history: the recorded :class:`jaxsane.History` (train/eval losses, telemetry).
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
    adapted: PureExperiment | None = dataclasses.field(repr=False, default=None)
    last_state: PyTree = dataclasses.field(repr=False, default=None)
    restored_best: bool = False
    skipped_batches: list = dataclasses.field(default_factory=list)
    skipped_checkpoints: list = dataclasses.field(default_factory=list)
    data_exhausted_at: int | None = None

    @property
    def user_state(self) -> Any:
        """The final state as the user's own objects (NNX: ``(model, optimizer)``)."""
        assert self.adapted is not None, "a FitResult built by fit() knows its experiment"
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
