"""Loss-spike forensics: for the batch of a spiking step, which examples carry the gradient, which layers'
update ratio jumped, and whether Adam's second moment lagged the gradient.

* **examples**: per-example losses and gradient norms, ``vmap`` of ``Experiment.loss`` over the batch's
  examples, each as a batch of one (sound for a loss that is a mean over independent examples; a model that
  mixes examples, BatchNorm in train mode, gets the per-example view of eval mode's independence). The
  examples named are the batch's gradient-norm outliers (median + 6·1.4826·MAD), when at most ``top`` of
  them carry ``share`` (default 50%) of the squared norms (else the batch is spread: no example to blame).
* **layers**: ``|update|/|param|`` per leaf at the spiking step, against the median of the run's history;
  a leaf whose ratio rose ``ratio_jump``-fold (default 10) is named.
* **Adam's second moment** (optax ``ScaleByAdamState``: ``nu``): the RMS of the spiking gradient over
  ``sqrt(nu)`` before the step; above ``lag`` (default 10) the second moment had decayed while gradients
  were small, so Adam's step ``mu/(sqrt(nu)+eps)`` was suddenly ~``(1-b1)/sqrt(1-b2)`` times the learning rate
  per element (raise eps, lower beta2, clip).

Host-side driver of a few jitted computations on one batch; not jit-safe.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.finding import Finding
from .._core.history import History
from .._core.tree import PyTree, is_inexact, leaves_with_paths
from .._experiment.contract import PureExperiment
from .monitor import leaf_norms


def batch_size(batch: PyTree) -> int | None:
    """The common leading size of every array leaf of ``batch`` (None when they disagree or are scalars)."""
    sizes = {np.shape(x)[0] for x in jax.tree_util.tree_leaves(batch) if np.ndim(x) >= 1}
    return sizes.pop() if len(sizes) == 1 else None


def per_example(adapted: PureExperiment, params: PyTree, batch: PyTree) -> tuple[np.ndarray, np.ndarray] | None:
    """Per-example ``(losses, gradient norms)`` of ``batch`` at ``params`` (None without a loss or a common
    leading axis). Runs a jitted vmap; not jit-safe itself."""
    loss_fn = adapted.loss_fn
    if loss_fn is None or batch_size(batch) is None:
        return None

    def one(example):
        single = jax.tree_util.tree_map(lambda x: x[None], example)
        value, g = jax.value_and_grad(lambda p: loss_fn(p, single).astype(jnp.float32))(params)
        sq = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree_util.tree_leaves(g) if is_inexact(x))
        return value, jnp.sqrt(sq)

    try:
        losses, norms = jax.jit(jax.vmap(one))(batch)
    except Exception:  # a loss that cannot see one example at a time (batch statistics, fixed shapes)
        return None
    return np.asarray(losses, np.float64), np.asarray(norms, np.float64)


def carriers(norms: np.ndarray, share: float = 0.5, top: int = 5) -> list[int]:
    """The examples that carry the batch's gradient: those whose gradient norm is an outlier of the batch
    (above median + 6 x 1.4826 x MAD and 3x the median), when at most ``top`` of them carry at least ``share``
    of the sum of squared norms (the non-finite ones first when there are any); else ``[]`` (the gradient
    is spread over the batch: no example to blame), largest first."""
    g = np.nan_to_num(np.asarray(norms, np.float64), nan=np.inf)
    sq = g**2
    total = float(np.sum(sq))
    if not total > 0:
        return []
    order = [int(i) for i in np.argsort(-sq)]
    med = float(np.median(g))
    mad = float(np.median(np.abs(g - med)))
    outliers = [i for i in order if g[i] > med + 6 * 1.4826 * mad and g[i] > 3 * med]
    if outliers and len(outliers) <= top and float(np.sum(sq[outliers])) >= share * total:
        return outliers
    if not np.isfinite(total):
        return [i for i in order if not np.isfinite(sq[i])][:top]
    return []


def _adam_nu(state: PyTree) -> PyTree | None:
    """The ``nu`` tree of the first optax ``ScaleByAdamState`` (or any node with ``mu`` and ``nu``) in ``state``."""
    found: list = []

    def is_adam(x):
        if hasattr(x, "mu") and hasattr(x, "nu") and not found:
            found.append(x.nu)
            return True
        return False

    jax.tree_util.tree_leaves(state, is_leaf=is_adam)
    return found[0] if found else None


def adam_lag(adapted: PureExperiment, state: PyTree, batch: PyTree) -> float | None:
    """The largest, over parameter leaves, RMS(gradient) / RMS(sqrt(nu)) before the step (None without Adam's
    state matching the parameters, or without a loss)."""
    nu, loss_fn = _adam_nu(state), adapted.loss_fn
    if nu is None or loss_fn is None:
        return None
    params = adapted.params(state)
    g = jax.grad(lambda p: loss_fn(p, batch).astype(jnp.float32))(params)
    gl = [x for x in jax.tree_util.tree_leaves(g) if is_inexact(x)]
    nl = [x for x in jax.tree_util.tree_leaves(nu) if is_inexact(x)]
    if len(gl) != len(nl) or not gl:
        return None
    ratios = []
    for a, v in zip(gl, nl):
        if np.shape(a) != np.shape(v):
            return None
        rms_nu = float(jnp.sqrt(jnp.mean(v.astype(jnp.float32))))
        rms_g = float(jnp.sqrt(jnp.mean(jnp.square(a.astype(jnp.float32)))))
        if rms_nu > 0:
            ratios.append(rms_g / rms_nu)
    return max(ratios) if ratios else None


def jumped_layers(adapted: PureExperiment, state: PyTree, batch: PyTree, history: History | None, jump: float):
    """``[(leaf path, ratio at the spike, median ratio of the run)]`` for leaves whose ``|update|/|param|``
    at this step is ``jump``-fold their run's median (needs a history with telemetry)."""
    if history is None or not history.update_norm:
        return []
    p0 = adapted.params(state)
    new_state, _ = jax.jit(adapted.step)(state, batch)
    f0 = [x for x in jax.tree_util.tree_leaves(p0) if is_inexact(x)]
    f1 = [x for x in jax.tree_util.tree_leaves(adapted.params(new_state)) if is_inexact(x)]
    now = np.asarray(leaf_norms([a - b for a, b in zip(f1, f0)])) / np.maximum(np.asarray(leaf_norms(f0)), 1e-30)
    with np.errstate(all="ignore"):
        ratio = history.arrays("update_norm") / history.arrays("param_norm")
        med = np.nanmedian(ratio, axis=0) if ratio.size else np.array([])
    paths = [p for p, x in leaves_with_paths(p0, "params") if is_inexact(x)]
    out = []
    for j, (r, m) in enumerate(zip(now, med)):
        if np.isfinite(m) and m > 0 and r > jump * m:
            out.append((paths[j] if j < len(paths) else f"leaf {j}", float(r), float(m)))
    return sorted(out, key=lambda t: -t[1] / t[2])


