"""An ignore index in the labels (one value out of range, such as Hugging Face's -100 at every unlabelled
position of a masked LM), judged by the loss: does it test its labels against a constant and weigh its floats by
the result (``weights = labels != -100``, ``where(labels > 0, ce, 0)``)?

Read off the loss's jaxpr, no run: the labels are followed through the ops that only move or cast them; a
comparison of such a value with a constant makes a mask; the mask is followed through every op but the index
operands of gathers, scatters and dynamic slices (``take_along_axis`` normalising a negative label compares it
with 0 too, to index with it); a float the mask reaches is a weight. Changing the ignored labels to probe the
loss would not do: a loss that masks by ``labels != -100`` moves when they change, as one that reads them does.

Not jit-safe (traces the loss once).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax._src import core as jcore

from .._core.finding import Finding
from .._core.tree import PyTree
from .batch import labels_leaf
from .grads_stops import called_jaxpr

_COMPARE = {"eq", "ne", "lt", "le", "gt", "ge"}
_MOVES = {"convert_element_type", "reshape", "squeeze", "expand_dims", "broadcast_in_dim", "slice", "transpose", "copy"}
_INDEXES = {
    "gather": 1,
    "dynamic_slice": 1,
    "dynamic_update_slice": 2,
    "scatter": 1,
    "scatter-add": 1,
}  # first index operand


def loss_masks_labels(loss: Callable, params: PyTree, batch: PyTree, labels: Any) -> bool | None:
    """Whether ``loss`` weighs its floats by a test of its labels against a constant (see the module docstring).
    None when the labels leaf is not found in ``batch`` by identity, or the loss does not trace. Not jit-safe."""
    found = labels_leaf(batch, labels)
    if found is None:
        return None
    host, treedef, at = found
    try:
        closed = jax.make_jaxpr(lambda p, xs: loss(p, jax.tree_util.tree_unflatten(treedef, xs)))(params, host)
    except Exception:  # noqa: BLE001 - a loss that does not trace here: the later stages report it
        return None
    n_params = len(jax.tree_util.tree_leaves(params))
    jaxpr = closed.jaxpr
    return _Flow({jaxpr.invars[n_params + at]}, set(jaxpr.constvars)).weighs(jaxpr)


def judged_ignore_index(findings: list[Finding], probe: Callable[[], tuple]) -> list[Finding]:
    """``findings`` less the ``data.label_range`` warnings of an ignore index that the loss masks out
    (:func:`loss_masks_labels` of ``probe()``'s ``(loss, params, batch, labels)``); kept where it does not or that
    cannot be told. Not jit-safe."""
    if not any(f.code == "data.label_range" and "ignore_index" in (f.extra or {}) for f in findings):
        return findings
    try:
        masks = loss_masks_labels(*probe())
    except Exception:  # noqa: BLE001 - the loss's own problems are the later stages' to report
        masks = None
    return [f for f in findings if not (masks and f.code == "data.label_range" and "ignore_index" in (f.extra or {}))]


class _Flow:
    """The labels' values, the constants and the masks made by comparing them, followed through a jaxpr."""

    def __init__(self, labels: set, consts: set):
        self.labels, self.consts = labels, consts
        self.masks: set = set()

    def _is(self, kind: set, v: Any) -> bool:
        return not isinstance(v, jcore.Literal) and v in kind

    def _const(self, v: Any) -> bool:
        return isinstance(v, jcore.Literal) or v in self.consts

    def weighs(self, jaxpr: Any) -> bool:
        """Whether a mask reaches a float of ``jaxpr`` (nested jaxprs followed through their calls)."""
        for eqn in jaxpr.eqns:
            called = called_jaxpr(eqn)
            if called is not None:
                inner, operands = called
                for kind in (self.labels, self.masks, self.consts):
                    kind.update(i for i, o in zip(inner.invars, operands) if self._is(kind, o))
                self.consts.update(i for i, o in zip(inner.invars, operands) if isinstance(o, jcore.Literal))
                self.consts.update(inner.constvars)
                if self.weighs(inner):
                    return True
                for kind in (self.labels, self.masks, self.consts):
                    kind.update(o for i, o in zip(inner.outvars, eqn.outvars) if self._is(kind, i))
                continue
            if self._step(eqn):
                return True
        return False

    def _step(self, eqn: Any) -> bool:
        """Follow one equation; True when it puts a mask on a float."""
        name, ins, outs = eqn.primitive.name, eqn.invars, eqn.outvars
        if name in _COMPARE and len(ins) == 2:
            a, b = ins
            if (self._is(self.labels, a) and self._const(b)) or (self._is(self.labels, b) and self._const(a)):
                self.masks.update(outs)
                return False
        if name in _MOVES and any(self._is(self.labels, v) for v in ins):
            self.labels.update(outs)
        if ins and all(self._const(v) for v in ins):
            self.consts.update(outs)
        if not ins and name in ("iota",):
            self.consts.update(outs)
        carried = ins[: _INDEXES[name]] if name in _INDEXES else ins  # an index operand is no weight
        if any(self._is(self.masks, v) for v in carried):
            self.masks.update(outs)
            return any(np.issubdtype(np.dtype(o.aval.dtype), np.floating) for o in outs if hasattr(o.aval, "dtype"))
        return False
