"""Symmetric units at init, judged by the first gradient: stuck, slow to part, or parted on purpose.

``check_activations`` flags a hidden layer whose units compute the same value on every example. Such units are
stuck only when they also get the same gradient: then no update ever makes them differ (an ``init.symmetric``
error stays). When the loss's gradient with respect to the layer's kernel differs from unit to unit, what follows
reads each unit differently and the units part on the first update:

* a layer initialised to zero or a constant before its activation (a hidden layer's kernel) parts only through
  the next layer's weights, its first updates of low rank: ``init.symmetric`` as a warning;
* a layer with no activation after it, added into what follows (LoRA's B matrix, the last layer of a residual
  branch, ReZero's gate: zero on purpose), is the standard recipe: no finding.

Host-side; not jit-safe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from .._core.finding import Finding
from .._core.tree import PyTree, leaves_with_paths
from .init import _display, _layer_name

PARTED = 1e-6  # relative difference between two units' gradient columns from which they part on the first step


def _kernel_gradient(grads: PyTree, layer: dict) -> np.ndarray | None:
    """The gradient of the layer's kernel (the float leaf of 2+ dimensions named as the layer, its last axis the
    layer's units), or None when there is no such leaf."""
    for path, g in leaves_with_paths(grads, "params"):
        shape = np.shape(g)
        if len(shape) >= 2 and shape[-1] == layer.get("units") and _layer_name(_display(path)) == layer.get("name"):
            return np.asarray(g, np.float64)
    return None


def parted_by_gradient(g: np.ndarray) -> bool:
    """Whether the units' gradient columns (the last axis of ``g``) are not all the same: they part on the first
    update. All zero, or all equal, is no parting."""
    cols = g.reshape(-1, g.shape[-1])
    scale = float(np.max(np.abs(cols))) if cols.size else 0.0
    return scale > 0 and float(np.max(np.abs(cols - cols[:, :1]))) > PARTED * scale


def judge_by_gradient(findings: list[Finding], gradient: Callable[[], PyTree]) -> list[Finding]:
    """``findings`` with each ``init.symmetric`` error judged by the loss's first gradient (see the module
    docstring); ``gradient()`` gives the gradient with respect to the parameters, or the parameters after the
    first update (their columns differ exactly where the update's do; called once, only when there is such a
    finding; a failure keeps the findings as they are)."""
    if not any(f.code == "init.symmetric" for f in findings):
        return findings
    try:
        grads = gradient()
    except Exception:  # noqa: BLE001 - no gradient to tell the units apart: keep the findings as they are
        return findings
    out = []
    for f in findings:
        layer = (f.extra or {}).get("layer", {})
        g = _kernel_gradient(grads, layer) if f.code == "init.symmetric" else None
        if g is None or not parted_by_gradient(g):
            out.append(f)  # stuck: the same value and the same gradient
        elif layer.get("activation") is not None:
            out.append(_parting_slowly(f, layer))
    return out


def _parting_slowly(f: Finding, layer: dict) -> Finding:
    return dataclasses.replace(
        f,
        severity="warning",
        message=f"all {layer.get('units')} units of {f.path} compute the same value on every example at init "
        f"(max difference {layer.get('symmetry', 0.0):.1e} of the largest activation); the next layer's weights "
        "give each its own gradient, so they part on the first update, but only along a few directions (a "
        "constant or zero kernel before an activation)",
        hint="initialise this layer's kernel randomly (e.g. nn.initializers.lecun_normal / he_normal); a layer "
        "added into a residual (LoRA's B, a branch's last layer) may start at zero",
        extra={**(f.extra or {}), "parts_by_gradient": True},
    )
