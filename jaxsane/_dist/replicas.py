"""Distributed checks: replicas that silently diverge, and which shard went non-finite.

At scale the user's step is already a sharded jitted function running under JAX's own
multi-controller runtime (``jax.distributed``); nothing here adds a runtime. Two checks:

* **replica divergence** (``dist.replica_divergence``): every copy of a value that is meant to be
  replicated (its sharding holds the same index on several devices) must be bitwise identical.
  A per-leaf checksum (:func:`fingerprint`) is computed on each device and compared across
  devices and processes. It catches processes that initialise from different seeds and a
  data-parallel step that forgets its gradient ``pmean``/``psum`` (a ``shard_map`` with
  ``check_vma=False`` and ``out_specs=P()`` then silently returns different "replicated" copies).
* **non-finite shard attribution** (``dist.nonfinite_shard``, in ``shards.py``): on the
  failure path of
  :func:`jaxsane.guard`, the addressable shards of the failing leaves are inspected on the host to
  name the devices and processes holding the NaN/Inf and the batch rows those shards held. When
  an all-reduce spread the NaN to every device, :func:`replay_shards` replays the step once per
  batch shard (that shard's rows tiled to the full batch) to find the shard whose rows cause it.

Multi-process rule: every function here that exchanges data between processes
(:func:`check_replicas`, :func:`nonfinite_shards`, :func:`replay_shards`, :func:`gather_to_host`) calls the same
collectives in the same order on every process, given the same pytree structure and shardings on
every process, so that no process waits in a collective the others never enter.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .._core.finding import Finding
from .._core.tree import PyTree, is_inexact, leaves_with_paths
from .._core.validate import require_int, require_str

_PROCESS_HINT = (
    "the processes disagree while the devices of each process agree: every process must build the "
    "replicated state from the same seed and the same data (use one PRNG key for init, not "
    "jax.random.key(jax.process_index())), or broadcast it from process 0 with "
    "jax.experimental.multihost_utils.broadcast_one_to_all."
)
_DEVICE_HINT = (
    "devices disagree: a data-parallel step that computes gradients on its local batch shard must "
    "all-reduce them (jax.lax.pmean(grads, axis_name) inside shard_map) before the update; with "
    "check_vma=False and out_specs=P() JAX does not check that the 'replicated' outputs agree. "
    "Also look for per-device RNG (fold_in(key, axis_index)) feeding replicated values."
)


# ---------------------------------------------------------------------------------------------- basics
def is_multiprocess() -> bool:
    """True when running under ``jax.distributed`` with more than one process. Not jit-safe."""
    return jax.process_count() > 1


def device_id(d: Any) -> int:
    return int(d.id)


def _bits(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as a flat ``uint32`` vector (bool/int/float/complex/PRNG keys). Jit-safe."""
    dtype = x.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x).astype(jnp.uint32).ravel()
    if dtype == jnp.bool_:
        return x.astype(jnp.uint32).ravel()
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return jnp.concatenate([_bits(jnp.real(x)), _bits(jnp.imag(x))])
    size = np.dtype(dtype).itemsize
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).ravel()
    if size in (1, 2):
        return jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}[size]).astype(jnp.uint32).ravel()
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).ravel()
    raise TypeError(f"[jaxsane] cannot fingerprint dtype {dtype}")


def fingerprint(x: jax.typing.ArrayLike) -> jax.Array:
    """A bitwise checksum of ``x``: ``uint32[2]`` = (checksum, number of 32-bit words). Jit-safe.

    One fused pass: each 32-bit word ``b`` of ``x`` is mixed (``b ^ (b >> 16)``, a bijection that
    carries high bits down) and multiplied by an odd weight that depends on its position, then all
    are summed modulo 2**32. Equal arrays give equal fingerprints; arrays that differ in exactly one
    element always get different ones (an odd weight times a non-zero difference is non-zero mod
    2**32); other differences collide with probability about 2**-32. XLA:CPU runs integer
    reductions several times slower than float ones; accelerators do not.
    """
    x = jnp.asarray(x)
    bits = _bits(x)
    if bits.size == 0:
        return jnp.zeros((2,), jnp.uint32)
    w = jax.lax.iota(jnp.uint32, bits.size) * jnp.uint32(0x9E3779B1) | jnp.uint32(1)  # odd weights
    h = jnp.sum((bits ^ (bits >> 16)) * w, dtype=jnp.uint32)
    return jnp.stack([h, jnp.uint32(bits.size & 0xFFFFFFFF)])


_fingerprint_jit = jax.jit(fingerprint)


