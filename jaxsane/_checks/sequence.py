"""Sequence-model checks along the time axis: ``seq.padding_in_loss`` and whether the targets are fed as the
model's input (``seq.future_leakage`` is ``causal.py``'s).

Both chart dependencies along the time axis (axis 1 of ``[B, T, ...]`` inputs), as
``batch.cross_talk`` does along the batch axis ("use backprop to chart dependencies"): token
inputs are integers and have no gradient, so the probes are forward ones, exact in the same way:

* padding in the loss: replace the inputs, and separately the targets, at the positions the mask
  marks as padding; the loss must not move (a masked loss multiplies them by exactly 0). Leaves whose
  padding is their pad id (a loss may weight by ``ids > 0``) are probed by cutting off the trailing
  padding instead; every change is judged against the loss's float noise floor;
* targets fed as the model's input: does output t move when only target t changes (a model that shifts
  them right inside, as Flax's lm1b and wmt, does not).

Nothing here is jit-safe: each check compiles its function once and calls it a few times.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._core.errors import ExperimentError
from .._core.finding import Finding
from .._core.validate import require_callable, require_float, require_int
from .._jaxpr.compile_level import quick_jit
from .time_axis import _binary, _perturb

PyTree = Any


def check_padding_in_loss(
    loss: Callable,
    params: PyTree,
    batch: PyTree,
    mask: Any,
    *,
    inputs: Any = None,
    labels: Any = None,
    rtol: float = 1e-4,
    seed: int = 0,
) -> list[Finding]:
    """``seq.padding_in_loss`` when the loss moves with the contents of padded positions.

    Two forward probes, each compared with the loss's float noise floor (its change when only the
    order of the rows changes, which a mean over examples cannot feel):

    * perturb: the batch's leaves shaped like the mask ``[B, T, ...]`` (the mask itself excepted) are
      changed at the positions the mask marks as padding (mask == 0): once the input leaves, once the
      target leaves (a negative target, an ignore index, is left as it is). The error needs every group
      that has such leaves to move the loss, so a model that derives its own mask from pad ids, or a
      loss that masks by ``labels != -100``, is not blamed for the other half. An integer leaf whose
      padded positions all hold one pad id that no real position holds is never changed: its padding is
      in the ids (a loss may weight by ``ids > 0``, as Flax's lm1b and wmt do), so new ids would un-pad
      those positions rather than probe them;
    * truncate (when such pad-id leaves exist): the trailing columns that are padding in every row (of
      the rows that have them) are cut off; a loss that averages over real positions only, of a model
      whose real positions do not attend to later padding, does not move.

    Args:
      loss: ``(params, batch) -> scalar``.
      params: parameters.
      batch: one batch (a pytree).
      mask: the padding mask ``[B, T]`` (1 or True = real position), e.g. ``batch["mask"]``; or ``[B]``, one
        per example (a batch padded to a fixed size, a graph batch's padding slots): then only the targets of
        the padding examples are changed, and a loss that masks them does not move at all.
      inputs, labels: the batch's inputs and targets (subtrees of ``batch``, as the Experiment's
        handles return them); leaves are matched by identity. Leaves of neither count as both.
      rtol: relative change of the loss allowed; a change must also exceed 30 times the noise floor.
      seed: seed of the float perturbation.

    Returns:
      One ``seq.padding_in_loss`` finding; a ``doctor.skipped`` (info) when the padding is only in pad ids
      and no trailing padding can be cut (nothing left to probe); or nothing (also when the batch has no
      padded position, or its loss is not finite: nothing can be judged then).

    Not jit-safe (compiles ``loss`` once per batch shape and calls it a few times).
    """
    fn = "check_padding_in_loss"
    require_callable(fn, "loss", loss, signature="(params, batch) -> scalar")
    require_float(fn, "rtol", rtol, min=0.0)
    require_int(fn, "seed", seed)
    m = np.asarray(mask)
    if m.ndim not in (1, 2):
        raise ExperimentError(
            f"check_padding_in_loss: the mask has shape {m.shape}; expected [B, T] (1 = real position, 0 = padding) "
            "or [B] (1 = real example, 0 = a padding slot)."
        )
    pad = ~m.astype(bool)
    if not pad.any():
        return []
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    if m.ndim == 1:
        return _padded_examples_in_loss(loss, params, leaves, treedef, pad, labels, rtol, seed)
    groups, pad_ids = _padding_groups(leaves, mask, pad, inputs, labels)
    if not groups and not pad_ids:
        return []
    run = loss_on_leaves(loss, treedef, runs=2 + len(groups))
    host = [np.asarray(x) if np.ndim(x) else x for x in leaves]
    base = float(run(params, host))
    if not np.isfinite(base):
        return []
    floor = _noise_floor(run, params, host, base, m.shape[0])
    rng = np.random.default_rng(seed)
    moved_by: dict[str, float] = {}
    for name, idx in groups.items():
        changed = list(host)
        for i in idx:
            changed[i] = _perturb(host[i], pad, rng)
        moved_by[name] = _relative(float(run(params, changed)), base)
    # a group whose leaves all hold pad ids is judged by cutting off the trailing padding (not at all when that
    # cannot run: then it never makes the error)
    pad_only = [k for k in pad_ids if k not in groups]
    if pad_only:
        ids = [i for v in (*groups.values(), *pad_ids.values()) for i in v]
        cut = _truncated(run, loss_on_leaves(loss, treedef, runs=1, own=True), params, host,
                         _padding_everywhere(host, ids, pad), m.shape[0])  # fmt: skip
        if cut is None and not groups:
            return _cannot_probe(len({i for v in pad_ids.values() for i in v}))
        for k in pad_only:
            moved_by[k] = 0.0 if cut is None else cut
    return _padding_finding(moved_by, pad_only, max(rtol, 30 * floor), pad, floor)


def _padded_examples_in_loss(
    loss: Callable, params: PyTree, leaves: list, treedef: Any, pad: np.ndarray, labels: Any, rtol: float, seed: int
) -> list[Finding]:
    """:func:`check_padding_in_loss` for a per-example mask (``pad`` is ``[B]``): the target leaves with ``B``
    rows changed at the padding examples, the loss and its gradient compared. A masked loss multiplies their
    terms by exactly 0, so there is no float noise to allow for; the gradient, because at init a padding slot's
    prediction is often uniform over the classes (an empty graph pools to the bias), so its loss term is the same
    whatever its target, but never its gradient. A loss that cannot be judged (not finite, no such target) is
    nothing."""
    lab_ids = {id(x) for x in jax.tree_util.tree_leaves(labels)} if labels is not None else set()
    host = [np.asarray(x) if np.ndim(x) else x for x in leaves]
    idx = [
        i
        for i, x in enumerate(leaves)
        if id(x) in lab_ids and np.ndim(x) >= 1 and np.shape(x)[0] == pad.shape[0] and host[i].dtype.kind in "iuf"
    ]
    if not idx:
        return []
    run = quick_jit(
        jax.value_and_grad(lambda p, xs: loss(p, jax.tree_util.tree_unflatten(treedef, xs)), allow_int=True), runs=2
    )
    base, grads = run(params, host)
    if not np.isfinite(float(base)):
        return []
    changed, rng = list(host), np.random.default_rng(seed)
    for i in idx:
        changed[i] = _perturb(host[i], pad, rng)
    value, new_grads = run(params, changed)
    moved = max(_relative(float(value), float(base)), _gradient_change(grads, new_grads))
    return _padding_finding({"targets": moved}, [], rtol, pad, 0.0, unit="examples")


def _gradient_change(grads: PyTree, new: PyTree) -> float:
    """``max |new - grads| / max |grads|`` over the float leaves (0 when the gradient is zero). Host-side."""
    pairs = [
        (np.asarray(g, np.float64), np.asarray(h, np.float64))
        for g, h in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(new))
        if np.asarray(g).dtype.kind == "f"
    ]
    scale = max((float(np.abs(g).max(initial=0.0)) for g, _ in pairs), default=0.0)
    change = max((float(np.abs(h - g).max(initial=0.0)) for g, h in pairs), default=0.0)
    return change / scale if scale > 0 else 0.0


def _padding_finding(
    moved_by: dict[str, float],
    pad_only: list[str],
    clear: float,
    pad: np.ndarray,
    floor: float,
    unit: str = "positions",
) -> list[Finding]:
    """``seq.padding_in_loss`` when every group (``inputs``, ``targets``) moved the loss by more than ``clear``
    (those in ``pad_only`` by cutting off the trailing padding); ``unit``: what the mask marks, ``"positions"`` or
    ``"examples"``."""
    if not moved_by or not all(r > clear for r in moved_by.values()):
        return []
    what = " and ".join(
        f"the trailing padding of the {k} (pad ids) is cut off (relative change {r:.2g})"
        if k in pad_only
        else f"the {k} at padded {unit} change (relative change {r:.2g})"
        for k, r in moved_by.items()
    )
    per = "position" if unit == "positions" else "example"
    return [
        Finding(
            "seq.padding_in_loss",
            f"the loss{'' if per == 'position' else ' (or its gradient)'} changes when only {what}: padding reaches "
            f"the loss ({int(pad.sum())} of {pad.size} "
            f"{unit} are padding in this batch; float noise floor {floor:.2g})",
            f"weight the per-{per} loss by the mask and divide by the number of real {unit}: "
            f"(per_{per} * mask).sum() / jnp.maximum(mask.sum(), 1) (not per_{per}.mean())"
            + (
                "; and mask padded keys in attention so real positions never attend to padding"
                if per == "position"
                else ""
            ),
            path=f"loss <- padded {unit}",
            extra={"relative_change": moved_by, "padded": int(pad.sum()), "noise_floor": floor},
        )
    ]


def _cannot_probe(leaves: int) -> list[Finding]:
    return [
        Finding(
            "doctor.skipped",
            f"padding in the loss not checked: the padding is in the ids themselves ({leaves} integer "
            "leaves hold one pad id at every padded position; a loss may weight by ids > 0, so changing "
            "them would un-pad those positions), and no trailing padding could be cut off to probe instead "
            "(no row ends in padding, or the loss cannot run on a shorter sequence)",
            "",
            severity="info",
        )
    ]


def _padding_groups(
    leaves: list, mask: Any, pad: np.ndarray, inputs: Any, labels: Any
) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """``({"inputs": [...], "targets": [...]}, the same for pad-id leaves)``: the leaf indices each probe changes,
    and per group the integer leaves whose padding is their pad id (never changed)."""
    in_ids = {id(x) for x in jax.tree_util.tree_leaves(inputs)} if inputs is not None else set()
    lab_ids = {id(x) for x in jax.tree_util.tree_leaves(labels)} if labels is not None else set()
    groups: dict[str, list[int]] = {"inputs": [], "targets": []}
    pad_ids: dict[str, list[int]] = {"inputs": [], "targets": []}
    for i, x in enumerate(leaves):
        if x is mask or np.ndim(x) < 2 or tuple(np.shape(x)[:2]) != pad.shape:
            continue
        a = np.asarray(x)
        if a.dtype.kind not in "iufc" or (a.shape == pad.shape and _binary(a) and _marks_padding(a.astype(bool), pad)):
            continue  # another copy of the mask, or its complement (a padding indicator: 1 = padded frame)
        into = pad_ids if _pads_are_ids(a, pad) else groups
        if id(x) in in_ids:
            into["inputs"].append(i)
        elif id(x) in lab_ids:
            into["targets"].append(i)
        else:
            into["inputs"].append(i)
            into["targets"].append(i)
    return {k: v for k, v in groups.items() if v}, {k: v for k, v in pad_ids.items() if v}


def _marks_padding(a: np.ndarray, pad: np.ndarray) -> bool:
    """Whether the boolean leaf ``a`` says what the mask says: real positions (``~pad``) or padded ones (``pad``)."""
    return bool(np.array_equal(a, ~pad) or np.array_equal(a, pad))


def _pads_are_ids(a: np.ndarray, pad: np.ndarray) -> bool:
    """An integer ``[B, T]`` leaf whose padded positions all hold one id that no real position holds."""
    if a.dtype.kind not in "iu" or a.shape != pad.shape:
        return False
    at_pads = a[pad]
    return bool(at_pads.size) and bool((at_pads == at_pads[0]).all()) and not bool((a[~pad] == at_pads[0]).any())


def loss_on_leaves(loss: Callable, treedef: Any, *, runs: float, own: bool = False) -> Callable:
    """``(params, batch leaves) -> loss``, compiled. A ``loss`` that is already jitted (it has ``lower``: doctor
    passes :meth:`PureExperiment.jitted`) is called as it is, so at the shape its caller compiled (the init
    stage's loss, the run's eval) nothing compiles again; ``own=True`` compiles a program of its own anyway,
    for shapes seen once (XLA's quick level, :func:`quick_jit`). Not jit-safe."""
    if hasattr(loss, "lower") and not own:
        return lambda p, xs: loss(p, jax.tree_util.tree_unflatten(treedef, xs))
    return quick_jit(lambda p, xs: loss(p, jax.tree_util.tree_unflatten(treedef, xs)), runs=runs)


def _relative(value: float, base: float) -> float:
    return abs(value - base) / max(abs(base), 1e-12) if np.isfinite(value) else np.inf


def _noise_floor(run: Callable, params: PyTree, host: list, base: float, n: int) -> float:
    """The loss's relative change when only the order of its ``n`` rows changes (reversed): float noise of
    the reductions, which no padding probe can tell from an effect."""
    if n < 2:
        return 0.0
    rev = [x[::-1] if np.ndim(x) and np.shape(x)[0] == n else x for x in host]
    value = _relative(float(run(params, rev)), base)
    return value if np.isfinite(value) else 0.0


def _padding_everywhere(host: list, ids: list[int], pad: np.ndarray) -> np.ndarray:
    """``pad`` less the positions where an integer ``[B, T]`` leaf holds anything but its pad id (the most
    common id at padded positions): the last real token, as the input of a position whose target is padding,
    is still read by the model, and cutting it off is no probe of the padding."""
    out = pad.copy()
    for i in sorted(set(ids)):
        a = host[i]
        if a.shape == pad.shape and a.dtype.kind in "iu" and pad.any():
            values, counts = np.unique(a[pad], return_counts=True)
            out &= a == values[np.argmax(counts)]
    return out


def _truncated(run: Callable, run_new: Callable, params: PyTree, host: list, pad: np.ndarray, n: int) -> float | None:
    """The loss's relative change when the trailing all-padding columns of the rows that end in padding are
    cut off (both losses on those rows only), or None when there are none or the loss fails on them. ``run``
    evaluates the batch's own shape, ``run_new`` the others (each once: a quick compile)."""
    real = ~pad
    T = pad.shape[1]
    lengths = np.where(real.any(axis=1), T - np.argmax(real[:, ::-1], axis=1), 0)
    shorter = lengths[(lengths > 0) & (lengths < T)]
    if not shorter.size:
        return None
    cut_at = int(shorter.max())
    rows = np.flatnonzero((lengths > 0) & (lengths <= cut_at))

    def take(x: Any, cut: bool) -> Any:
        if not np.ndim(x) or np.shape(x)[0] != n:
            return x
        x = x[rows]
        return x[:, :cut_at] if cut and np.ndim(x) >= 2 and np.shape(x)[1] == T else x

    try:
        full = float((run if len(rows) == n else run_new)(params, [take(x, False) for x in host]))
        short = float(run_new(params, [take(x, True) for x in host]))
    except Exception:  # a model that needs the full length: the probe cannot run
        return None
    if not np.isfinite(full):
        return None
    return _relative(short, full)


def loss_reads_first_target(
    loss: Callable, params: PyTree, batch: PyTree, labels: Any, inputs: Any = None
) -> bool | None:
    """Whether ``loss`` reads the targets at position 0 (``labels[:, 0]``).

    Targets equal to the inputs are a bug when the loss compares position t's output with target t,
    and the Hugging Face convention when the loss shifts internally (``logits[:, :-1]`` against
    ``labels[:, 1:]``): then ``labels[:, 0]`` is never read. The labels leaf is found in ``batch`` by
    identity and its first column changed. None when that cannot be judged: no such leaf, the leaf is
    also the inputs, or the loss is not finite.

    Not jit-safe (compiles ``loss`` once, calls it twice).
    """
    lab = jax.tree_util.tree_leaves(labels)
    if len(lab) != 1 or np.ndim(lab[0]) != 2 or np.shape(lab[0])[1] < 2:
        return None
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    at = [i for i, x in enumerate(leaves) if x is lab[0]]
    if len(at) != 1 or any(x is lab[0] for x in jax.tree_util.tree_leaves(inputs)):
        return None
    run = quick_jit(lambda p, xs: loss(p, jax.tree_util.tree_unflatten(treedef, xs)), runs=2)
    host = [np.asarray(x) if np.ndim(x) else x for x in leaves]
    base = float(run(params, host))
    first = np.zeros(np.shape(lab[0]), bool)
    first[:, 0] = True
    changed = list(host)
    changed[at[0]] = _perturb(host[at[0]], first, np.random.default_rng(0))
    value = float(run(params, changed))
    if not (np.isfinite(base) and np.isfinite(value)):
        return None
    return value != base


def output_sees_own_target(apply: Callable, params: PyTree, inputs: Any, labels: Any) -> bool | None:
    """Whether the model's output at position t moves when only the target at position t changes in the
    input leaf that holds the targets (integer ``[B, T]``, equal to ``labels``).

    Targets fed as the model's input are a bug when the model reads position t to predict target t, and
    the Flax lm1b/wmt convention when it shifts them right inside (``shift_right``), so that output t sees
    targets ``< t`` only. Each probed position t gets another positive id in the targets leaf only (pad ids
    0 are left as they are, and no id becomes 0, so an ``ids > 0`` mask is unchanged); the outputs ``[B, T,
    ...]`` at position t are compared. None when nothing can be judged: no input leaf equals the targets, no
    output per position, or non-finite outputs.

    Not jit-safe (compiles ``apply`` once, calls it up to three times).
    """
    lab = jax.tree_util.tree_leaves(labels)
    if len(lab) != 1 or np.ndim(lab[0]) != 2 or np.shape(lab[0])[1] < 3:
        return None
    target = np.asarray(lab[0])
    if target.dtype.kind not in "iu":
        return None
    leaves, treedef = jax.tree_util.tree_flatten(inputs)
    host = [np.asarray(x) if np.ndim(x) else x for x in leaves]
    at = [i for i, x in enumerate(host) if np.shape(x) == target.shape and np.array_equal(x, target)]
    if not at:
        return None
    run = quick_jit(
        lambda p, xs: jax.tree_util.tree_leaves(apply(p, jax.tree_util.tree_unflatten(treedef, xs))), runs=3
    )
    base = [np.asarray(o) for o in run(params, host)]
    n, T = target.shape
    outs = [k for k, o in enumerate(base) if o.ndim >= 2 and o.shape[:2] == (n, T) and o.dtype.kind in "fc"]
    if not outs or not all(np.isfinite(base[k]).all() for k in outs):
        return None
    top = int(target.max())
    if top < 2:
        return None
    judged = False
    for t in (T // 2, T - 1):
        rows = target[:, t] > 0
        if not rows.any():
            continue
        moved = list(host)
        for i in at:
            col = host[i].copy()
            col[rows, t] = col[rows, t] % top + 1  # another positive id: the padding stays as it is
            moved[i] = col
        new = [np.asarray(o) for o in run(params, moved)]
        for k in outs:
            here = np.abs(new[k][rows, t].astype(np.float64) - base[k][rows, t]).max()
            if here > 1e-6 * (np.abs(base[k][rows, t]).max() + 1e-30):
                return True
        judged = True
    return False if judged else None
