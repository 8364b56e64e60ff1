"""Running the overfit sweep: its configurations in groups, side by side, within a time limit.

The group program (``sweep_program.py``, compiled by ``sweep_compile.py``) takes and returns its loop's carry,
which makes it resumable: the configurations can be split into equal *groups* that run the same compiled
executable side by side. On the CPU backend one group per core runs in its own host thread (XLA:CPU runs small
batched programs on one core; the cores are otherwise idle); on GPU and TPU one group fills the device. A group
that exits early is resumed, early exit off, to the chunk where the last group stopped, so every configuration
runs exactly the steps a single vmapped program would have run.

The program is compiled once, in a background thread, while the host builds the per-seed initial states (or
earlier: :func:`~jaxsane._overfit.sweep_compile.compile_sweep` can be started ahead, as doctor does while its
other stages run). Everything here runs on the host; not jit-safe.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._core.tree import PyTree, host_leaf
from .sweep_compile import canonical_dtype, compile_sweep
from .sweep_program import Carry, GroupLayout, SweepSpec, TraceCount
from .time_guard import Reach, cut_note, within


def group_layout(n_real: int, baseline: int | None, groups: int, parallel: int = 0) -> GroupLayout:
    """Spread ``n_real`` real configurations round-robin over ``groups`` (at most ``n_real``) and put
    the baseline (config index ``baseline``) in the smallest group. Every group holds a real
    configuration, so every group's early exit means something; except when memory cuts the sweep into more
    groups than real configurations (``parallel`` set, ``groups`` above ``n_real``): the baseline then has a
    group of its own, which runs as long as the real ones did. ``parallel``: how many groups run at once
    (0: all of them)."""
    alone = baseline is not None and bool(parallel) and int(groups) > n_real
    groups = max(1, min(int(groups), n_real))
    members = [list(range(g, n_real, groups)) for g in range(groups)]
    if alone:
        assert baseline is not None
        members.append([baseline])
    elif baseline is not None:
        min(reversed(members), key=len).append(baseline)
    groups = len(members)
    size = max(map(len, members))
    slots = np.asarray([m + [m[0]] * (size - len(m)) for m in members], dtype=int)
    padding = np.asarray([[False] * len(m) + [True] * (size - len(m)) for m in members], dtype=bool)
    return GroupLayout(slots, padding, min(int(parallel), groups) if parallel else 0)


def state_bytes(example_state: PyTree) -> int:
    """Bytes of one training state (its array leaves), what each configuration of the sweep holds."""
    return int(
        sum(
            np.size(x) * np.dtype(x.dtype).itemsize
            for x in jax.tree_util.tree_leaves(example_state)
            if hasattr(x, "dtype") and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)
        )
    )


def memory_groups(groups: int, n_configs: int, one_state: int, memory_bytes: float | None) -> tuple[int, int]:
    """``(groups, parallel)``: the sweep's configurations in chunks whose stacked states fit ``memory_bytes``
    (None: no limit). A sweep whose ``n_configs`` states fit runs as ``groups`` groups side by side; otherwise
    it is cut into more, smaller groups, of which only as many run at once as fit (at least one, of one
    configuration). Host-side arithmetic only."""
    if memory_bytes is None or one_state <= 0 or n_configs * one_state <= memory_bytes:
        return groups, 0
    per_group = max(1, int(memory_bytes // one_state))  # configurations whose states fit at once
    groups = max(groups, -(-n_configs // per_group))
    size = -(-n_configs // groups)
    return groups, max(1, int(memory_bytes // (size * one_state)))


def default_groups(n_real: int) -> int:
    """One group per available CPU core on the CPU backend (at most one per real configuration);
    one group on accelerators, where a single vmapped program already fills the device."""
    if jax.default_backend() != "cpu":
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, n_real))


class SweepOutput(NamedTuple):
    """Per-configuration results on the host, in configuration order."""

    losses: np.ndarray  # [configs, steps_run]
    accuracy: np.ndarray  # [configs]
    reached_at: np.ndarray  # [configs]
    steps_run: int
    compile_seconds: float
    seconds: float
    cut: bool = False  # the time limit stopped a group before its steps ran (and before its early exit)
    out_of_reach: bool = False  # it stopped before its time was up: at its pace no target was within reach of it


def _stack_host(xs: Sequence[Any]) -> np.ndarray:
    out = np.stack([np.asarray(x) for x in xs])
    return out.astype(canonical_dtype(out.dtype), copy=False)


def run_sweep(
    spec: SweepSpec,
    layout: GroupLayout,
    *,
    build_states: Callable[[np.ndarray], PyTree],
    example_state: PyTree,
    batch_for: Callable[[int], PyTree],
    lrs: np.ndarray,
    scales: np.ndarray,
    real: np.ndarray,
    early_exit: bool,
    traces: TraceCount,
    say: Callable[[str], None] = lambda message: None,
    precompiled: concurrent.futures.Future | None = None,
    target_accuracy: Callable[[], float] | None = None,
    time_limit: float | None = None,
) -> SweepOutput:
    """Compile the group program once (in a background thread, while ``build_states`` runs) and run
    every group, side by side in host threads when there are several. Not jit-safe.

    Args:
      build_states: ``config_indices [size] -> stacked states [size, ...]`` (host numpy leaves with
        canonical dtypes, matching ``example_state``'s structure).
      example_state: one unstacked state, for the abstract shapes the program is compiled for.
      batch_for: ``config index -> batch`` (the overfit batch or the constant-input one).
      lrs, scales, real: per-configuration learning rate (NaN: the state's own), init scale and whether
        the configuration is a real one (not the baseline).
      say: called with a line of progress at each phase (compiling, running, resuming).
      precompiled: a future of :func:`compile_sweep` on the same arguments, started earlier (doctor starts
        it while other stages run); None compiles here, in a thread, while the states are built.
      target_accuracy: the accuracy target the program uses, asked for once it has compiled (the plan may
        still be finding whether apply's accuracy can judge the fit); None: ``spec.target_accuracy``.
      time_limit: seconds the groups may run after their first chunk (None: no limit): each runs in slices
        (``time_guard.within``), every curve is cut where the shortest stopped, and the output says ``cut``.
    """
    start = time.perf_counter()
    size, total = layout.size, spec.n_chunks * spec.chunk
    batches = [
        jax.tree_util.tree_map(lambda *xs: _stack_host(xs), *[batch_for(c) for c in row]) for row in layout.slots
    ]
    group_real = real[layout.slots] & ~layout.padding

    def initial(g: int) -> Carry:
        return _initial_carry(build_states(layout.slots[g]), size, total)

    def call(g: int, carry: Carry | None, limit: int, prepare: bool, early: bool) -> Carry:
        row = layout.slots[g]
        carry = initial(g) if carry is None else carry  # built here when the groups do not all fit at once
        args = (
            lrs[row] if prepare else np.full(size, np.nan, np.float32),  # NaN and 1: the states as they are
            scales[row] if prepare else np.ones(size, np.float32),
            group_real[g],
            np.int32(limit),
            np.bool_(early),
            accuracy_target,
        )
        return jax.block_until_ready(compiled(carry, batches[g], *args))

    def launch(g: int, carry: Carry | None, limit: int, first: bool) -> Carry:
        early = early_exit and first
        if deadline is None or not first:  # a resume runs to where the other groups already are, within the time
            out = call(g, carry, limit, first, early)
        else:
            run = lambda c, n, prepare: call(g, c, n, prepare, early)  # noqa: E731
            reach = Reach(spec, group_real[g], lambda: float(accuracy_target)) if layout.groups == 1 else None
            out, cut[g] = within(run, carry, limit, first, deadline, reach)
        if layout.parallel and int(out.chunks) >= spec.n_chunks:  # never resumed: free its states now
            out = out._replace(states=None)
        return out

    at_once = layout.parallel or layout.groups
    with concurrent.futures.ThreadPoolExecutor(max_workers=at_once) as pool:
        say(f"compiling the sweep program ({layout.groups} group(s) of {size} configurations) while building states")
        compiling = precompiled or pool.submit(
            compile_sweep, spec, layout, example_state=example_state, batch_for=batch_for, traces=traces
        )
        # the initial states are built while the program compiles, unless the groups run in memory-sized turns
        carries: list[Carry | None] = [initial(g) if at_once >= layout.groups else None for g in range(layout.groups)]
        compiled, compile_seconds = compiling.result()
        deadline = None if time_limit is None else time.perf_counter() + time_limit
        cut = [""] * layout.groups  # why each group stopped short of its steps (within)
        accuracy_target = np.float32(spec.target_accuracy if target_accuracy is None else target_accuracy())
        stops = f" (stops {'at the first fit' if spec.first_fit_ends else 'once every configuration has fit'})"
        say(f"compiled in {compile_seconds:.1f} s; running up to {total} steps" + (stops if early_exit else ""))
        first_fit = spec.first_fit_ends and early_exit
        if first_fit:
            ran = _until_first_fit(spec, layout, lambda g, limit: launch(g, carries[g], limit, True), group_real)
        else:
            ran = list(pool.map(lambda g: launch(g, carries[g], spec.n_chunks, True), range(layout.groups)))
        carries.clear()  # the initial states: donated, or built per group
        last, behind = _ending(ran, group_real, first_fit, any(cut))
        if any(cut):
            say(cut_note(cut, last * spec.chunk, time_limit))
        if behind:
            say(f"resuming {len(behind)} group(s) that stopped early to step {last * spec.chunk}")
        for g, carry in zip(behind, pool.map(lambda g: launch(g, ran[g], last, False), behind)):
            ran[g] = carry

    out = _collected(layout, ran, last * spec.chunk, compile_seconds, time.perf_counter() - start)
    return out._replace(cut=any(cut), out_of_reach="reach" in cut)


def _initial_carry(states: PyTree, size: int, total: int) -> Carry:
    """A group's carry before its first chunk: no chunk run, its states, no losses, accuracy or fit yet."""
    return Carry(
        np.int32(0), states, np.full((size, total), np.nan, np.float32), np.zeros(size, np.float32),
        np.full(size, -1, np.int32),
    )  # fmt: skip


def _ending(ran: list[Carry], group_real: np.ndarray, first_fit: bool, cut: bool) -> tuple[int, list[int]]:
    """``(the chunk every curve runs to, the groups that resume to it)``: out of time, where the shortest group
    stopped, and nothing resumes; else :func:`_last_chunk`, the groups that stopped before it resuming. Not
    jit-safe."""
    if cut:
        return min(int(c.chunks) for c in ran), []
    last = _last_chunk(ran, group_real, first_fit)
    return last, [g for g, c in enumerate(ran) if int(c.chunks) < last]


def _collected(
    layout: GroupLayout, ran: list[Carry], steps_run: int, compile_seconds: float, seconds: float
) -> SweepOutput:
    """The groups' results per configuration, in configuration order, each curve cut at ``steps_run`` (a fit
    after that end is none). Not jit-safe."""
    n_configs = int(layout.slots[~layout.padding].max()) + 1
    where = [layout.first_slot(c) for c in range(n_configs)]
    host = [(np.asarray(c.losses), np.asarray(c.accuracy), np.asarray(c.reached_at)) for c in ran]
    losses = np.stack([host[g][0][j, :steps_run] for g, j in where])
    accuracy = np.asarray([host[g][1][j] for g, j in where])
    reached_at = np.asarray([host[g][2][j] for g, j in where])
    reached_at = np.where(reached_at < steps_run, reached_at, -1)
    return SweepOutput(losses, accuracy, reached_at, steps_run, compile_seconds, seconds)


def _last_chunk(ran: list[Carry], group_real: np.ndarray, first_fit: bool) -> int:
    """The chunk every group's curve runs to: the furthest any group ran (the groups that stopped early resume
    to it), or in a first-fit sweep the earliest fit (every group ran at least that far). Not jit-safe."""
    chunks = [int(c.chunks) for c in ran]
    fits = [n for n, c, real in zip(chunks, ran, group_real) if _fit_in(c, real)]
    return min(fits) if first_fit and fits else max(chunks)


def _fit_in(carry: Carry, real: np.ndarray) -> bool:
    """Whether a real configuration of this group's run reached the target. Not jit-safe."""
    return bool(np.any((np.asarray(carry.reached_at) >= 0) & real))


def _until_first_fit(
    spec: SweepSpec, layout: GroupLayout, launch: Callable[[int, int], Carry], group_real: np.ndarray
) -> list[Carry]:
    """The groups of a ``first_fit_ends`` sweep, one after another, each limited to the earliest fit so far (a
    group after a fit runs no further than it). Not jit-safe."""
    ran: list[Carry] = []
    limit = spec.n_chunks
    for g in range(layout.groups):
        carry = launch(g, limit)
        if _fit_in(carry, group_real[g]):
            limit = min(limit, int(carry.chunks))
        ran.append(carry)
    return ran


def stack_states(per_seed_leaves: Sequence[Sequence[Any]], treedef: Any, seed_of: np.ndarray) -> PyTree:
    """Stack the per-seed states' leaves so row ``j`` is seed ``seed_of[j]``'s; host numpy with canonical
    dtypes where possible (PRNG keys and other extended dtypes stay jax arrays). Not jit-safe."""

    def stack(xs):
        host = [host_leaf(x) for x in xs]
        if all(isinstance(x, np.ndarray) for x in host):
            return _stack_host(host)[seed_of]
        return jnp.take(jnp.stack([jnp.asarray(x) for x in xs]), jnp.asarray(seed_of), axis=0)

    return jax.tree_util.tree_unflatten(treedef, [stack(xs) for xs in zip(*per_seed_leaves)])