def index_key(index: tuple, shape: tuple) -> tuple:
    """A hashable, normalised form of a shard index (a tuple of slices)."""
    return tuple(sl.indices(n)[:2] if isinstance(sl, slice) else (sl, sl + 1) for sl, n in zip(index, shape))


def _fallback_mesh(devices) -> Mesh:
    return Mesh(np.array(sorted(devices, key=device_id)), ("_jaxsane_replica",))


# ------------------------------------------------------------------------- in-graph replica checks
def cached_replica_plan(cache: dict, tree: PyTree) -> tuple:
    """:func:`replica_plan` of ``tree``, kept in ``cache`` under its structure and its leaves' shardings and
    shapes (a guarded step's state keeps one plan across calls). Not jit-safe."""
    key = (
        jax.tree_util.tree_structure(tree),
        tuple((getattr(x, "sharding", None), getattr(x, "shape", None)) for x in jax.tree_util.tree_leaves(tree)),
    )
    if key not in cache:
        cache[key] = replica_plan(tree)
    return cache[key]


def replica_plan(tree: PyTree) -> tuple:
    """Which leaves of ``tree`` are meant to be replicated, from their concrete shardings. Not jit-safe.

    A leaf qualifies when its sharding puts the same index on two or more devices (fully replicated
    leaves, and leaves replicated along some mesh axes, e.g. FSDP parameters along the data axis).

    Returns:
      A hashable plan (usable as a static jit argument): a tuple of
      ``(mesh, leaf_indices, specs, representatives)`` groups, one per mesh. ``representatives[k][d]``
      is the flat mesh position of the device whose copy device ``d`` must equal.
    """
    groups: dict[Mesh, list] = {}
    for i, leaf in enumerate(jax.tree_util.tree_leaves(tree)):
        sharding = getattr(leaf, "sharding", None)
        if sharding is None or not isinstance(leaf, jax.Array) or len(sharding.device_set) < 2:
            continue
        if getattr(leaf.dtype, "itemsize", None) is None and not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            continue
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
            mesh, spec = sharding.mesh, sharding.spec
        elif sharding.is_fully_replicated:
            mesh, spec = _fallback_mesh(sharding.device_set), P()
        else:
            continue
        index_map = sharding.devices_indices_map(leaf.shape)
        flat = list(mesh.devices.flat)
        first: dict[tuple, int] = {}
        reps = []
        for pos, d in enumerate(flat):
            reps.append(first.setdefault(index_key(index_map[d], leaf.shape), pos))
        if len(first) == len(flat):  # every device holds a different piece: nothing to compare
            continue
        groups.setdefault(mesh, []).append((i, spec, tuple(reps)))
    return tuple(
        (mesh, tuple(g[0] for g in items), tuple(g[1] for g in items), tuple(g[2] for g in items))
        for mesh, items in groups.items()
    )


def _gathered_fingerprints(axes: tuple) -> Callable[..., jax.Array]:
    """The per-device body of :func:`replica_fingerprints` for a mesh with ``axes``. Jit-safe."""
    axis = axes if len(axes) > 1 else axes[0]

    def local(*xs):
        fp = jnp.stack([fingerprint(x) for x in xs])  # (n, 2) on this device
        return jax.lax.all_gather(fp, axis)  # (n_dev, n, 2) everywhere

    return local


def replica_fingerprints(tree: PyTree, plan: tuple) -> tuple[jax.Array, list[jax.Array]]:
    """Per-device fingerprints of the planned leaves, compared across devices. Jit-safe.

    Each device fingerprints its own copy (inside ``shard_map``); one small ``all_gather`` of
    ``n_leaves x 2`` words per mesh brings every fingerprint to every device.

    Args:
      tree: the pytree the plan was made for (same structure), e.g. the new state inside a step.
      plan: from :func:`replica_plan`.

    Returns:
      ``(ok, fps)``: ``ok`` is one bool per planned leaf (True = all copies agree), in plan order;
      ``fps`` is one ``uint32[n_devices, n_leaves, 2]`` array per plan group, replicated.
    """
    leaves = jax.tree_util.tree_leaves(tree)
    oks, fps = [], []
    for mesh, indices, specs, reps in plan:
        local = _gathered_fingerprints(tuple(mesh.axis_names))
        gathered = jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=P(), check_vma=False)(
            *[leaves[i] for i in indices]
        )
        gathered = gathered.reshape(-1, len(indices), 2)
        rep = np.asarray(reps).T  # (n_dev, n)
        ref = gathered[rep, np.arange(len(indices))[None, :]]
        oks.append(jnp.all(gathered == ref, axis=(0, 2)))
        fps.append(gathered)
    ok = jnp.concatenate(oks) if oks else jnp.ones((0,), bool)
    return ok, fps


