"""Root causes and consequences: one bug, one error.

A bug has one root cause and often several consequences: labels off by one give a NaN loss, and the
NaN loss breaks the gradient check, the overfit sweep and the training detectors. :func:`link_consequences`
applies the documented rules below to a list of findings and returns the same findings (same order)
with ``caused_by`` set on every consequence, pointing at its ROOT (chains resolve to the first root:
labels -> NaN loss -> grad check gives the grad finding ``caused_by = data.label_range``).

Rules (``root -> consequence``), each applied only when the consequence does not come before its root
(when both findings carry a step, the consequence's step is not earlier than the root's):

* **bad data -> non-finite values.** ``data.label_range`` (an out-of-range label gathers a NaN
  log-probability), ``data.all_padding`` (a masked mean over a row with no real token is 0/0) and
  ``nonfinite.input`` make every non-finite fact a consequence; the non-finite finding's fix then
  starts with the data problem ("check the labels first: ..."). ``data.label_range`` also makes
  ``data.imbalance`` a consequence (labels shifted by one leave class 0 empty).
  ``data.unnormalized``/``data.outliers`` are deliberately not roots: large inputs *may* overflow, but
  folding a located ``log(0)`` under them would hide the real bug.
* **non-finite facts, in the order the step computes them.** The non-finite facts are
  ``nonfinite.forward``, ``nonfinite.backward``, ``nonfinite.update``, ``dist.nonfinite_shard`` and
  ``init.loss`` with a non-finite loss. A forward NaN makes backward/update/shard NaNs and a NaN loss at
  init consequences; a backward NaN makes update/shard NaNs consequences. The same fact found again by
  another stage (same code, no location of its own, or the same file:line) is a consequence of the
  first, located one.
* **non-finite loss/gradients -> everything judged from them.** A non-finite fact makes
  ``overfit.failed`` and ``model.ignores_input`` consequences, and every ``train.*`` finding when the
  fact was met during a run (it has a step; a check at init that the run never met leaves the run's
  dynamics alone) or the train finding is itself about a loss that went non-finite. ``init.loss``,
  ``grad.mismatch`` and ``grad.missing`` (judged at init) are consequences of a forward-side fact at init
  (step 0 or no step: a forward NaN, a NaN loss at init), or of any non-finite fact when the grad
  finding's own derivatives are non-finite.
* **no learning -> no fit.** ``step.no_update``, ``step.opt_state_frozen`` and ``train.update_underflow``
  (bf16 updates that round away) make ``overfit.failed``,
  ``model.ignores_input``, ``train.plateau`` and a too-small ``train.update_ratio`` consequences.
* **an input-blind model cannot fit.** ``model.ignores_input`` makes ``overfit.failed`` a consequence.
* **a leaf without gradient never moves.** ``grad.missing`` makes ``train.vanishing_grads`` and a too-small
  ``train.update_ratio`` on the same leaf consequences, and the other leaves of the same layer
  (``params['enc']['bias']`` beside ``params['enc']['kernel']``, the same ``depends`` verdict: one
  stop_gradient, one unused layer) consequences of the first.

When several roots could claim a finding, the first rule above wins (bad data over a NaN, a NaN over a
frozen step), then the earliest finding. A ``caused_by`` that is already set (by a stage that knows)
is kept and resolved to its root. Pure and host-side: not jit-safe, never raises on a finding.

Example:
  >>> from jaxsane import Finding
  >>> fs = link_consequences([Finding("data.label_range", "labels 1..10 with num_classes=10"),
  ...                         Finding("nonfinite.forward", "loss is NaN", "clip the gather"),
  ...                         Finding("overfit.failed", "no configuration fit")])
  >>> [f.caused_by.code if f.caused_by else None for f in fs]
  [None, 'data.label_range', 'data.label_range']
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence

from .finding import Finding, RootCause

DATA_ROOTS = ("data.label_range", "data.all_padding", "nonfinite.input")
# non-finite facts by the order in which a step computes them (input is data, above)
NONFINITE_RANK = {
    "nonfinite.forward": 0,
    "nonfinite.literal": 0,  # a NaN/Inf constant of the program: every value computed from it is garbage
    "init.loss": 0,
    "nonfinite.backward": 1,
    "nonfinite.update": 2,
    "dist.nonfinite_shard": 3,
}
FROZEN_ROOTS = ("step.no_update", "step.opt_state_frozen", "train.update_underflow")
JUDGED = ("overfit.failed", "model.ignores_input")

_DATA_HINTS = {
    "data.label_range": "check the labels first: {message} (data.label_range); an out-of-range label gathers a "
    "NaN log-probability, so fix the labels (or num_classes) and this non-finite value goes "
    "away with them",
    "data.all_padding": "check the padding first: {message} (data.all_padding); a masked mean over a row with no "
    "real token is 0/0, so drop those rows or guard the denominator (jnp.maximum(count, 1))",
    "nonfinite.input": "check the data first: {message} (nonfinite.input); the batch itself holds NaN/Inf, so clean "
    "or mask it before the model sees it",
}


def _nonfinite_value(x) -> bool:
    try:
        return not math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def is_nonfinite_fact(f: Finding) -> bool:
    """A finding that says a value of the step is NaN/Inf (``init.loss`` only with a non-finite loss)."""
    if f.code == "init.loss":
        return _nonfinite_value(f.extra.get("loss"))
    return f.code in NONFINITE_RANK


def _forward_side(f: Finding) -> bool:
    """Bad data, a forward NaN or a NaN loss: every value computed from the loss at that point is garbage."""
    return f.code in DATA_ROOTS or (is_nonfinite_fact(f) and NONFINITE_RANK[f.code] == 0)


def _at_init(f: Finding) -> bool:
    return f.step is None or f.step == 0


def _grad_values_nonfinite(f: Finding) -> bool:
    return any(_nonfinite_value(f.extra.get(k)) for k in ("autodiff", "finite_diff"))


def _not_before(root: Finding, cons: Finding) -> bool:
    return root.step is None or cons.step is None or cons.step >= root.step


def _located(f: Finding) -> bool:
    return f.file is not None


# each rule: (priority, root predicate, consequence predicate(root, consequence, root_index, cons_index))
_Rule = tuple[int, Callable[["Finding"], bool], Callable[["Finding", "Finding", int, int], bool]]


def _nonfinite_consequence(root: Finding, cons: Finding, i: int, j: int) -> bool:
    if is_nonfinite_fact(cons):
        a, b = NONFINITE_RANK[root.code], NONFINITE_RANK[cons.code]
        if root.code == cons.code:  # the same fact found again by another stage: the located one leads
            if _located(root) and not _located(cons):
                return True
            return i < j and (cons.file, cons.line) == (root.file, root.line)
        if cons.code == "init.loss":  # only a forward NaN makes the loss at init NaN
            return root.code == "nonfinite.forward" and _at_init(root)
        return a < b
    if cons.code.startswith("train."):  # only a NaN met during a run shapes that run's history
        return root.step is not None or "nonfinite_from" in cons.extra
    if cons.code in JUDGED:
        return True
    if cons.code in ("grad.mismatch", "grad.missing", "init.loss"):
        return (_forward_side(root) and _at_init(root)) or _grad_values_nonfinite(cons)
    return False


def _frozen_consequence(root: Finding, cons: Finding, i: int, j: int) -> bool:
    if cons.code in ("overfit.failed", "model.ignores_input", "train.plateau"):
        return True
    return cons.code == "train.update_ratio" and cons.extra.get("direction") == "low"


def _data_consequence(root: Finding, cons: Finding, i: int, j: int) -> bool:
    if is_nonfinite_fact(cons):
        return True
    if cons.code == "data.imbalance" and root.code == "data.label_range":  # shifted labels empty a class
        return True
    if cons.code in ("grad.mismatch", "grad.missing"):  # a NaN loss at the check point
        return _at_init(root) and _grad_values_nonfinite(cons)
    return False


_LAST_KEY = re.compile(r"(\[[^\[\]]*\]|\.[A-Za-z_]\w*)$")


def _leaf(path: str | None) -> str | None:
    """A leaf's path without NNX's ``.value`` (the grads stage shows ``w``, the monitor ``w.value``)."""
    return path[: -len(".value")] if path and path.endswith(".value") else path


def _parent(path: str | None) -> str | None:
    """``params['encoder']['kernel']`` -> ``params['encoder']``; None when there is no module above the leaf."""
    path = _leaf(path)
    if not path:
        return None
    parent = _LAST_KEY.sub("", path)
    return parent if parent != path and _LAST_KEY.search(parent) else None


def _missing_consequence(root: Finding, cons: Finding, i: int, j: int) -> bool:
    if cons.code in ("train.vanishing_grads", "train.update_ratio"):
        # a leaf with no gradient never moves: its tiny update ratio and vanished gradient are the same fact
        return _leaf(cons.path) == _leaf(root.path) and cons.extra.get("direction", "low") == "low"
    if cons.code == "grad.missing" and i < j:  # the layer's other leaves: one stop_gradient, one unused layer
        parent = _parent(root.path)
        return (
            parent is not None
            and parent == _parent(cons.path)
            and root.extra.get("depends") == cons.extra.get("depends")
        )
    return False


RULES: list[_Rule] = [
    (0, lambda f: f.code in DATA_ROOTS, _data_consequence),
    (1, is_nonfinite_fact, _nonfinite_consequence),
    (2, lambda f: f.code == "model.ignores_input", lambda r, c, i, j: c.code == "overfit.failed"),
    (3, lambda f: f.code in FROZEN_ROOTS, _frozen_consequence),
    (4, lambda f: f.code == "grad.missing", _missing_consequence),
]


def root_indices(findings: Sequence[Finding]) -> list[int | None]:
    """For each finding, the index of its ROOT cause in ``findings`` (None for a root). Not jit-safe."""
    n = len(findings)
    direct: list[int | None] = [None] * n
    for j, cons in enumerate(findings):
        preset = cons.caused_by
        if preset is not None:
            match = [i for i, f in enumerate(findings) if i != j and f.code == preset.code and f.where == preset.where]
            direct[j] = match[0] if match else None
            continue
        best: tuple[int, int] | None = None
        for priority, is_root, is_consequence in RULES:
            if best is not None and best[0] <= priority:
                break
            for i, root in enumerate(findings):
                if i == j or not is_root(root) or not _not_before(root, cons):
                    continue
                if is_consequence(root, cons, i, j):
                    best = (priority, i)
                    break
        direct[j] = None if best is None else best[1]

    # resolve chains to the first root; a cycle (only possible through preset links) makes its members roots
    def resolve(j: int) -> int | None:
        seen, k = {j}, direct[j]
        while k is not None:
            if k in seen:
                return None
            seen.add(k)
            if direct[k] is None:
                return k
            k = direct[k]
        return None

    return [resolve(j) for j in range(n)]


def link(findings: Sequence[Finding]) -> tuple[list[Finding], list[int | None]]:
    """:func:`link_consequences` and the index of each finding's root (None for roots). Not jit-safe."""
    roots = root_indices(findings)
    out: list[Finding] = []
    for f, r in zip(findings, roots):
        if r is None:
            out.append(dataclasses.replace(f, caused_by=None) if f.caused_by is not None else f)
            continue
        root = findings[r]
        changes: dict = {"caused_by": RootCause(root.code, root.where)}
        template = _DATA_HINTS.get(root.code)
        if template is not None and is_nonfinite_fact(f):
            lead = template.format(message=root.message.rstrip("."))
            if not f.hint.startswith(lead):
                changes["hint"] = f"{lead}. Then: {f.hint}" if f.hint else lead
        out.append(dataclasses.replace(f, **changes))
    return out, roots


def link_consequences(findings: Sequence[Finding]) -> list[Finding]:
    """Return ``findings`` in the same order with ``caused_by`` set on every consequence (see the module rules).

    Chains resolve to the first root. A non-finite finding caused by bad data gets the data problem at the
    head of its fix. Pure; not jit-safe (host-side).
    """
    return link(findings)[0]
