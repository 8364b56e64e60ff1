"""``seq.future_leakage``: the output at position t must not move when inputs after t change, in a model declared
causal (:func:`check_causal`) or trained by teacher forcing (:func:`check_teacher_forced`: its targets are an input
one position ahead, so reading that input copies the answer). A forward probe, exact: token inputs are integers
and have no gradient, and a causal mask makes the outputs at positions <= t bitwise equal.

Not jit-safe: each check compiles ``apply`` once (or reuses a compiled one) and calls it a few times.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .._core.errors import ExperimentError
from .._core.finding import Finding
from .._core.validate import require_callable, require_count_or_list, require_float, require_int
from .._jaxpr.compile_level import quick_jit
from .time_axis import _binary, _perturb

PyTree = Any


def _time_leaves(leaves: list, n: int) -> tuple[int | None, list[int]]:
    """(T, indices of the non-mask leaves shaped ``[n, T, ...]``) for the first such leaf's T."""
    T, idx = None, []
    for i, x in enumerate(leaves):
        if np.ndim(x) < 2 or x.shape[0] != n or x.dtype.kind not in "iufc" or _binary(np.asarray(x)):
            continue
        if T is None:
            T = x.shape[1]
        if x.shape[1] == T:
            idx.append(i)
    return T, idx


def _decoder_leaves(host: list, idx: list[int], labels: Any) -> list[int]:
    """Of several time leaves, the decoder's: those equal to the targets or to the targets shifted right by one
    (empty when there is one leaf, no targets, or none matches)."""
    lab = jax.tree_util.tree_leaves(labels)
    if len(idx) < 2 or len(lab) != 1 or np.ndim(lab[0]) != 2:
        return []
    y = np.asarray(lab[0])
    return [
        i
        for i in idx
        if host[i].shape == y.shape and (np.array_equal(host[i], y) or np.array_equal(host[i][:, 1:], y[:, :-1]))
    ]