def plan_findings(
    plan: tuple,
    fps: Sequence[Any],
    paths: Sequence[str],
    *,
    step: int | None = None,
    leaves: Sequence[Any] | None = None,
) -> list[Finding]:
    """Host side: turn the in-graph fingerprints of :func:`replica_fingerprints` into findings. Not jit-safe.

    Args:
      plan: the plan the fingerprints were computed with.
      fps: the fingerprint arrays (host or replicated device arrays).
      paths: the path string of every leaf of the planned tree, in ``jax.tree`` order.
      step: the step index, for the findings.
      leaves: the planned tree's leaves; when given, diverging copies on this process are compared with
        their reference copy to report the max abs difference (failure path only).
    """
    out = []
    for (mesh, indices, _, reps), fp in zip(plan, fps):
        fp = np.asarray(fp)
        devices = list(mesh.devices.flat)
        for k, leaf_index in enumerate(indices):
            records = [
                (device_id(d), int(d.process_index), reps[k][pos], tuple(fp[pos, k])) for pos, d in enumerate(devices)
            ]
            finding = _divergence_finding(paths[leaf_index], records, step=step)
            if finding is not None and leaves is not None:
                diffs = _local_diffs(leaves[leaf_index], finding.extra["devices"], finding.extra["reference_devices"])
                finding = _divergence_finding(paths[leaf_index], records, step=step, diffs=diffs) or finding
            if finding is not None:
                out.append(finding)
    return out


# -------------------------------------------------------------------------- host replica checks
def _divergence_finding(
    path: str, records: list[tuple], *, step: int | None = None, diffs: dict[int, float] | None = None
) -> Finding | None:
    """``records``: ``(device_id, process, group, fingerprint)`` per copy. None when all groups agree."""
    by_group: dict[Any, list] = collections.defaultdict(list)
    for rec in records:
        by_group[rec[2]].append(rec)
    bad, reference, n_copies = [], [], 0
    for group in by_group.values():
        n_copies += len(group)
        counts = collections.Counter(r[3] for r in group)
        if len(counts) < 2:
            continue
        top = max(counts.values())
        # the most common copy is the reference; on a tie, the one held by the lowest device id
        ref_fp = min((r for r in group if counts[r[3]] == top), key=lambda r: r[0])[3]
        reference += [r for r in group if r[3] == ref_fp]
        bad += [r for r in group if r[3] != ref_fp]
    if not bad:
        return None
    bad.sort()
    reference.sort()
    bad_dev = [r[0] for r in bad]
    bad_proc = sorted({r[1] for r in bad})
    ref_dev = [r[0] for r in reference]
    procs = sorted({r[1] for r in records})
    # processes disagree while each process's own copies agree -> a per-process cause
    per_process = len(procs) > 1 and all(
        len({r[3] for r in records if r[1] == p and r[2] == g}) <= 1 for p in procs for g in {r[2] for r in records}
    )
    where = f"device(s) {short_ids(bad_dev)} (process {', '.join(map(str, bad_proc))})"
    message = (
        f"{path} should be identical on {n_copies} copies but {len(bad)} differ: {where} disagree with "
        f"device(s) {short_ids(ref_dev)}"
    )
    if diffs:
        message += f" (max |difference| {max(diffs.values()):.3g})"
    if per_process:
        message += "; every process's own devices agree, the processes do not"
    return Finding(
        "dist.replica_divergence",
        message,
        _PROCESS_HINT if per_process else _DEVICE_HINT,
        path=path,
        step=step,
        extra={
            "devices": bad_dev,
            "processes": bad_proc,
            "reference_devices": ref_dev,
            "reference_processes": sorted({r[1] for r in reference}),
            "per_process": per_process,
            **({"max_abs_diff": max(diffs.values())} if diffs else {}),
        },
    )


def short_ids(ids: Sequence[int], n: int = 8) -> str:
    ids = list(ids)
    return ", ".join(map(str, ids[:n])) + (f" and {len(ids) - n} more" if len(ids) > n else "")


_plan_fingerprints = jax.jit(replica_fingerprints, static_argnums=1)


