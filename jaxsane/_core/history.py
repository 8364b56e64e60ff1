"""The record of a training run on the host: :class:`History`, which ``Monitor`` and ``fit`` fill,
``check_training`` judges, checkpoints and metric files store, and plots read. Host-side only (numpy),
not jit-safe."""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass
class History:
    """What a monitored run recorded, on the host. Arrays are ``(samples, leaves)``.

    Attributes:
      steps, loss: the train loss of every step (``metrics["loss"]``).
      train_metrics: other scalar train metrics, step-aligned with ``steps``.
      eval_steps, eval_loss, eval_metrics: evaluations (after ``eval_steps[k]`` steps).
      leaf_paths: parameter leaf paths; ``depth`` orders their indices input-side first.
      weight_leaves: indices of leaves with ``ndim >= 2`` (kernels), the ones the layer rules look at.
      tele_steps, param_norm, update_norm, grad_norm: sampled telemetry (``grad_norm`` empty without loss).
      dead_steps, dead_fraction, relu_shapes: sampled dead-ReLU fractions per ReLU site.
      relu_labels: a label per ReLU site (its module scope or ``file:line``), when the monitor found them.
      lost_steps, update_lost: per sampled step, per float leaf, the fraction of the elements whose update
        rounded away (bf16/fp16 leaves only; ``-1`` = not measured), see ``_precision/underflow.py``.
    """

    steps: list = dataclasses.field(default_factory=list)
    loss: list = dataclasses.field(default_factory=list)
    train_metrics: dict = dataclasses.field(default_factory=dict)
    eval_steps: list = dataclasses.field(default_factory=list)
    eval_loss: list = dataclasses.field(default_factory=list)
    eval_metrics: dict = dataclasses.field(default_factory=dict)
    leaf_paths: list = dataclasses.field(default_factory=list)
    depth: list = dataclasses.field(default_factory=list)
    weight_leaves: list = dataclasses.field(default_factory=list)
    tele_steps: list = dataclasses.field(default_factory=list)
    param_norm: list = dataclasses.field(default_factory=list)
    update_norm: list = dataclasses.field(default_factory=list)
    grad_norm: list = dataclasses.field(default_factory=list)
    grad_steps: list = dataclasses.field(default_factory=list)
    dead_steps: list = dataclasses.field(default_factory=list)
    dead_fraction: list = dataclasses.field(default_factory=list)
    relu_shapes: list = dataclasses.field(default_factory=list)
    relu_labels: list = dataclasses.field(default_factory=list)
    lost_steps: list = dataclasses.field(default_factory=list)
    update_lost: list = dataclasses.field(default_factory=list)

    def arrays(self, name: str) -> np.ndarray:
        """A recorded telemetry field as a float array ``(samples, leaves)`` (``NaN`` for sanitized values)."""
        rows = getattr(self, name)
        if not rows:
            return np.zeros((0, 0))
        a = np.asarray(rows, dtype=np.float64)
        return np.where(a < 0, np.nan, a)

    def to_dict(self) -> dict:
        """A JSON-able dict (``from_dict`` reads it back)."""

        def conv(v):
            if isinstance(v, dict):
                return {k: conv(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return [conv(x) for x in v]
            if isinstance(v, (np.generic, np.ndarray)):
                return conv(v.tolist())
            if isinstance(v, float) and not math.isfinite(v):
                return None
            return v

        return {f.name: conv(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> History:
        names = {f.name for f in dataclasses.fields(cls)}

        def conv(v):
            if isinstance(v, list):
                return [conv(x) for x in v]
            if isinstance(v, dict):
                return {k: conv(x) for k, x in v.items()}
            return float("nan") if v is None else v

        return cls(**{k: conv(v) for k, v in d.items() if k in names})

    def layer_grad_norms(self) -> tuple[list[str], np.ndarray]:
        """(weight leaf paths in depth order, grad norms ``(samples, layers)``) for plots and the layer rules."""
        g = self.arrays("grad_norm")
        if g.size == 0:
            return [], g
        idx = [i for i in self.depth if i in set(self.weight_leaves)] or list(self.depth)
        return [self.leaf_paths[i] for i in idx], g[:, idx]
