"""Symmetric units at init, judged by the first gradient: stuck, slow to part, or parted on purpose.

``check_activations`` flags a hidden layer whose units compute the same value on every example. Such units are
stuck only when they also get the same gradient: then no update ever makes them differ (an ``init.symmetric``
error stays). When the loss's gradient with respect to the layer's kernel differs from unit to unit, what follows
reads each unit differently and the units part on the first update:

* a layer initialised to zero or a constant before its activation (a hidden layer's kernel) parts only through
  the next layer's weights, its first updates of low rank: ``init.symmetric`` as a warning;
* a layer with no activation after it, added into what follows (LoRA's B matrix, the last layer of a residual
  branch, ReZero's gate: zero on purpose), is the standard recipe: no finding. The last layer of a residual branch
  (:attr:`LayerStats.merged`) is one even when the sum it joins goes through an activation further on.

A kernel whose gradient is identically zero at init is no proof of symmetry: a zero layer further on (a
diffusion U-Net's zero-initialised output convolution and residual convolutions, DDPM's and ADM's recipe) blocks
every gradient behind it until its own first update. Such a layer is judged by the gradient after one synthetic
update, Adam's first step ``-SIGN_STEP * sign(g)`` on every parameter (:func:`sign_step`), not the user's own: a
warmup that starts from a learning rate of 0 moves nothing on the first step. An all-zero MLP stays at a zero
gradient after it, and stuck. A program with no loss is judged by its own step's updates instead, those that move
some parameter (:func:`moving_updates`).

Host-side; not jit-safe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.finding import Finding
from .._core.tree import PyTree, leaves_with_paths, shown_path
from .init_capture import _layer_name

PARTED = 1e-6  # relative difference between two units' gradient columns from which they part on the first step
SIGN_STEP = 1e-3  # the synthetic first update's size per parameter (Adam's first step is lr * sign(g))
IDLE_UPDATES = 3  # updates of the user's step that move nothing (a warmup from 0) skipped before judging


def _kernel_gradient(grads: PyTree, layer: dict) -> np.ndarray | None:
    """The gradient of the layer's kernel (the float leaf of 2+ dimensions named as the layer, its last axis the
    layer's units), or None when there is no such leaf."""
    for path, g in leaves_with_paths(grads, "params"):
        shape = np.shape(g)
        if len(shape) >= 2 and shape[-1] == layer.get("units") and _layer_name(shown_path(path)) == layer.get("name"):
            return np.asarray(g, np.float64)
    return None


def parted_by_gradient(g: np.ndarray) -> bool:
    """Whether the units' gradient columns (the last axis of ``g``) are not all the same: they part on the first
    update. All zero, or all equal, is no parting."""
    cols = g.reshape(-1, g.shape[-1])
    scale = float(np.max(np.abs(cols))) if cols.size else 0.0
    return scale > 0 and float(np.max(np.abs(cols - cols[:, :1]))) > PARTED * scale


def judge_by_gradient(
    findings: list[Finding], gradient: Callable[[], PyTree], later: Callable[[PyTree], PyTree] | None = None
) -> list[Finding]:
    """``findings`` with each ``init.symmetric`` error judged by the loss's first gradient (see the module
    docstring); ``gradient()`` gives the gradient with respect to the parameters, or the parameters after the
    first update (their columns differ exactly where the update's do); ``later(first)`` the gradient one update
    further, for a layer whose kernel gradient is identically zero at init. Each is called once, only when
    needed; a failure keeps the findings as they are."""
    if not any(f.code == "init.symmetric" for f in findings):
        return findings
    first = _Once(gradient)
    if first() is None:  # no gradient to tell the units apart: keep the findings as they are
        return findings
    second = _Once(None if later is None else lambda: later(first()))
    out = []
    for f in findings:
        layer = (f.extra or {}).get("layer", {})
        g = _kernel_gradient(first(), layer) if f.code == "init.symmetric" else None
        if g is not None and not np.any(g) and second() is not None:  # blocked at init by a zero layer further on
            g = _kernel_gradient(second(), layer)
        if g is None or not parted_by_gradient(g):
            out.append(f)  # stuck: the same value and the same gradient
        elif layer.get("activation") is not None and not layer.get("merged"):
            out.append(_parting_slowly(f, layer))
    return out


def sign_step(params: PyTree, grads: PyTree) -> PyTree:
    """``params`` after the synthetic first update ``-SIGN_STEP * sign(grads)`` on each float leaf. Jit-safe."""

    def step(p: Any, g: Any) -> Any:
        if not (hasattr(p, "dtype") and jnp.issubdtype(p.dtype, jnp.floating) and np.shape(g) == np.shape(p)):
            return p
        return p - jnp.asarray(SIGN_STEP * jnp.sign(g), p.dtype)

    return jax.tree_util.tree_map(step, params, grads)


def moving_updates(step: Callable[[Any], Any], params_of: Callable[[Any], PyTree], state: Any) -> Iterator[PyTree]:
    """The parameters after each update of ``step`` (``state -> state``) that moves some parameter, from
    ``state``; at most ``IDLE_UPDATES`` in a row that move nothing are skipped (then the unmoved parameters).
    Not jit-safe."""
    before = [np.asarray(x) for x in jax.tree_util.tree_leaves(params_of(state))]
    while True:
        for _ in range(IDLE_UPDATES + 1):
            state = step(state)
            params = params_of(state)
            after = [np.asarray(x) for x in jax.tree_util.tree_leaves(params)]
            if any(a.shape != b.shape or not np.array_equal(a, b) for a, b in zip(after, before)):
                break
        before = after
        yield params


class _Once:
    """``fn()`` computed on the first call and kept; None when there is no ``fn`` or it fails."""

    def __init__(self, fn: Callable[[], PyTree] | None):
        self.fn, self.done, self.value = fn, fn is None, None

    def __call__(self) -> PyTree | None:
        if not self.done:
            self.done = True
            try:
                self.value = self.fn()  # type: ignore[misc]
            except Exception:  # noqa: BLE001 - a gradient that cannot be taken judges nothing
                self.value = None
        return self.value


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