def _local_diffs(leaf: Any, bad_devices: Sequence[int], ref_devices: Sequence[int]) -> dict[int, float]:
    """Max |copy - reference| for each diverging copy whose reference copy (same index) is on this process."""
    if not isinstance(leaf, jax.Array) or not is_inexact(leaf):
        return {}
    shards = {device_id(s.device): s for s in leaf.addressable_shards}
    refs = {index_key(shards[d].index, leaf.shape): shards[d] for d in ref_devices if d in shards}
    out = {}
    for d in bad_devices:
        ref = refs.get(index_key(shards[d].index, leaf.shape)) if d in shards else None
        if ref is not None:
            a, b = np.asarray(ref.data, np.float64), np.asarray(shards[d].data, np.float64)
            with np.errstate(invalid="ignore"):
                diff = np.abs(a - b)
            diff = diff[~np.isnan(diff)]  # copies NaN in the same places (other NaN bits): np.nanmax warns on all-NaN
            out[d] = float(diff.max()) if diff.size else (float("nan") if a.size else 0.0)
    return out


def check_replicas(tree: PyTree, *, root: str = "", step: int | None = None) -> list[Finding]:
    """Check that every copy of every replicated value in ``tree`` is bitwise identical. Not jit-safe.

    Leaves on several devices: one compiled program in which each device fingerprints its own copy
    (:func:`fingerprint`) and one small ``all_gather`` brings the fingerprints together, across
    devices and processes; copies holding the same index of a leaf are compared (fully replicated
    leaves, and leaves replicated along some mesh axes such as FSDP parameters along the data axis).
    Under ``jax.distributed``, host values (numpy arrays, Python scalars) and single-device arrays are
    also compared across processes, with ``multihost_utils.process_allgather``. Every process must call
    ``check_replicas`` with the same pytree structure and shardings (it runs collectives).

    Args:
      tree: a pytree, e.g. the train state or params after a step.
      root: prefix for the leaf paths in findings (e.g. ``"state"``).
      step: the step index, recorded in the findings.

    Returns:
      One ``dist.replica_divergence`` finding per leaf whose copies differ, naming the leaf, the
      disagreeing devices and processes, and (for copies on this process) the max abs difference.
      Empty when all copies agree. Never raises on a finding.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> check_replicas({"w": jnp.ones(3)})
      []
    """
    require_str("check_replicas", "root", root)
    require_int("check_replicas", "step", step, min=0, optional=True)
    named = [(p, x) for p, x in leaves_with_paths(tree, root) if x is not None]
    spread = [
        i
        for i, (_, x) in enumerate(named)
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and len(x.sharding.device_set) > 1
    ]
    findings: dict[int, Finding] = {}
    values = [named[i][1] for i in spread]
    plan = replica_plan(values)
    if plan:
        ok, fps = _plan_fingerprints(values, plan)
        if not np.asarray(ok).all():
            paths = [named[i][0] for i in spread]
            for f in plan_findings(plan, fps, paths, step=step, leaves=values):
                assert f.path is not None  # (plan_findings names each finding's leaf)
                findings[spread[paths.index(f.path)]] = f
    if is_multiprocess():
        single = [i for i in range(len(named)) if i not in set(spread)]
        dev, proc = device_id(jax.local_devices()[0]), jax.process_index()
        local = []
        for i in single:
            data = jax.device_put(np.asarray(named[i][1]), jax.local_devices()[0])
            local.append([(dev, proc, 0, tuple(int(v) for v in np.asarray(_fingerprint_jit(data))))])
        for i, recs in zip(single, _allgather_records(local)):
            found = _divergence_finding(named[i][0], recs, step=step)
            if found is not None:
                findings[i] = found
    return [findings[i] for i in sorted(findings)]


def _allgather_records(local: list[list[tuple]]) -> list[list[tuple]]:
    """Exchange every process's fingerprint records (two collectives, same on every process)."""
    from jax.experimental import multihost_utils

    rows = [
        (k, dev, proc, hash(key) & 0x7FFFFFFF, fp[0], fp[1])
        for k, recs in enumerate(local)
        for dev, proc, key, fp in recs
    ]
    n = np.asarray(multihost_utils.process_allgather(np.asarray([len(rows)], np.int32))).max()
    table = np.full((int(n), 6), -1, np.int64)
    if rows:
        table[: len(rows)] = np.asarray(rows, np.int64)
    # uint32 fingerprints travel as two int32 halves (x64 is usually off)
    wire = np.concatenate(
        [table[:, :4], table[:, 4:5] >> 16, table[:, 4:5] & 0xFFFF, table[:, 5:6] >> 16, table[:, 5:6] & 0xFFFF], axis=1
    ).astype(np.int32)
    allrows = np.asarray(multihost_utils.process_allgather(wire)).reshape(-1, wire.shape[1])
    out: list[list[tuple]] = [[] for _ in local]
    for k, dev, proc, key, a, b, c, d in allrows.tolist():
        if k < 0:
            continue
        out[k].append((dev, proc, key, ((a << 16) | b, (c << 16) | d)))
    return out
