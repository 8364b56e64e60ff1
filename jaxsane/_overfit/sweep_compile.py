"""Compiling the overfit sweep's group program (``sweep_program.py``) for where it runs.

The program is traced and compiled once, ahead of time, for the abstract shapes of one group's stacked states
and batches (doctor starts :func:`compile_sweep` in a background thread while its other stages run). A step that
convolves runs on XLA:CPU in a host loop instead (:class:`HostLooped`): XLA:CPU runs convolutions inside loop
bodies several times slower than outside them. A state replicated over a mesh is swept on one device when the
user's step only places its values there (:func:`on_one_device`), else on the mesh, one group's call at a time.
Not jit-safe (host side).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.tree import PyTree, replicated_placement
from .._jaxpr.compile_level import compiler_options
from .._jaxpr.interpret import all_eqns
from .._jaxpr.placement import places_values, unplaced
from .sweep_program import (
    Carry,
    GroupLayout,
    SweepSpec,
    TraceCount,
    done,
    per_configuration,
    prepare_carry,
    record_chunk,
    sweep_program,
)


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
        record = lambda c, chunk_losses, b, t: record_chunk(spec, c, c.states, chunk_losses, b, t)  # noqa: E731
        self.record = CompiledAhead(record, (carry, losses, batches, target_accuracy), donate=True)
        self.prepare = CompiledAhead(functools.partial(prepare_carry, spec), (carry, lrs, scales), donate=True)
        self.done = CompiledAhead(functools.partial(done, spec), (carry, real))

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


def canonical_dtype(dtype: Any) -> Any:
    """The dtype jax computes in (int64 -> int32 without x64); extended dtypes (PRNG keys) as they are."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return dtype
    return jax.dtypes.canonicalize_dtype(dtype)


def _spec(x: Any, size: int | None, placement: Any = None) -> jax.ShapeDtypeStruct:
    """The abstract value of ``size`` stacked copies of leaf ``x`` (of ``x`` itself when ``size`` is None) as the
    sweep's states hold it (from host arrays: never weakly typed), placed by ``placement`` when given."""
    dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
    shape = np.shape(x) if size is None else (size, *np.shape(x))
    return jax.ShapeDtypeStruct(shape, canonical_dtype(dtype), sharding=placement)


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
    ``layout.size`` stacked states and batches. A state replicated over a mesh is swept on one device when the
    step only places its values there (:func:`on_one_device`), else on that mesh. Safe to call in a background
    thread. A program spanning several devices runs one group at a time (:func:`_one_call_at_a_time`). Not
    jit-safe."""
    t = time.perf_counter()
    placement = replicated_placement(example_state)
    if placement is not None:
        one = on_one_device(spec, example_state, batch_for(0))
        if one is not None:
            probe = TraceCount()  # (a trace the mesh's program replaces is no compile)
            traced, abstract = _traced(one, layout, example_state, batch_for, probe, None)
            if not places_values(traced.jaxpr):  # prepare and accuracy too: nothing in the program names devices
                traces.count += probe.count
                return _compiled(one, traced, abstract, example_state=None), time.perf_counter() - t
    traced, abstract = _traced(spec, layout, example_state, batch_for, traces, placement)
    return _compiled(spec, traced, abstract, example_state), time.perf_counter() - t


def on_one_device(spec: SweepSpec, example_state: PyTree, batch: PyTree) -> SweepSpec | None:
    """``spec`` with a step that runs wherever its inputs are: the user's step with its jit's shardings dropped
    (``_jaxpr/placement.py``), when placement is all it holds; None otherwise. On 8 host devices sharing 2 cores,
    an MLP-Mixer's sweep compiled for the mesh its state is replicated on ran on every device, 8 times the work.
    Not jit-safe."""
    # traced at abstract values placed nowhere: the replicated arrays' own carry their mesh into the jaxpr's equations
    step = unplaced(spec.step, *jax.tree_util.tree_map(lambda x: _spec(x, None), (example_state, batch)))
    return None if step is None else dataclasses.replace(spec, step=step)


def _traced(
    spec: SweepSpec,
    layout: GroupLayout,
    example_state: PyTree,
    batch_for: Callable[[int], PyTree],
    traces: TraceCount,
    placement: Any,
) -> tuple[Any, tuple]:
    """``(traced group program, its abstract arguments)`` for ``layout.size`` stacked states and batches placed
    by ``placement``."""
    size, total = layout.size, spec.n_chunks * spec.chunk
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
    return jax.jit(sweep_program(spec, traces), donate_argnums=(0,)).trace(*abstract), abstract


def _compiled(spec: SweepSpec, traced: Any, abstract: tuple, example_state: PyTree | None) -> Any:
    """The traced group program compiled (host-looped for a convolution on XLA:CPU), one group's call at a time
    when it spans several devices (``example_state``: the state it runs on, None when on one device)."""
    if jax.default_backend() == "cpu" and has_convolutions(traced.jaxpr):  # (the trace counted: one program)
        return _one_call_at_a_time(HostLooped(spec, abstract), example_state)
    compiled = traced.lower().compile(compiler_options(traced.jaxpr, runs=spec.n_chunks))
    return _one_call_at_a_time(compiled, example_state)
