"""The compiled engine behind :func:`jaxsane.overfit`: many configurations of one step, vmapped.

Every configuration is one slice of a ``jax.vmap``-ed train state. The steps run in a
``lax.scan`` of ``chunk`` steps inside a ``lax.while_loop`` that exits once every real
configuration has reached the target, so the sweep needs no host round trip between steps. A step that
convolves runs on XLA:CPU in a host loop instead (:class:`HostLooped`): XLA:CPU runs convolutions inside
loop bodies several times slower than outside them.

The loop's carry is both the program's input and its output, which makes the program resumable:
the configurations can be split into equal *groups* that run the same compiled executable
side by side. On the CPU backend one group per core runs in its own host thread (XLA:CPU runs
small batched programs on one core; the cores are otherwise idle); on GPU and TPU one group fills
the device. A group that exits early is resumed, early exit off, to the chunk where the last group
stopped, so every configuration runs exactly the steps a single vmapped program would have run.

The program is traced and compiled once, in a background thread, while the host builds the
per-seed initial states (or earlier: :func:`compile_sweep` can be started ahead, as doctor does while
its other stages run). :func:`sweep_program` is jit-safe (it is what gets jitted); the rest runs on the host.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core.tree import PyTree, host_leaf, is_array, replicated_over_devices
from .._jaxpr.compile_level import compiler_options
from .._jaxpr.interpret import all_eqns
from .time_guard import Reach, cut_note, within


class Carry(NamedTuple):
    """The ``while_loop`` carry of one group, also the program's input and output. Its leaves are jax arrays
    in the program, numpy arrays when a run starts on the host, ``jax.ShapeDtypeStruct`` when compiling."""

    chunks: Any  # int32 []: chunks run so far
    states: PyTree  # [size, ...] train states
    losses: Any  # float32 [size, total]; NaN where not run yet
    accuracy: Any  # float32 [size]: per-example accuracy after the last chunk (0 when unmeasured)
    reached_at: Any  # int32 [size]: first step that met the target, -1 when never


@dataclasses.dataclass
class TraceCount:
    """How many times the sweep program was traced, i.e. compiled (a Python side effect of tracing it)."""

    count: int = 0


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """Which configuration sits in which slot of which group.

    ``slots[g, j]`` is a configuration index; ``padding[g, j]`` marks slots that repeat one of the
    group's configurations only to give every group the same size (their results are dropped).
    """

    slots: np.ndarray  # int [groups, size]
    padding: np.ndarray  # bool [groups, size]
    parallel: int = 0  # groups that run at once (0: all); fewer when their states would not fit in memory together

    @property
    def groups(self) -> int:
        return self.slots.shape[0]

    @property
    def size(self) -> int:
        return self.slots.shape[1]

    def first_slot(self, config: int) -> tuple[int, int]:
        """``(group, slot)`` holding ``config`` (not a padding slot)."""
        g, j = np.argwhere((self.slots == config) & ~self.padding)[0]
        return int(g), int(j)


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


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    """What one step of one configuration is and when it has fit. ``step`` is
    ``(state, batch) -> (state, loss)``; ``prepare`` is ``(state, lr, scale) -> state`` (lr NaN: keep the
    state's rate), or None when the states come prepared; ``accuracy`` is ``(state, batch) -> accuracy``
    or None. All jit-safe. ``target_accuracy`` is the one asked for; the program takes the one it uses as an
    argument (above 1 when apply's accuracy cannot judge the fit, which may be found while it compiles)."""

    step: Callable[[PyTree, PyTree], tuple[PyTree, jax.Array]]
    prepare: Callable[[PyTree, jax.Array, jax.Array], PyTree] | None
    accuracy: Callable[[PyTree, PyTree], jax.Array] | None
    chunk: int
    n_chunks: int
    target: float
    target_accuracy: float
    first_fit_ends: bool = False
    """End the sweep once any real configuration has fit, not every one (a sweep that asks only whether some
    configuration fits: the scaled-update rescue of ``update_scale.py``). Its groups then run one after another,
    each no longer than the earliest fit so far, and every curve is cut at the earliest fit."""


def per_configuration(fn: Callable) -> Callable:
    """``jax.vmap(fn)`` over the configurations stacked on every argument's leading axis, except that a single
    configuration (a large model's sweep, or one run in memory-sized turns of one state) runs ``fn`` on it
    unbatched: a vmap over one slot still batches every matrix product, which XLA:CPU compiles about 15% longer
    and runs about 15% slower (a 1M-parameter LM's sweep step: 3.6 against 3.1 s of compile, 28 against 24 ms a
    step). Same results up to the last bits of fused floats. Jit-safe."""
    batched = jax.vmap(fn)

    def call(*args: Any) -> Any:
        leaves = jax.tree_util.tree_leaves(args)
        if not leaves or np.shape(leaves[0])[:1] != (1,):
            return batched(*args)
        one = jax.tree_util.tree_map(lambda x: x[0], args)
        return jax.tree_util.tree_map(lambda x: jnp.expand_dims(x, 0), fn(*one))

    return call


def sweep_program(spec: SweepSpec, traces: TraceCount) -> Callable:
    """The program of one group: ``run(carry, batches, lrs, scales, real, limit, early_exit, target_accuracy)
    -> carry``.

    Runs chunks until ``limit`` chunks have run or, when ``early_exit``, every ``real`` slot has reached
    the target. ``traces`` counts traces (one per compile). Jit-safe (it is what gets jitted).
    """
    vstep = per_configuration(spec.step)

    def run(carry: Carry, batches, lrs, scales, real, limit, early_exit, target_accuracy) -> Carry:
        traces.count += 1  # a Python side effect: counts traces, i.e. compiles of the sweep
        carry = _prepared(spec, carry, lrs, scales)

        def cond(c: Carry):
            return (c.chunks < limit) & ~(early_exit & _done(spec, c, real))

        def body(c: Carry) -> Carry:
            states, chunk_losses = lax.scan(lambda s, _: vstep(s, batches), c.states, None, length=spec.chunk)
            return _recorded(spec, c, states, chunk_losses, batches, target_accuracy)

        return lax.while_loop(cond, body, carry)

    return run


def _prepared(spec: SweepSpec, carry: Carry, lrs: Any, scales: Any) -> Carry:
    """The carry with each configuration's learning rate and init scale set (a first run). Jit-safe."""
    if spec.prepare is None:
        return carry
    return carry._replace(states=per_configuration(spec.prepare)(carry.states, lrs, scales))


def _done(spec: SweepSpec, c: Carry, real: Any) -> jax.Array:
    """Whether the group may stop early: every real configuration has reached the target (any one, with
    ``spec.first_fit_ends``). Jit-safe."""
    if spec.first_fit_ends:
        return jnp.any((c.reached_at >= 0) & real)
    return jnp.all((c.reached_at >= 0) | ~real)


def _recorded(
    spec: SweepSpec, c: Carry, states: PyTree, chunk_losses: Any, batches: PyTree, target_accuracy: Any
) -> Carry:
    """The carry after one chunk: its states, its losses (``[chunk, size]``) written in, and the step at which
    each configuration first met the loss (or accuracy) target. Jit-safe."""
    i, chunk = c.chunks, spec.chunk
    chunk_losses = chunk_losses.T  # [size, chunk]
    losses = lax.dynamic_update_slice(c.losses, chunk_losses, (0, i * chunk))
    # a ratio target needs a positive start: a loss at or below 0 never "fits" by ratio
    hit = (chunk_losses <= (spec.target * losses[:, 0])[:, None]) & (losses[:, 0] > 0)[:, None]
    first = jnp.where(jnp.any(hit, axis=1), i * chunk + jnp.argmax(hit, axis=1), -1).astype(jnp.int32)
    acc = c.accuracy
    if spec.accuracy is not None:
        acc = per_configuration(spec.accuracy)(states, batches)
        first = jnp.where((first < 0) & (acc >= target_accuracy), (i + 1) * chunk - 1, first)
    reached_at = jnp.where(c.reached_at >= 0, c.reached_at, first)
    return Carry(i + 1, states, losses, acc, reached_at)


class CompiledAhead:
    """``jax.jit(fn)`` compiled ahead for ``abstract`` arguments (on the default device), called like ``fn``. The
    arguments of a later call may live elsewhere: a user's step jitted with ``out_shardings`` returns its states
    replicated or sharded over a mesh, which the program compiled ahead refuses before it runs (jax checks the
    shardings first, so nothing is donated then); from that call on ``fn`` is jitted for the shardings it is
    given. Not jit-safe (host side)."""

    def __init__(self, fn: Callable, abstract: tuple, *, donate: bool = False):
        self.jitted = jax.jit(fn, donate_argnums=(0,) if donate else ())
        self.compiled: Any = self.jitted.lower(*abstract).compile()

    def __call__(self, *args: Any) -> Any:
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except ValueError as e:
                if "sharding" not in str(e):
                    raise
                self.compiled = None  # arguments placed otherwise than compiled for: jit for theirs
        return self.jitted(*args)


class HostLooped:
    """The group program for a step with convolutions on XLA:CPU, which runs a convolution inside any loop body
    (``while_loop``, ``scan``) several times slower than outside one (jax-ml/jax#12868: 127 ms against 15 ms a
    step of a linen BatchNorm CNN): the host loops over the chunks and their steps, calling three compiled
    programs, the vmapped step, the per-chunk record and the preparation. Called as the ``while_loop`` program
    is (``(carry, batches, lrs, scales, real, limit, early_exit, target_accuracy) -> carry``) with the same
    results, up to the last bits of fused floats; one host round trip per step (about a millisecond, next to a
    convolution step's tens). Not jit-safe (host side)."""

    def __init__(self, spec: SweepSpec, abstract: tuple):
        carry, batches, lrs, scales, real = abstract[:5]
        target_accuracy = abstract[-1]
        self.spec = spec
        self.step = CompiledAhead(per_configuration(spec.step), (carry.states, batches), donate=True)
        losses = jax.ShapeDtypeStruct((spec.chunk, lrs.shape[0]), jnp.float32, sharding=lrs.sharding)
        record = lambda c, chunk_losses, b, t: _recorded(spec, c, c.states, chunk_losses, b, t)  # noqa: E731
        self.record = CompiledAhead(record, (carry, losses, batches, target_accuracy), donate=True)
        self.prepare = CompiledAhead(functools.partial(_prepared, spec), (carry, lrs, scales), donate=True)
        self.done = CompiledAhead(functools.partial(_done, spec), (carry, real))

    def __call__(self, carry: Carry, batches, lrs, scales, real, limit, early_exit, target_accuracy) -> Carry:
        carry = self.prepare(carry, lrs, scales)
        while int(carry.chunks) < int(limit) and not (bool(early_exit) and bool(self.done(carry, real))):
            states, losses = carry.states, []
            for _ in range(self.spec.chunk):
                states, loss = self.step(states, batches)
                losses.append(loss)
            carry = self.record(carry._replace(states=states), jnp.stack(losses), batches, target_accuracy)
        return carry


def _spans_devices(tree: Any) -> bool:
    """Whether an array (or a sharding) of ``tree`` lives on several devices."""
    for leaf in jax.tree_util.tree_leaves(tree):
        sharding = leaf if isinstance(leaf, jax.sharding.Sharding) else getattr(leaf, "sharding", None)
        if sharding is not None and len(sharding.device_set) > 1:
            return True
    return False


def _one_call_at_a_time(program: Any, example_state: PyTree) -> Any:
    """The group program, called by one group's thread at a time when it spans several devices (the user's state
    is replicated or sharded over a mesh, or the program's outputs are): two threads launching one multi-device
    program at once can interleave its collectives across the devices, and XLA aborts the process. Not jit-safe."""
    inner = getattr(program, "step", None)  # HostLooped: its step program holds the user's shardings
    outputs = getattr(getattr(inner, "compiled", None) or program, "output_shardings", None)
    if not _spans_devices(example_state) and not _spans_devices(outputs):
        return program
    lock = threading.Lock()

    def serial(*args: Any) -> Any:
        with lock:  # until its outputs are ready: jax returns before the devices have run it
            return jax.block_until_ready(program(*args))

    return serial


def has_convolutions(jaxpr: Any) -> bool:
    """Whether a jaxpr (nested ones included) convolves. Not jit-safe."""
    return any(eqn.primitive.name == "conv_general_dilated" for eqn in all_eqns(jaxpr))


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


def _canonical(dtype: Any) -> Any:
    """The dtype jax computes in (int64 -> int32 without x64); extended dtypes (PRNG keys) as they are."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return dtype
    return jax.dtypes.canonicalize_dtype(dtype)


def _spec(x: Any, size: int, placement: Any = None) -> jax.ShapeDtypeStruct:
    """The abstract value of ``size`` stacked copies of leaf ``x`` (placed by ``placement`` when given)."""
    dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
    return jax.ShapeDtypeStruct((size, *np.shape(x)), _canonical(dtype), sharding=placement)


def replicated_placement(example_state: PyTree) -> Any:
    """The sharding that replicates every array of ``example_state`` over several devices, when they all share
    one (a data-parallel state: the user's step replicates it over a mesh), else None. The sweep's programs are
    compiled for it: the user's step inside returns its states there, and a program compiled for the default
    device refuses them and compiles again on the first call (an MLP-Mixer on 8 host devices: 3.5 s of its
    sweep). Not jit-safe."""
    shardings = {getattr(x, "sharding", None) for x in jax.tree_util.tree_leaves(example_state) if is_array(x)}
    if len(shardings) != 1:
        return None
    (sharding,) = shardings
    return sharding if sharding is not None and replicated_over_devices(sharding) else None


def _stack_host(xs: Sequence[Any]) -> np.ndarray:
    out = np.stack([np.asarray(x) for x in xs])
    return out.astype(_canonical(out.dtype), copy=False)


def compile_sweep(
    spec: SweepSpec,
    layout: GroupLayout,
    *,
    example_state: PyTree,
    batch_for: Callable[[int], PyTree],
    traces: TraceCount,
) -> tuple[Any, float]:
    """``(compiled group program, seconds)``: traced and compiled ahead of time (at the optimization level
    ``compiler_options`` in ``_jaxpr/compile_level.py`` picks for its chunks) for the abstract shapes of
    ``layout.size`` stacked states and batches. Safe to call in a background thread. A program spanning
    several devices runs one group at a time (:func:`_one_call_at_a_time`). Not jit-safe."""
    t = time.perf_counter()
    size, total = layout.size, spec.n_chunks * spec.chunk
    placement = replicated_placement(example_state)
    f32, i32 = jnp.float32, jnp.int32

    def value(shape: tuple, dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=placement)

    abstract = (
        Carry(
            value((), i32),
            jax.tree_util.tree_map(lambda x: _spec(x, size, placement), example_state),
            value((size, total), f32),
            value((size,), f32),
            value((size,), i32),
        ),
        jax.tree_util.tree_map(lambda x: _spec(x, size, placement), batch_for(0)),
        value((size,), f32),
        value((size,), f32),
        value((size,), bool),
        value((), i32),
        value((), bool),
        value((), f32),
    )
    traced = jax.jit(sweep_program(spec, traces), donate_argnums=(0,)).trace(*abstract)
    if jax.default_backend() == "cpu" and has_convolutions(traced.jaxpr):  # (the trace counted: one program)
        return _one_call_at_a_time(HostLooped(spec, abstract), example_state), time.perf_counter() - t
    compiled = traced.lower().compile(compiler_options(traced.jaxpr, runs=spec.n_chunks))
    return _one_call_at_a_time(compiled, example_state), time.perf_counter() - t


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