def _probe_positions(T: int, probes: int | Sequence[int]) -> list[int]:
    if not isinstance(probes, int):
        return sorted({int(t) for t in probes if 0 <= int(t) < T - 1})
    picks = [0, T // 2 - 1, T - 2, T // 4, (3 * T) // 4]
    return sorted(dict.fromkeys(t for t in picks if 0 <= t < T - 1))[: max(1, probes)] if T >= 2 else []


def check_causal(
    apply: Callable,
    params: PyTree,
    inputs: Any,
    *,
    labels: Any = None,
    mask: Any = None,
    probes: int | Sequence[int] = 3,
    rtol: float = 1e-5,
    seed: int = 0,
) -> list[Finding]:
    """``seq.future_leakage`` when a causal model's output at position t depends on inputs after t.

    For each probe position t, every input at positions ``> t`` (of each non-mask input leaf shaped
    ``[B, T, ...]``: token ids get another id, float inputs noise) is replaced; the outputs shaped
    ``[B, T, ...]`` at positions ``<= t`` must not move. A causal mask makes them bitwise equal; a
    missing mask, a mask on the wrong axis (transposed, ``triu`` for ``tril``) or a bidirectional
    layer moves them.

    Args:
      apply: ``(params, inputs) -> outputs`` in eval mode, outputs ``[B, T, ...]`` per position.
      params: parameters.
      inputs: a batch of inputs (an array or pytree; padding masks among them are left unchanged).
      labels: the targets ``[B, T]``, optional. In an encoder-decoder the source legitimately reaches every
        decoder position; when some input leaves are the decoder's (equal to the targets, or to the targets
        shifted right by one), only those are changed.
      mask: the ``[B, T]`` padding mask, optional: outputs at padding positions (and at targets below 0, an
        ignore index) are not compared. A padding query masked from every key attends to all of them alike,
        the future too, and the loss never reads it.
      probes: how many positions t to probe (default 3: the first, the middle and the last but one),
        or the positions.
      rtol: relative change allowed, ``max |out' - out| / max |out|`` over positions ``<= t``.
      seed: seed of the float perturbation.

    Returns:
      One ``seq.future_leakage`` finding, or nothing.

    Raises:
      ExperimentError: no input or output leaf has a time axis ``[B, T, ...]`` to probe.

    Not jit-safe (compiles ``apply`` once and calls it ``1 + probes`` times).
    """
    fn = "check_causal"
    require_callable(fn, "apply", apply, signature="(params, inputs) -> outputs")
    require_count_or_list(fn, "probes", probes)
    require_float(fn, "rtol", rtol, min=0.0)
    require_int(fn, "seed", seed)
    leaves, treedef = jax.tree_util.tree_flatten(inputs)
    host = [np.asarray(x) for x in leaves]
    if not host or np.ndim(host[0]) < 1:
        raise ExperimentError("check_causal: the inputs have no leading batch axis.")
    n = host[0].shape[0]
    T, idx = _time_leaves(host, n)
    if T is None or T < 2:
        raise ExperimentError(
            f"check_causal: no input has a time axis [B, T, ...] with T >= 2 (input shapes "
            f"{[x.shape for x in host]}); the causal check needs sequence inputs."
        )
    idx = _decoder_leaves(host, idx, labels) or idx
    real = real_positions(mask, labels, (n, T))
    return _leak_finding(_future_leaks(apply, params, host, treedef, T, idx, probes, rtol, seed, real=real), T)


def real_positions(mask: Any, labels: Any, shape: tuple[int, int]) -> np.ndarray | None:
    """The ``[B, T]`` positions the loss reads: where ``mask`` is nonzero and integer targets are not below 0 (an
    ignore index), each where it has that shape; None when neither says (no such mask, no negative target)."""
    real = None
    if mask is not None and np.shape(mask) == shape:
        real = np.asarray(mask) != 0
    lab = jax.tree_util.tree_leaves(labels) if labels is not None else []
    if len(lab) == 1 and np.shape(lab[0]) == shape and np.asarray(lab[0]).dtype.kind == "i" and np.min(lab[0]) < 0:
        real = (np.asarray(lab[0]) >= 0) & (True if real is None else real)
    return real


def check_teacher_forced(
    apply: Callable,
    params: PyTree,
    inputs: Any,
    labels: Any,
    *,
    probes: int | Sequence[int] = 3,
    rtol: float = 1e-5,
    seed: int = 0,
    compiled: bool = False,
    mask: Any = None,
) -> list[Finding]:
    """``seq.future_leakage`` in a model not declared causal whose targets are an input one position ahead.

    Teacher forcing (an LM's ``tokens[:, :-1]`` against ``tokens[:, 1:]``, a decoder's ``[BOS, y[:, :-1]]``
    against ``y``) puts the answer at t in the input at t + 1: a model that reads inputs after t copies it. So
    the input leaves that are the targets shifted right by one (:func:`teacher_forced_leaves`) are probed as
    :func:`check_causal` probes a declared-causal model's; nothing is probed when there are none. Arguments as
    :func:`check_causal`'s (``compiled``: ``apply`` is a jitted program, called as it is, not wrapped in another);
    an ``apply`` with no per-position output is ``doctor.skipped``. Not jit-safe.
    """
    leaves, treedef = jax.tree_util.tree_flatten(inputs)
    host = [np.asarray(x) for x in leaves]
    idx = teacher_forced_leaves(host, labels)
    if not idx:
        return []
    T = host[idx[0]].shape[1]
    try:
        real = real_positions(mask, labels, host[idx[0]].shape)
        real = ~_trailing_runs(host[idx[0]]) if real is None else real
        leaks = _future_leaks(apply, params, host, treedef, T, idx, probes, rtol, seed, compiled, real)
    except ExperimentError as e:
        return [Finding("doctor.skipped", f"teacher-forcing causal check not run: {e}", "")]
    return _leak_finding(leaks, T, teacher_forced=True)


def _trailing_runs(x: np.ndarray) -> np.ndarray:
    """``[B, T]``: the positions in each row's trailing run of one value, two or more long (its padding, when no
    mask says where that is). Host-side."""
    same_as_next = np.ones(x.shape, bool)  # the last position ends every run
    same_as_next[:, :-1] = x[:, :-1] == x[:, 1:]
    tail = np.flip(np.logical_and.accumulate(np.flip(same_as_next, 1), 1), 1)
    return tail & (tail.sum(axis=1, keepdims=True) >= 2)


TEACHER_FORCED_AGREEMENT = 0.9  # the share of a row's positions where inputs[:, 1:] == targets[:, :-1]


def teacher_forced_leaves(host: list[np.ndarray], labels: Any) -> list[int]:
    """The input leaves ``[B, T]`` (T >= 3) that are the ``[B, T]`` targets shifted right by one: on at least
    half the rows, ``x[:, 1:]`` agrees with ``y[:, :-1]`` on ``TEACHER_FORCED_AGREEMENT`` of the positions (an
    end-of-sequence id or the padding may differ), counting rows of at least two distinct values only (a row of
    padding agrees with anything constant)."""
    lab = jax.tree_util.tree_leaves(labels)
    if len(lab) != 1 or np.ndim(lab[0]) != 2 or np.shape(lab[0])[1] < 3:
        return []
    y = np.asarray(lab[0])
    out = []
    for i, x in enumerate(host):
        if x.shape != y.shape or x.dtype.kind not in "iuf" or _binary(x):
            continue
        varied = (x != x[:, :1]).any(axis=1)
        agree = (x[:, 1:] == y[:, :-1]).mean(axis=1) >= TEACHER_FORCED_AGREEMENT
        if 2 * int(np.sum(agree & varied)) >= len(x) and not np.array_equal(x, y):
            out.append(i)
    return out


def _future_leaks(
    apply: Callable,
    params: PyTree,
    host: list,
    treedef: Any,
    T: int,
    idx: list[int],
    probes: int | Sequence[int],
    rtol: float,
    seed: int,
    compiled: bool = False,
    real: np.ndarray | None = None,
) -> list[tuple[int, float, list[int]]]:
    """For each probe position t, the outputs at positions ``<= t`` after the input leaves ``idx`` change at
    positions ``> t``: (t, worst relative change, the positions that moved) where they moved beyond ``rtol``.
    ``compiled``: ``apply`` is a program already compiled at these shapes, called as it is; ``real``: the
    ``[B, T]`` positions compared (None: all; a padding query attends to every key, the future too). Raises
    ExperimentError when no output is per position. Not jit-safe."""
    n = host[idx[0]].shape[0]
    call = lambda p, xs: jax.tree_util.tree_leaves(apply(p, jax.tree_util.tree_unflatten(treedef, xs)))  # noqa: E731
    run = call if compiled else quick_jit(call, runs=1 + len(_probe_positions(T, probes)))
    base = [np.asarray(o) for o in run(params, host)]
    outs = [k for k, o in enumerate(base) if o.ndim >= 2 and o.shape[:2] == (n, T) and o.dtype.kind in "fc"]
    if not outs:
        raise ExperimentError(
            f"check_causal: apply's outputs have no per-position axis [B={n}, T={T}, ...] "
            f"(shapes {[o.shape for o in base]}); the causal check needs one output per position."
        )
    rng = np.random.default_rng(seed)
    leaks: list[tuple[int, float, list[int]]] = []
    for t in _probe_positions(T, probes):
        future = np.zeros((n, T), bool)
        future[:, t + 1 :] = True
        moved = list(host)
        for i in idx:
            moved[i] = _perturb(host[i], future, rng)
        new = [np.asarray(o) for o in run(params, moved)]
        worst, seen = 0.0, set()
        keep = np.ones((n, t + 1), bool) if real is None else real[:, : t + 1]
        for k in outs:
            wide = np.promote_types(base[k].dtype, np.float32)  # float32 suffices against rtol: no 64-bit copies
            a, b = base[k][:, : t + 1].astype(wide, copy=False), new[k][:, : t + 1].astype(wide, copy=False)
            diff = np.where(keep, np.abs(a - b).reshape(n, t + 1, -1).max(axis=2), 0.0).max(axis=0)
            ref = float(np.abs(a).reshape(n, t + 1, -1).max(axis=2)[keep].max(initial=0.0)) + 1e-30
            worst = max(worst, float(diff.max()) / ref)
            seen |= {int(p) for p in np.flatnonzero(diff / ref > rtol)}
        if worst > rtol:
            leaks.append((t, worst, sorted(seen)))
    return leaks


def _leak_finding(leaks: list[tuple[int, float, list[int]]], T: int, teacher_forced: bool = False) -> list[Finding]:
    """The ``seq.future_leakage`` finding of the probes that leaked (none: nothing); ``teacher_forced``: the model
    was not declared causal, but its targets are an input one position ahead."""
    if not leaks:
        return []
    shown = "; ".join(
        f"inputs after t={t} moved outputs at positions {pos[:6]}{'...' if len(pos) > 6 else ''} "
        f"(relative change {r:.2g})"
        for t, r, pos in leaks
    )
    return [
        Finding(
            "seq.future_leakage",
            (
                "the targets are an input one position ahead (teacher forcing: inputs[:, 1:] == targets[:, :-1]), "
                "so the answer at each position is in the input at the next one, and the model reads it: its "
                if teacher_forced
                else "the model is declared causal, but its "
            )
            + f"output at a position depends on inputs at later positions (forward probe over T={T}): {shown}",
            "mask attention causally: scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -jnp.inf) with "
            "queries on axis -2 and keys on axis -1 (a transposed mask or jnp.triu lets each position see the "
            "future); in Flax pass mask=nnx.make_causal_mask(tokens) (linen: nn.make_causal_mask); no bidirectional "
            "layer, future-looking convolution or pooling over the time axis"
            + (
                "; if the model is meant to see the whole sequence, pass Experiment(causal=False)"
                if teacher_forced
                else ""
            ),
            path=f"position {leaks[0][2][0] if leaks[0][2] else 0} <- positions > {leaks[0][0]}",
            extra={"probes": [(t, float(r), pos) for t, r, pos in leaks], "T": T},
        )
    ]
