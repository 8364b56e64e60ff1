"""Updates that round away: per parameter leaf, the fraction of elements whose update was lost to rounding.

A bf16 weight keeps 8 significant bits: with round-to-nearest an update smaller than half a unit in the last
place (about ``2^-9`` of the weight) leaves it bitwise unchanged (Zamirai et al., "Revisiting BFloat16
Training", 2020). Pure-bf16 training with a small learning rate then stalls silently.

How "the update was non-zero" is measured (the sound, cheap choice): a **float32 shadow step**. The same
step runs once more on the same batch from the same state with every bf16/fp16 leaf of the state (the
parameters and the optimizer's moments) upcast to float32, which is exactly what float32 master weights
would compute. An element is *lost* when its shadow moved (``shadow_new != float32(old)``) while the real
parameter stayed bitwise equal (``new == old``). A frozen leaf (masked optimizer, ``stop_gradient``) does not
move in the shadow either, so it is never counted (``step.no_update`` stays for that case). The shadow runs
only for states that hold a low-precision float parameter, and only on telemetry steps; a float32 model pays
nothing. Leaves that are not low precision report ``-1`` (not measured).

When the step cannot run on an upcast state (it casts explicitly and the dtypes clash in a ``scan`` carry,
say), the proxy is used instead: an element whose gradient is non-zero but whose low-precision value did
not change, counted only in a leaf where at least one element moved (so a frozen leaf is not counted).

Everything here is jit-safe except :func:`shadow_supported` (traces the step abstractly, host-side).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._core.tree import PyTree, float_leaves, is_inexact

LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def is_low_precision(x: Any) -> bool:
    """True for a bf16 or fp16 array (or abstract value). Jit-safe."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and is_inexact(x) and jnp.dtype(dtype) in LOW_PRECISION


def has_low_precision(tree: PyTree) -> bool:
    """True when some leaf of ``tree`` is bf16/fp16. Jit-safe (reads dtypes only)."""
    return any(is_low_precision(x) for x in jax.tree_util.tree_leaves(tree))


def upcast(tree: PyTree, dtype: Any = jnp.float32) -> PyTree:
    """``tree`` with every bf16/fp16 leaf cast to ``dtype`` (float32 master copies); other leaves as they are.
    Jit-safe."""
    return jax.tree_util.tree_map(lambda x: x.astype(dtype) if is_low_precision(x) else x, tree)


def lost_fractions(old: Sequence[jax.Array], new: Sequence[jax.Array], shadow_new: Sequence[jax.Array]) -> jax.Array:
    """Per float leaf: the fraction of the elements the float32 shadow step moved that the real step did not
    move (``-1`` for a leaf that is not bf16/fp16, ``0`` when the shadow moved nothing). Jit-safe."""
    out = []
    for a, b, s in zip(old, new, shadow_new):
        if not is_low_precision(a):
            out.append(jnp.float32(-1.0))
            continue
        moved32 = s.astype(jnp.float32) != a.astype(jnp.float32)
        lost = moved32 & (b == a)
        n = jnp.sum(moved32)
        out.append(jnp.where(n > 0, jnp.sum(lost) / jnp.maximum(n, 1), 0.0).astype(jnp.float32))
    return jnp.stack(out) if out else jnp.zeros((0,), jnp.float32)


def proxy_lost_fractions(old: Sequence[jax.Array], new: Sequence[jax.Array], grads: Sequence[jax.Array]) -> jax.Array:
    """The fallback of :func:`lost_fractions` when no shadow step can run: per float leaf, the fraction of
    elements with a non-zero gradient whose bf16/fp16 value did not change, in a leaf where some element
    moved (``-1`` for other leaves). Jit-safe."""
    out = []
    for a, b, g in zip(old, new, grads):
        if not is_low_precision(a):
            out.append(jnp.float32(-1.0))
            continue
        pushed = g != 0
        lost = pushed & (b == a)
        n = jnp.sum(pushed)
        any_moved = jnp.any(b != a)
        frac = jnp.where((n > 0) & any_moved, jnp.sum(lost) / jnp.maximum(n, 1), 0.0)
        out.append(frac.astype(jnp.float32))
    return jnp.stack(out) if out else jnp.zeros((0,), jnp.float32)


def shadow_supported(step: Callable, state: PyTree, batch: PyTree, params_of: Callable | None = None) -> bool:
    """True when ``step`` traces on the upcast state and returns a state of the same structure whose
    parameters (``params_of``) stay float32 where they were bf16/fp16 (a step that casts its update back to
    its own dtype would round the shadow the same way). Checked abstractly, nothing runs. Host-side, not
    jit-safe."""
    try:
        new, _ = jax.eval_shape(step, upcast(state), batch)
    except Exception:  # the step insists on its dtypes: the gradient proxy is used instead
        return False
    same: bool = str(jax.tree_util.tree_structure(new)) == str(jax.tree_util.tree_structure(state))
    if not same:
        return False
    if params_of is None:
        return True
    try:
        old, shadow = float_leaves(params_of(state)), float_leaves(params_of(new))
    except Exception:
        return False
    return len(old) == len(shadow) and all(not is_low_precision(s) for a, s in zip(old, shadow) if is_low_precision(a))


def shadow_lost_fractions(
    step: Callable, params_of: Callable, state: PyTree, batch: PyTree, new_params: PyTree
) -> jax.Array:
    """Run the float32 shadow of ``step`` from ``state`` on ``batch`` and compare with the real step's
    ``new_params``: :func:`lost_fractions` per float parameter leaf. Jit-safe (call it inside the jitted
    step; ``state`` must be read before the real step when the step updates it in place)."""
    shadow_state, _ = step(upcast(state), batch)
    old = float_leaves(params_of(state))
    return lost_fractions(old, float_leaves(new_params), float_leaves(params_of(shadow_state)))


def underflow_finding(paths: Sequence[str], fractions: Sequence[float], samples: int, threshold: float, step=None):
    """The ``train.update_underflow`` finding for leaves whose lost fraction reached ``threshold`` (None when
    none did); names every such leaf, the worst first. Host-side, not jit-safe."""
    from .._core.finding import Finding

    bad = sorted((j for j, f in enumerate(fractions) if f == f and f >= threshold), key=lambda j: -fractions[j])
    if not bad:
        return None
    names = [paths[j] if j < len(paths) else f"leaf {j}" for j in bad]
    listed = ", ".join(f"{n} ({fractions[j]:.0%})" for n, j in zip(names[:6], bad[:6]))
    return Finding(
        "train.update_underflow",
        f"updates round away: in {len(bad)} low-precision parameter leaves the median fraction of elements "
        f"whose update was non-zero in float32 but left the weight bitwise unchanged is >= {threshold:.0%}: "
        f"{listed}{' ...' if len(bad) > 6 else ''} (over {samples} sampled steps)",
        "keep float32 master weights (params in float32, compute in bf16: e.g. flax param_dtype=jnp.float32 "
        "with dtype=jnp.bfloat16, or jmp's Policy), or use stochastic rounding for the bf16 update, or a "
        "larger learning rate for these leaves",
        path=names[0],
        step=step,
        extra={"leaves": names, "fractions": [float(fractions[j]) for j in bad], "threshold": threshold},
    )
