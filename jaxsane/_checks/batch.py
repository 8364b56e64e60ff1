"""Batch independence (``batch.cross_talk``): in eval mode, example i's output must depend on
example i's input only — Karpathy's "use backprop to chart dependencies".

For a probe example i, one VJP of ``apply`` with a random cotangent on example i's output (zeros
elsewhere) gives the gradient of that output w.r.t. the WHOLE input batch; it must be exactly zero
outside example i. A few probes cost a few VJPs, not a Jacobian. Integer inputs (tokens), which
have no gradient, are probed forward instead: every other example is replaced and example i's
output must not move. BatchNorm in train mode is not cross talk as long as ``apply`` runs in eval
mode (running averages), which is what ``Experiment.apply`` is for. Not jit-safe: it runs ``apply`` and its
VJPs from the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.errors import ArgumentError, ExperimentError
from .._core.finding import Finding
from .._core.tree import PyTree, like_sharding, put_like
from .._core.validate import require_callable, require_count_or_list, require_float, require_int
from .._experiment.batches import batch_size
from .._jaxpr.compile_level import quick_jit


def _is_float(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    try:
        return dtype is not None and bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:
        return False


def _probes(n: int, probes: int | Sequence[int]) -> list[int]:
    if not isinstance(probes, int):
        chosen = [int(i) for i in probes]
        bad = [i for i in chosen if not 0 <= i < n]
        if bad:
            raise ArgumentError(
                f"check_batch_independence: probe examples {bad} outside the batch of {n}. "
                f"Fix: pass probes among 0..{n - 1}."
            )
        return chosen
    picks = [0, n - 1, n // 2, 1, n - 2]
    return list(dict.fromkeys(i for i in picks if 0 <= i < n))[: max(1, probes)]


def check_batch_independence(
    apply: Callable,
    params: PyTree,
    inputs: Any,
    *,
    probes: int | Sequence[int] = 2,
    rtol: float = 1e-6,
    seed: int = 0,
    max_pairs: int = 8,
) -> list[Finding]:
    """``batch.cross_talk`` when example i's output depends on another example's input.

    Args:
      apply: ``(params, inputs) -> outputs`` in EVAL mode (no dropout, BatchNorm on running averages).
      params: parameters.
      inputs: a batch (array or pytree of arrays with a leading batch axis, at least 2 examples).
      probes: how many examples to probe (default 2: the first and the last), or their indices.
      rtol: relative leak allowed, ``|d out_i / d x_j| / |d out_i / d x_i|`` (default 1e-6; a
        batch-independent model gives exact zeros, since no path carries the cotangent across).
      seed: seed of the random cotangents.
      max_pairs: offending (output, input) example pairs listed in the message.

    Returns:
      One ``batch.cross_talk`` finding naming the offending example pairs, or nothing.

    Not jit-safe (one compiled VJP per probe set).
    """
    fn = "check_batch_independence"
    require_callable(fn, "apply", apply, signature="(params, inputs) -> outputs")
    require_count_or_list(fn, "probes", probes)
    require_float(fn, "rtol", rtol, min=0.0)
    require_int(fn, "seed", seed)
    require_int(fn, "max_pairs", max_pairs, min=1)
    try:
        n = batch_size(inputs)
    except Exception as e:
        raise ExperimentError(f"check_batch_independence: the inputs have no batch axis ({e}).") from e
    if n < 2:
        return []
    chosen = _probes(n, probes)
    leaves, treedef = jax.tree_util.tree_flatten(inputs)
    batched = [getattr(x, "ndim", 0) >= 1 and x.shape[0] == n for x in leaves]
    float_idx = [i for i, x in enumerate(leaves) if batched[i] and _is_float(x)]
    out_shape = jax.eval_shape(apply, params, inputs)
    out_leaves = jax.tree_util.tree_leaves(out_shape)
    if not any(getattr(o, "ndim", 0) >= 1 and o.shape[0] == n for o in out_leaves):
        raise ExperimentError(
            f"check_batch_independence: apply's outputs have no leading batch axis of size {n} "
            f"(shapes {[getattr(o, 'shape', None) for o in out_leaves]})."
        )
    if float_idx:
        leaks = _vjp_leaks(apply, params, leaves, treedef, float_idx, out_leaves, n, chosen, seed)
        how = "VJP of its output w.r.t. the whole input batch"
    else:
        leaks = _forward_leaks(apply, params, leaves, treedef, batched, n, chosen)
        how = "forward probe (inputs are not float: other examples replaced)"
    pairs = [(i, j, r) for i, row in leaks.items() for j, r in enumerate(row) if j != i and r > rtol]
    if not pairs:
        return []
    pairs.sort(key=lambda p: -p[2])
    shown = ", ".join(f"output {i} <- input {j} ({r:.2g})" for i, j, r in pairs[:max_pairs])
    affected = sorted({i for i, _, _ in pairs})
    return [
        Finding(
            "batch.cross_talk",
            f"in eval mode, the output of example(s) {affected} depends on other examples' inputs "
            f"({len(pairs)} pairs; {how}; relative leak): {shown}",
            "something mixes examples along the batch axis: a softmax/mean/normalisation over axis 0 instead of "
            "the feature axis, a reshape or transpose that moves the batch axis, or BatchNorm still using batch "
            "statistics in apply (use_running_average=True / model.eval()); find it by bisecting apply",
            path=f"example {pairs[0][0]} <- example {pairs[0][1]}",
            extra={"pairs": [(i, j, float(r)) for i, j, r in pairs], "probes": chosen},
        )
    ]


def _vjp_leaks(apply, params, leaves, treedef, float_idx, out_leaves, n, chosen, seed) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    keep = [getattr(o, "ndim", 0) >= 1 and o.shape[0] == n and _is_float(o) for o in out_leaves]
    cots = [rng.standard_normal(o.shape).astype(o.dtype) for o, k in zip(out_leaves, keep) if k]
    # the params, the other array inputs and the cotangents are passed, not closed over: a closure makes them
    # constants of the program, and a 12M-parameter MLP's then spent 3 s compressing them into the compile cache
    passed = [i for i, x in enumerate(leaves) if i not in float_idx and isinstance(x, (np.ndarray, jax.Array))]

    def f(params, float_inputs, others):
        full = list(leaves)
        for i, x in zip((*float_idx, *passed), (*float_inputs, *others)):
            full[i] = x
        outs = jax.tree_util.tree_leaves(apply(params, jax.tree_util.tree_unflatten(treedef, full)))
        return [o for o, k in zip(outs, keep) if k]

    @jax.jit
    def per_example_grad_norms(params, float_inputs, others, cots, masks):
        outs, vjp = jax.vjp(lambda xs: f(params, xs, others), float_inputs)

        def one(mask):
            ct = [
                like_sharding(c * mask.reshape((n,) + (1,) * (c.ndim - 1)).astype(c.dtype), o)
                for c, o in zip(cots, outs)
            ]
            grads = vjp(ct)[0]
            sq = sum(jnp.sum(jnp.reshape(g.astype(jnp.float32) ** 2, (n, -1)), axis=1) for g in grads)
            return jnp.sqrt(sq)

        return jax.lax.map(one, masks)

    masks = np.zeros((len(chosen), n), np.float32)
    for row, i in enumerate(chosen):
        masks[row, i] = 1.0
    norms = np.asarray(
        per_example_grad_norms(
            params,
            [leaves[i] for i in float_idx],
            [leaves[i] for i in passed],
            [put_like(c, (params, leaves)) for c in cots],
            put_like(masks, (params, leaves)),
        )
    )
    leaks = {}
    for row, i in enumerate(chosen):
        own = norms[row, i]
        leaks[i] = norms[row] / own if own > 0 else np.where(norms[row] > 0, np.inf, 0.0)
    return leaks


def _forward_leaks(apply, params, leaves, treedef, batched, n, chosen) -> dict[int, np.ndarray]:
    program = quick_jit(lambda p, xs: apply(p, jax.tree_util.tree_unflatten(treedef, xs)), runs=1 + len(chosen))
    run = lambda xs: program(params, xs)  # noqa: E731  # the params passed, never constants of the program
    base = [np.asarray(o) for o in jax.tree_util.tree_leaves(run(leaves))]
    leaks = {}
    for i in chosen:
        others = np.roll(np.arange(n), 1)
        others[i] = i  # example i kept, every other example replaced by its neighbour
        moved = [jax.device_put(np.asarray(x)[others]) if b else x for x, b in zip(leaves, batched)]
        outs = [np.asarray(o) for o in jax.tree_util.tree_leaves(run(moved))]
        change = max(
            (
                float(np.max(np.abs(a[i].astype(np.float64) - b[i].astype(np.float64))))
                / (float(np.max(np.abs(a[i].astype(np.float64)))) + 1e-30)
                for a, b in zip(base, outs)
                if getattr(a, "ndim", 0) >= 1 and a.shape[0] == n
            ),
            default=0.0,
        )
        row = np.zeros(n)
        if change > 0:  # the forward probe cannot tell which example leaks: blame all replaced ones
            row[:] = change
            row[i] = 0.0
        leaks[i] = row
    return leaks


def check_example_slices(
    apply: Callable,
    params: PyTree,
    batch: Any,
    take: Callable[[Any, int], Any],
    inputs: Callable[[Any], Any],
    count: int,
    *,
    cuts: Sequence[int] | None = None,
    rtol: float = 1e-4,
    max_examples: int = 8,
    real_rows: Callable[[Any], Any] | None = None,
) -> list[Finding]:
    """``batch.cross_talk`` for batches whose examples are not rows (graph batches, packed sequences).

    Where examples are cut by a function (``take(batch, k)``: the batch's first ``k`` examples, as
    ``Experiment.examples`` says), the outputs of the first ``k`` examples must not change when the
    batch holds more of them: ``apply(params, inputs(batch))[:k]`` against
    ``apply(params, inputs(take(batch, k)))``, for each cut ``k`` (default ``count // 2`` and
    ``count - 1``). Outputs with a row per node or token rather than per example (node classification) are
    compared row by row: the cut's rows against the whole batch's first rows, only those ``real_rows(cut)``
    marks real when given (the Experiment's mask: a cut padded to a fixed size compares no padding). A
    difference above ``rtol`` (default 1e-4 of the largest output: the two runs have different shapes, so
    float sums may round differently) means an example reads examples after it (wrong segment ids, a pooling
    over the whole batch). A leak from earlier examples into later ones only is not seen. Not jit-safe.

    Returns:
      One ``batch.cross_talk`` finding naming the examples (or rows) whose outputs moved, or nothing.

    Raises:
      ExperimentError: when the outputs have no leading axis shared by all of them (nothing can be compared).
    """
    require_callable("check_example_slices", "apply", apply, signature="(params, inputs) -> outputs")
    cuts = sorted({k for k in (cuts if cuts is not None else (count // 2, count - 1)) if 0 < k < count})
    run = quick_jit(apply, runs=1 + len(cuts))
    full = [np.asarray(o, np.float64) for o in jax.tree_util.tree_leaves(run(params, inputs(batch))) if _is_float(o)]
    if not full or any(o.ndim < 1 or o.shape[0] != full[0].shape[0] for o in full):
        raise ExperimentError(
            f"check_example_slices: apply's float outputs {[o.shape for o in full]} have no leading "
            f"axis of the batch's {count} examples."
        )
    # a row per node or token (as many as some input leaf has): the cut's rows are the whole batch's first rows
    per_row = full[0].shape[0] != count and full[0].shape[0] in _leading(inputs(batch))
    unit = "row" if per_row else "example"
    scale = max(float(np.max(np.abs(o))) for o in full) + 1e-30
    moved: dict[int, float] = {}
    severed: dict[int, int] = {}  # cut -> edges it cuts between kept and removed nodes (one graph: not judged)
    for k in cuts:
        cut = take(batch, k)
        part = [np.asarray(o, np.float64) for o in jax.tree_util.tree_leaves(run(params, inputs(cut))) if _is_float(o)]
        rows = part[0].shape[0] if part and part[0].ndim else -1
        if per_row and rows not in _leading(inputs(cut)):
            rows = -1  # not one output row per input row of the cut: nothing to compare
        if (
            len(part) != len(full)
            or any(p.shape[1:] != f.shape[1:] or p.shape[0] != (rows if per_row else k) for p, f in zip(part, full))
            or not 0 < rows <= full[0].shape[0]
        ):
            raise ExperimentError(
                f"check_example_slices: apply's outputs on the first {k} examples have shapes "
                f"{[p.shape for p in part]}, not the first {k} {unit}s' rows of {[f.shape for f in full]}."
            )
        across = _edges_across(inputs(batch), inputs(cut))
        if across:
            severed[k] = across
            continue  # its kept nodes read removed neighbours by design: no independence to judge at this cut
        real = _real_rows(real_rows, cut, rows) if per_row else np.ones(rows, bool)
        for p, f in zip(part, full):
            diff = np.abs(p - f[:rows]).reshape(rows, -1).max(axis=1) / scale
            for i in np.flatnonzero((diff > rtol) & real):
                moved[int(i)] = max(moved.get(int(i), 0.0), float(diff[i]))
    if not moved and severed and len(severed) == len(cuts):
        return [_one_graph(severed)]
    if not moved:
        return []
    shown = ", ".join(f"{unit} {i} ({r:.2g})" for i, r in sorted(moved.items(), key=lambda t: -t[1])[:max_examples])
    return [
        Finding(
            "batch.cross_talk",
            f"in eval mode, the outputs of {len(moved)} {unit}(s) change when the batch holds more examples after "
            f"them (outputs on the first k examples cut by Experiment.examples, k in {cuts}, against the same examples "
            f"in the whole batch; change relative to the largest output): {shown}",
            "an example reads other examples of the batch: in a graph batch, node-to-graph or edge ids that are not "
            "each graph's own (offsets assumed from a fixed graph size, segment ids built from the wrong n_node), a "
            "pooling or normalisation over all nodes; in packed sequences, attention across the document boundary",
            path=f"{unit} {min(moved)}",
            extra={"examples" if unit == "example" else "rows": moved, "cuts": cuts},
        )
    ]


def _leading(tree: Any) -> set[int]:
    return {int(np.shape(x)[0]) for x in jax.tree_util.tree_leaves(tree) if np.ndim(x) >= 1}


def _real_rows(real_rows: Callable[[Any], Any] | None, cut: Any, rows: int) -> np.ndarray:
    """Which of a cut's ``rows`` output rows are real: ``real_rows(cut)`` (a mask of one value per row) where it
    gives one, else all of them. Not jit-safe."""
    mask = None if real_rows is None else real_rows(cut)
    if mask is None or np.ndim(mask) != 1 or np.shape(mask)[0] != rows:
        return np.ones(rows, bool)
    return np.asarray(mask) != 0


def loss_pairs_labels(loss: Callable, params: PyTree, batch: PyTree, labels: Any) -> bool | None:
    """Whether ``loss`` pairs each example's prediction with its own label, or compares every prediction
    with every label (a ``(B, 1)`` against ``(B,)`` broadcast to ``(B, B)``).

    The labels leaf (found in ``batch`` by identity) is rolled by one example, the inputs left as they are.
    A loss of matched pairs moves; a loss over all (prediction, label) pairs is a symmetric function of the
    labels and does not (up to float noise). The float parameters are jittered first (a zero-initialised
    output layer predicts one constant, and any loss of a constant prediction is symmetric in the labels).
    True when it moves by more than 1e-4 relative, False when it
    stays within 1e-6, None when that cannot be judged (no such leaf, labels all equal, a non-finite loss,
    or a change in between).

    Not jit-safe (compiles ``loss`` once, calls it twice).
    """
    found = labels_leaf(batch, labels)
    if found is None or np.ndim(found[0][found[2]]) < 1 or np.shape(found[0][found[2]])[0] < 2:
        return None
    host, treedef, at = found
    rolled = np.roll(host[at], 1, axis=0)
    if np.array_equal(rolled, host[at]):
        return None
    run = quick_jit(lambda p, xs: loss(p, jax.tree_util.tree_unflatten(treedef, xs)), runs=2)
    params = _jittered(params)
    base = float(run(params, host))
    moved = list(host)
    moved[at] = rolled
    value = float(run(params, moved))
    if not (np.isfinite(base) and np.isfinite(value)):
        return None
    change = abs(value - base) / max(abs(base), 1e-12)
    return True if change > 1e-4 else False if change <= 1e-6 else None


def _edges_across(whole: Any, cut: Any) -> int:
    """The edges of a graph batch that a cut severs: integer arrays of node ids (``[E]`` each, or ``[2, E]``) of the
    whole batch's inputs, against a float leaf of its node rows, that join one of the nodes the cut keeps (that
    leaf's rows in ``cut``) to one it removes. 0 when none (whole graphs kept, no edge arrays, or the cut's inputs
    are not the batch's in structure). Host-side."""
    leaves, kept_leaves = jax.tree_util.tree_leaves(whole), jax.tree_util.tree_leaves(cut)
    if len(leaves) != len(kept_leaves):
        return 0
    arrays = [np.asarray(x) for x in leaves]
    across = 0
    for node, kept in zip(arrays, kept_leaves):
        if node.dtype.kind != "f" or node.ndim < 1 or np.ndim(kept) < 1:
            continue
        nodes, keep = node.shape[0], np.shape(kept)[0]
        groups: dict[int, list[np.ndarray]] = {}
        for a in arrays:
            if a.dtype.kind not in "iu" or a.ndim not in (1, 2) or not a.size or a.min() < 0 or a.max() >= nodes:
                continue
            if a.shape[-1] < nodes // 2 or np.unique(a).size < min(a.shape[-1], nodes) // 4:
                continue  # per-graph counts (n_node, n_edge), not the node ids of edges
            if a.ndim == 2 and a.shape[0] == 2 and a.shape[1] != nodes:
                groups.setdefault(a.shape[1], []).extend([a[0], a[1]])
            elif a.ndim == 1 and a.shape[0] != nodes:
                groups.setdefault(a.shape[0], []).append(a)
        for ends in groups.values():
            if len(ends) >= 2 and keep < nodes:
                e = np.stack(ends, axis=1)
                across = max(across, int(np.sum((e.min(axis=1) < keep) & (e.max(axis=1) >= keep))))
    return across


def _one_graph(severed: dict[int, int]) -> Finding:
    cuts = ", ".join(f"{n} at the cut of {k}" for k, n in sorted(severed.items()))
    return Finding(
        "doctor.skipped",
        f"batch independence not judged: the first examples Experiment.examples cuts keep nodes joined by edges to "
        f"the nodes it removes ({cuts}): one graph, whose nodes read their neighbours by design, not independent "
        "examples",
        "nothing to do for a single graph (node classification on one graph); give examples= that cut whole graphs "
        "to check a batch of several",
    )


def labels_leaf(batch: PyTree, labels: Any) -> tuple[list, Any, int] | None:
    """``(the batch's leaves on the host, its treedef, the index of the labels leaf)``: the one leaf of ``batch``
    that is ``labels`` (by identity), else None. Host-side."""
    lab = jax.tree_util.tree_leaves(labels)
    if len(lab) != 1:
        return None
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    at = [i for i, x in enumerate(leaves) if x is lab[0]]
    if len(at) != 1:
        return None
    return [np.asarray(x) if np.ndim(x) else x for x in leaves], treedef, at[0]


def _jittered(params: PyTree) -> PyTree:
    """``params`` with small random noise on every float leaf (scaled to the leaf, 0.01 for zeros)."""
    rng = np.random.default_rng(0)

    def jitter(x: Any) -> Any:
        if not _is_float(x) or not hasattr(x, "shape"):
            return x
        scale = 0.1 * float(jnp.std(x)) + 1e-2
        return x + jnp.asarray(rng.standard_normal(x.shape) * scale, x.dtype)

    return jax.tree_util.tree_map(jitter, params)
