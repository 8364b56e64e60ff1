"""Which shard went non-finite (``dist.nonfinite_shard``), and host transfers of sharded state.

On the failure path of :func:`jaxsane.guard` the addressable shards of the failing leaves are read on
the host to name the devices and processes that hold the NaN/Inf and the batch rows those shards held
(:func:`nonfinite_shards`); when an all-reduce spread the NaN everywhere, :func:`replay_shards` replays the
step once per batch shard. :func:`gather_to_host` copies a sharded pytree to host numpy. The multi-process
rule of ``replicas.py`` holds here: the same collectives in the same order on every process.

Not jit-safe: everything here runs on the host, on the failure path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .._core.finding import Finding
from .._core.tree import PyTree, is_inexact
from .replicas import device_id, index_key, is_multiprocess, short_ids

_SHARD_HINT = (
    "only some shards hold NaN/Inf: look at the named batch rows (jaxsane.check_data on them) and at "
    "what differs on those devices/processes (their data shard, a per-device overflow)."
)


# ----------------------------------------------------------------- non-finite shard attribution
def _shard_table(leaf: jax.Array, devices: list) -> tuple[np.ndarray, np.ndarray]:
    """Local part of one leaf's attribution: per global device ``[n_nonfinite, row_start, row_stop]``
    (-1 where not local) and a per-row non-finite mask over dim 0 (empty for scalars)."""
    pos = {device_id(d): i for i, d in enumerate(devices)}
    table = np.full((len(devices), 3), -1, np.int64)
    rows = np.zeros((leaf.shape[0] if leaf.ndim else 0,), np.int32)
    for shard in leaf.addressable_shards:
        data = np.asarray(shard.data)
        bad = ~np.isfinite(data)
        start, stop = index_key(shard.index, leaf.shape)[0] if leaf.ndim else (0, 0)
        table[pos[device_id(shard.device)]] = (int(bad.sum()), start, stop)
        if leaf.ndim and bad.any():
            rows[start:stop] |= bad.reshape(bad.shape[0], -1).any(axis=1).astype(np.int32)
    return table, rows


def nonfinite_shards(
    named_leaves: Sequence[tuple[str, Any]], *, step: int | None = None, what: str = ""
) -> Finding | None:
    """Which devices/processes hold the NaN/Inf of the given (failing) leaves. Not jit-safe.

    Meant for the failure path only: it copies the failing leaves' local shards to the host. Under
    ``jax.distributed`` it makes one ``process_allgather`` (every process must call it with the same
    leaves, which holds when the leaves were chosen from a global finite flag).

    Args:
      named_leaves: ``(path, array)`` of the leaves that went non-finite, most telling first
        (inputs before outputs). Leaves on a single device are ignored.
      step: the step index, for the finding.
      what: a short description of the failure for the message (e.g. "nonfinite.input").

    Returns:
      A ``dist.nonfinite_shard`` finding naming, for the first leaf whose NaN/Inf sit on only some of
      its devices, those devices, their processes, the rows of dim 0 they held and the rows that are
      non-finite; None when no leaf is sharded or every leaf is non-finite on every device.
    """
    sharded = [
        (p, x) for p, x in named_leaves if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1 and is_inexact(x)
    ]
    if not sharded:
        return None
    devices = sorted({d for _, x in sharded for d in x.sharding.device_set}, key=device_id)
    tables, masks = [], []
    for _, x in sharded:
        t, r = _shard_table(x, devices)
        tables.append(t)
        masks.append(r)
    if is_multiprocess():
        from jax.experimental import multihost_utils

        flat = np.concatenate([t.ravel() for t in tables] + masks).astype(np.int32)
        gathered = np.asarray(multihost_utils.process_allgather(flat)).reshape(jax.process_count(), -1)
        merged = gathered.max(axis=0)  # each device is filled by exactly one process; -1 elsewhere
        off = 0
        for k, t in enumerate(tables):
            tables[k] = merged[off : off + t.size].reshape(t.shape)
            off += t.size
        for k, m in enumerate(masks):
            masks[k] = merged[off : off + m.size]
            off += m.size
    all_bad = []
    for (path, x), table, mask in zip(sharded, tables, masks):
        held = [(d, table[i]) for i, d in enumerate(devices) if table[i][0] >= 0]
        bad = [(d, row) for d, row in held if row[0] > 0]
        if not bad:
            continue
        all_bad.append(path)
        if len(bad) == len(held):
            continue  # everywhere: not confined to some shards (e.g. spread by an all-reduce)
        dev_ids = [device_id(d) for d, _ in bad]
        procs = sorted({int(d.process_index) for d, _ in bad})  # type: ignore[attr-defined]  # (no jaxlib Device stub)
        held_rows = sorted({(int(r[1]), int(r[2])) for _, r in bad})
        bad_rows = np.flatnonzero(mask).tolist()
        n_bad = int(sum(r[0] for _, r in bad))
        rows_txt = ", ".join(f"{a}:{b}" for a, b in held_rows)
        message = (
            f"{path}: {n_bad} NaN/Inf confined to {len(bad)} of {len(held)} devices: device(s) "
            f"{short_ids(dev_ids)} of process(es) {', '.join(map(str, procs))}"
            + (f", holding rows {rows_txt} of dim 0; non-finite rows {short_ids(bad_rows, 16)}" if x.ndim else "")
        )
        if what:
            message += f" ({what})"
        return Finding(
            "dist.nonfinite_shard",
            message,
            _SHARD_HINT,
            path=path,
            step=step,
            extra={
                "devices": dev_ids,
                "processes": procs,
                "rows_held": [list(r) for r in held_rows],
                "rows": bad_rows,
                "n_devices": len(held),
            },
        )
    return None


def _row_groups(leaves: Sequence[Any]) -> list[tuple[int, int]] | None:
    """The common dim-0 split of the row-sharded leaves: sorted ``(start, stop)``; None if none/inconsistent."""
    groups = None
    for x in leaves:
        keys = sorted({index_key(idx, x.shape)[0] for idx in x.sharding.devices_indices_map(x.shape).values()})
        if groups is None:
            groups = keys
        elif keys != groups:
            return None
    return groups if groups is not None and len(groups) > 1 else None


def _is_row_sharded(x: Any) -> bool:
    if not isinstance(x, jax.Array) or x.ndim < 1 or len(x.sharding.device_set) < 2:
        return False
    starts = {index_key(idx, x.shape)[0] for idx in x.sharding.devices_indices_map(x.shape).values()}
    return len(starts) > 1


@functools.lru_cache(maxsize=64)
def _take_rows(sharding: Any):
    """A jitted ``(x, idx) -> x[idx]`` whose result keeps ``sharding`` (Explicit or Auto mesh axes)."""
    mesh = getattr(sharding, "mesh", None)
    if any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        return jax.jit(lambda x, idx: x.at[idx].get(out_sharding=sharding))
    return jax.jit(lambda x, idx: x[idx], out_shardings=sharding)


def replay_shards(
    run: Callable[[tuple, dict], bool],
    args: tuple,
    kwargs: dict,
    *,
    step: int | None = None,
    max_groups: int = 64,
    max_rows: int = 32,
) -> Finding | None:
    """Find the batch shard(s) whose rows alone make a step non-finite, by replaying it. Not jit-safe.

    For a step whose batch leaves (``args[1:]`` and ``kwargs``) are split along dim 0 over
    devices, each shard's rows are tiled to the full batch (same shape and sharding, so the step
    does not recompile) and the step is run once per shard: the shards whose rows alone give
    NaN/Inf are the origin, even when an all-reduce spread the NaN to every device. When the
    culprit shards hold at most ``max_rows`` rows in all, each row is replayed alone as well.
    Failure path only. Every replay is the same global program on every process.

    Args:
      run: ``(args, kwargs) -> bool`` runs the step and returns True when everything stayed finite.
      args, kwargs: the failing call's inputs (``args[0]``, the state, is kept as it is).
      step: the step index, for the finding.
      max_groups: do not replay when the batch is split into more shards than this.
      max_rows: replay single rows only when the culprit shards hold at most this many rows.

    Returns:
      A ``dist.nonfinite_shard`` finding (``extra["replayed"]`` True), or None when the batch is not
      row-sharded, the split is too fine, or the replays do not single out some shards.
    """
    flat, treedef = jax.tree_util.tree_flatten((args[1:], kwargs))
    rowed = [i for i, x in enumerate(flat) if _is_row_sharded(x)]
    groups = _row_groups([flat[i] for i in rowed]) if rowed else None
    if groups is None or len(groups) > max_groups:
        return None
    n = flat[rowed[0]].shape[0]

    def replay(idx: np.ndarray) -> bool:
        idx = np.resize(np.asarray(idx, np.int32), n)
        new = list(flat)
        for i in rowed:
            new[i] = jax.device_put(_take_rows(flat[i].sharding)(flat[i], idx), flat[i].sharding)  # no retrace
        rest, kw = jax.tree_util.tree_unflatten(treedef, new)
        return run((args[0], *rest), kw)

    culprits = [g for g in groups if not replay(np.arange(*g))]
    if not culprits or len(culprits) == len(groups):
        return None
    rows: list[int] = []
    if sum(b - a for a, b in culprits) <= max_rows:
        rows = [r for a, b in culprits for r in range(a, b) if not replay(np.asarray([r]))]
    x = flat[rowed[0]]
    holders = [
        d for d, idx in x.sharding.devices_indices_map(x.shape).items() if index_key(idx, x.shape)[0] in culprits
    ]
    dev_ids = sorted(device_id(d) for d in holders)
    procs = sorted({int(d.process_index) for d in holders})
    held = ", ".join(f"{a}:{b}" for a, b in culprits)
    message = (
        f"the step goes non-finite when every device is given the batch rows {held} held by device(s) "
        f"{short_ids(dev_ids)} of process(es) {', '.join(map(str, procs))}; the other {len(groups) - len(culprits)} "
        f"shard(s)' rows stay finite" + (f"; row(s) {short_ids(rows, 16)} alone reproduce it" if rows else "")
    )
    return Finding(
        "dist.nonfinite_shard",
        message,
        _SHARD_HINT,
        path=None,
        step=step,
        extra={
            "devices": dev_ids,
            "processes": procs,
            "rows_held": [list(g) for g in culprits],
            "rows": rows,
            "n_shards": len(groups),
            "replayed": True,
        },
    )


# ------------------------------------------------------------------------------ host transfers
def gather_to_host(tree: PyTree) -> PyTree:
    """Copy every array leaf to host numpy, gathering leaves spread over several processes. Not jit-safe.

    Leaves that are not fully addressable are fetched with one ``process_allgather`` (a collective:
    every process must call this with the same structure); others are copied locally.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    remote = [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated
    ]
    if remote:
        from jax.experimental import multihost_utils

        got = multihost_utils.process_allgather([leaves[i] for i in remote], tiled=True)
        for i, value in zip(remote, got):
            leaves[i] = np.asarray(value)
    out = [np.asarray(x) if isinstance(x, (jax.Array, np.ndarray, np.generic)) else x for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, out)
