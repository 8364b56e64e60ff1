"""fit's data side: the resumable train stream, the first batch's label check, the evaluator over fixed eval
batches.

Host-side only (not jit-safe); the evaluator's loss and accuracy are jitted once each.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.accuracy import class_accuracy
from .._core.errors import DataError
from .._core.tree import PyTree
from .._data.check import check_data
from .._experiment.batches import get_inputs, get_labels, get_mask, is_batch, iter_batches
from .._experiment.contract import Experiment, PureExperiment

# ----------------------------------------------------------------------------- data and eval


def train_stream(data: Any, skip: int, repeat: bool) -> Iterator[tuple[int, Any]]:
    """``(data index, batch)`` pairs after the first ``skip`` (a deterministic iterator resumes exactly).
    With ``repeat`` the data is read again from its start each time it runs out (needs re-iterable data:
    a one-shot iterator ends the stream when its second pass yields nothing)."""
    index, passes = 0, 0
    while True:
        count, passes = 0, passes + 1
        try:
            for batch in iter_batches(data, None):
                count += 1
                if index >= skip:
                    yield index, batch
                index += 1
        except DataError:
            if passes == 1 or count:  # empty on a second pass: a one-shot iterator, ends the stream
                raise
        if not repeat or count == 0:
            return


def check_first_labels(experiment: Experiment, batch: Any, index: int) -> None:
    """Raise :class:`DataError` when the first train batch's labels are out of range (``data.label_range``:
    negative or ``>= num_classes`` integer ids that the Experiment's mask does not cover, float class
    labels, soft labels outside [0, 1]), before any step trains on them. Batches the data check cannot
    read as rows (graph batches, no labels) pass: the doctor's data stage says why; so does a global batch of a
    multi-process job (its arrays span other processes' devices, which this process cannot read). Not jit-safe."""
    if any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in jax.tree_util.tree_leaves(batch)):
        return
    try:
        found = check_data(
            batch,
            num_classes=experiment.num_classes,
            inputs=experiment.inputs,
            labels=experiment.labels,
            mask=experiment.mask,
            max_batches=1,
        )
    except DataError:
        return
    # an ignore index the mask does not cover (a warning in doctor's report) stops fit too, until mask= says so
    bad = [f for f in found.by_code("data.label_range") if f.severity == "error" or "ignore_index" in (f.extra or {})]
    if bad:
        raise DataError(
            f"[jaxsane] fit: train batch {index} has labels out of range, so the loss would train on "
            f"wrong targets: {bad[0].message}\n  fix: {bad[0].hint}. An ignore index that the loss "
            "masks is fine once the Experiment declares the mask: Experiment(mask=lambda b: "
            "b['labels'] != -100) (with your batch's key)."
        )


class Evaluator:
    """Mean loss (and accuracy when ``apply`` and integer labels allow) over a fixed list of eval batches."""

    def __init__(self, adapted: PureExperiment, data: Any, max_batches: int):
        self.adapted = adapted
        self.batches = [data] if is_batch(data) else list(iter_batches(data, max_batches, "eval"))
        assert adapted.loss_fn is not None, "fit evaluates only an Experiment with a loss"
        self.loss = jax.jit(adapted.loss_fn)
        self.acc = None
        apply = adapted.apply_fn
        if apply is not None:
            exp = adapted.experiment

            def accuracy(params, batch):  # an ignored label (-100) or a padded position is not scored
                return class_accuracy(
                    apply(params, get_inputs(exp, batch)), get_labels(exp, batch), get_mask(exp, batch)
                )

            try:
                b = self.batches[0]
                labels = get_labels(exp, b)
                out = jax.eval_shape(apply, adapted.params(adapted.example_state), get_inputs(exp, b))
                if jnp.issubdtype(labels.dtype, jnp.integer) and out.ndim == labels.ndim + 1:
                    self.acc = jax.jit(accuracy)
            except Exception:
                self.acc = None

    def __call__(self, params: PyTree) -> dict[str, float]:
        losses = [self.loss(params, b) for b in self.batches]
        out = {"loss": float(np.mean(jax.device_get(losses)))}
        if self.acc is not None:
            out["accuracy"] = float(np.mean(jax.device_get([self.acc(params, b) for b in self.batches])))
        return out