def explain_spike(
    adapted: PureExperiment,
    state: PyTree,
    batch: PyTree,
    *,
    step: int | None = None,
    loss: float | None = None,
    level: float | None = None,
    history: History | None = None,
    dump_path: str | None = None,
    share: float = 0.5,
    top: int = 5,
    ratio_jump: float = 10.0,
    lag: float = 10.0,
) -> Finding:
    """A ``train.loss_spike`` finding for the step that ran on ``batch`` from ``state`` (the state *before* the
    spike): the examples carrying the gradient, the layers whose update ratio jumped, Adam's second-moment
    lag, and the dump of the batch when one was written. Not jit-safe."""
    params = adapted.params(state)
    pe = per_example(adapted, params, batch)
    examples = carriers(pe[1], share, top) if pe is not None else []
    layers = jumped_layers(adapted, state, batch, history, ratio_jump)
    nu_lag = adam_lag(adapted, state, batch)
    parts = [f"the train loss spiked at step {step}" if step is not None else "the train loss spiked"]
    if loss is not None and level is not None:
        parts[0] += f": {loss:.4g} above its recent robust level {level:.4g}"
    if examples and pe is not None:
        total = float(np.sum(pe[1] ** 2))
        carried = float(np.sum(pe[1][examples] ** 2)) / total if total > 0 else float("nan")
        desc = ", ".join(f"#{i} (loss {pe[0][i]:.3g}, |g| {pe[1][i]:.3g})" for i in examples)
        parts.append(f"{len(examples)} of {len(pe[0])} examples carry {carried:.0%} of the gradient: {desc}")
    elif pe is not None:
        parts.append(f"the gradient is spread over the batch's {len(pe[0])} examples (no few examples carry it)")
    if layers:
        parts.append(
            "update ratio jumped in " + ", ".join(f"{p} ({r:.3g} vs median {m:.3g})" for p, r, m in layers[:4])
        )
    lagged = nu_lag is not None and nu_lag > lag
    if nu_lag is not None:
        parts.append(
            f"Adam's second moment lagged: the gradient's RMS is {nu_lag:.3g}x sqrt(nu)"
            if lagged
            else f"Adam's second moment kept up (gradient RMS {nu_lag:.3g}x sqrt(nu))"
        )
    if dump_path:
        parts.append(f"batch dumped to {dump_path}")
    hints = []
    if examples:
        hints.append(f"inspect and drop examples {examples} of that batch (corrupt or mislabeled data)")
    if lagged:
        hints.append("raise Adam's eps (1e-8 -> 1e-6) or lower beta2 (0.999 -> 0.95)")
    hints.append("clip the gradient norm (optax.clip_by_global_norm(1.0)); fit(on_spike='rollback') skips the batch")
    return Finding(
        "train.loss_spike",
        "; ".join(parts),
        "; ".join(hints),
        step=step,
        path=layers[0][0] if layers else None,
        extra={
            "examples": examples,
            "example_loss": pe[0].tolist() if pe is not None else None,
            "example_grad_norm": pe[1].tolist() if pe is not None else None,
            "layers": [{"path": p, "ratio": r, "median": m} for p, r, m in layers],
            "adam_lag": nu_lag,
            "dump": dump_path,
            "loss": loss,
            "level": level,
        },
    )


def keep_batch(dump_dir: str | None, step: int, state: Any, batch: Any) -> str | None:
    """Dump ``(state, batch)`` of a spiking step under ``dump_dir/spike_step<step>`` (as guard dumps a NaN
    step's inputs); None without a dump_dir or when the dump fails (the finding still says what it found)."""
    if dump_dir is None:
        return None
    import os

    from .._dump.save import save_dump

    try:
        return save_dump(os.path.join(dump_dir, f"spike_step{step}"), (state, batch), meta={"reason": "loss_spike"})
    except Exception:
        return None
