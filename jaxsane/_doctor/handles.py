"""The experiment's optional handles as the doctor stages read them: a traceable ``apply`` or ``loss`` and the
batch's labels, when there are any. Not jit-safe (they build or look up programs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._checks.init import traceable
from .._core.errors import JaxsaneError
from .._experiment.batches import get_labels
from .._experiment.contract import Experiment, PureExperiment


def traceable_handle(adapted: PureExperiment, which: str) -> Callable:
    """:func:`traceable` of a handle (``"apply"`` or ``"loss"``) that the caller found present."""
    fn = traceable(adapted, which)
    assert fn is not None, f"Experiment.{which} is missing"
    return fn


def labels_or_none(exp: Experiment, batch: Any) -> Any:
    """The batch's labels, or None when the experiment has none to give."""
    try:
        return get_labels(exp, batch)
    except JaxsaneError:
        return None
