"""How hard XLA optimizes the programs jaxsane compiles for itself.

jaxsane's analysis programs (the loss at init, the gradient check, the run stage's telemetry, the
overfit sweep) run once or a few times, so on the CPU their compile is most of their cost. At its
default backend optimization level XLA:CPU compiles about twice as long as at level 0, and the code it
generates runs about 2.3x faster; matrix products and convolutions run in the same library kernels at
either level. Level 0 pays off while the runs are short against the compile.

The choice is made from the program's jaxpr before it compiles, so it is deterministic: the compile
grows with the number of equations, the run's penalty with the elements the generated code touches
times the runs. On a GPU, where compiling a matrix-heavy program is mostly autotuning (each matrix
product's fusion compiled and timed in several tilings on the device), the analysis programs compile
with autotuning off (:data:`QUICK_GPU`): XLA then takes its default tiling, which runs the few steps an
analysis program runs about as fast. On TPU programs compile as XLA defaults. The user's own step is
never recompiled with other options. The options can change the last bits of a float (the order of
fused operations), never more.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np
from jax._src import core as jcore

QUICK = {"xla_backend_optimization_level": 0}
"""The compiler options of a program compiled for a quick compile (XLA:CPU's lowest optimization level)."""

QUICK_GPU = {"xla_gpu_autotune_level": 0}
"""The compiler options of a jaxsane analysis program on a GPU: no autotuning of its fusions' tilings."""

BREAK_EVEN_WORK_PER_EQUATION = 1.5e6
"""Elements touched x runs, per jaxpr equation, below which a program compiles at level 0. Measured on a
2-core CPU where both levels cost the same: a 16-configuration MLP overfit sweep near 900 steps (1.7e6
per equation; 0.34 s of compile saved, 3.4e-4 s per step lost) and the small causal LM's near 70 steps
(1.2e6 per equation; 3.7 s saved, 0.055 s per step lost)."""


def _sub_jaxprs(params: dict) -> Iterator[tuple[Any, float]]:
    """``(jaxpr, multiplier)`` for each jaxpr in an equation's params: a scan body counts ``length``
    times, one branch of a cond counts (the costliest is taken by the caller), a while body once."""
    for value in params.values():
        items = value if isinstance(value, (tuple, list)) else (value,)
        for item in items:
            jaxpr = item.jaxpr if isinstance(item, jcore.ClosedJaxpr) else item
            if isinstance(jaxpr, jcore.Jaxpr):
                yield jaxpr, float(params.get("length", 1))


class ProgramCost(NamedTuple):
    """What a program costs, from its jaxpr: ``equations`` (its size, what its compile grows with),
    ``work`` (elements the code XLA generates touches, see :func:`_equation_cost`) and ``flops``
    (multiply-adds of its matrix products and convolutions, counted twice, plus ``work``)."""

    equations: int
    work: float
    flops: float


def _equation_cost(eqn: Any) -> tuple[float, float]:
    """``(work, flops)`` of one equation with no sub-jaxpr. A matrix product or convolution has no
    work: XLA:CPU hands it to the same precompiled library kernels at every optimization level (only
    the code XLA generates itself runs slower at level 0)."""
    name = eqn.primitive.name
    out_size = sum(math.prod(getattr(v.aval, "shape", ())) for v in eqn.outvars)
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 0.0, 2.0 * out_size * math.prod(lhs[d] for d in lhs_contract)
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
        return 0.0, 2.0 * out_size * math.prod(rhs) / max(out_features, 1)
    sizes = [math.prod(getattr(v.aval, "shape", ())) for v in (*eqn.invars, *eqn.outvars) if hasattr(v, "aval")]
    work = float(max(sizes, default=0))
    return work, work


def program_cost(jaxpr: Any) -> ProgramCost:
    """The :class:`ProgramCost` of a (closed) jaxpr, sub-jaxprs included: a scan's body counts ``length``
    times, a cond its costliest branch, a while body once. Not jit-safe (host only)."""
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else jaxpr
    equations, work, flops = 0, 0.0, 0.0
    for eqn in jaxpr.eqns:
        equations += 1
        subs = list(_sub_jaxprs(eqn.params))
        if not subs:
            w, f = _equation_cost(eqn)
            work, flops = work + w, flops + f
            continue
        costs = [(program_cost(sub), times) for sub, times in subs]
        equations += sum(c.equations for c, _ in costs)
        if eqn.primitive.name == "cond":
            work += max(c.work for c, _ in costs)
            flops += max(c.flops for c, _ in costs)
        else:
            work += sum(c.work * times for c, times in costs)
            flops += sum(c.flops * times for c, times in costs)
    return ProgramCost(equations, work, flops)


def _quick_for(backend: str) -> dict[str, Any] | None:
    """The quick options of ``backend`` (:data:`QUICK` on the CPU, :data:`QUICK_GPU` on a GPU), None elsewhere."""
    return {"cpu": QUICK, "gpu": QUICK_GPU}.get(backend)


@functools.cache
def _quick_compiles(backend: str) -> bool:
    """Whether this jax and XLA take ``backend``'s quick options (an XLA that renamed an option refuses it): one
    tiny compile on the default backend, once per process."""
    options = _quick_for(backend)
    try:
        jax.jit(lambda x: x + 1, compiler_options=options).lower(np.float32(0)).compile()
        return True
    except Exception:  # any refusal: compile at XLA's defaults, as before this module
        return False


def quick_options(backend: str | None = None) -> dict[str, Any] | None:
    """The options of a program that runs once, whatever its size: :data:`QUICK` on the CPU backend,
    :data:`QUICK_GPU` on a GPU (when this XLA takes them), else None. Not jit-safe."""
    backend = backend or jax.default_backend()
    options = _quick_for(backend)
    if options is None or not _quick_compiles(backend):
        return None
    return dict(options)


def compiler_options(jaxpr: Any, runs: float, backend: str | None = None) -> dict[str, Any] | None:
    """The compiler options for a program that runs ``runs`` times (for a ``while_loop`` program, its
    trip count): on the CPU backend :data:`QUICK` when the estimated run is short against the compile, else
    None (XLA's defaults); on a GPU :data:`QUICK_GPU` for every analysis program (autotuning is seconds per
    program, its gain over a few hundred steps a fraction of that). Not jit-safe."""
    backend = backend or jax.default_backend()
    options = quick_options(backend)
    if options is None or backend != "cpu":
        return options
    cost = program_cost(jaxpr)
    return options if cost.work * max(runs, 1) <= BREAK_EVEN_WORK_PER_EQUATION * max(cost.equations, 1) else None


class Jitted(Protocol):
    """What ``jax.jit`` and :class:`QuickJit` return: called like the function, and lowered ahead of a call."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def lower(self, *args: Any, **kwargs: Any) -> Any: ...


class QuickJit:
    """``jax.jit(fn, **jit_kwargs)`` whose compiler options are picked by :func:`compiler_options` for a
    program that runs about ``runs`` times, from the jaxpr of its first call (or ``lower``); later calls
    with other shapes keep that choice. Thread-safe; called like the jitted function. Called inside another
    trace (an outer jit or grad) it is a plain ``jax.jit``, as XLA takes compiler options only at the top."""

    def __init__(self, fn: Callable, *, runs: float, **jit_kwargs: Any):
        self._fn, self._runs, self._kwargs = fn, runs, jit_kwargs
        self._jitted: Any = None
        self._lock = threading.Lock()

    def _resolve(self, args: tuple, kwargs: dict) -> Any:
        with self._lock:
            if self._jitted is None:
                traced = jax.jit(self._fn, **self._kwargs).trace(*args, **kwargs)
                options = compiler_options(traced.jaxpr, self._runs)
                self._jitted = jax.jit(self._fn, compiler_options=options, **self._kwargs)
            return self._jitted

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not jcore.trace_state_clean():  # called under another transform: compiler options are top-level only
            return jax.jit(self._fn, **self._kwargs)(*args, **kwargs)
        return self._resolve(args, kwargs)(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        return self._resolve(args, kwargs).lower(*args, **kwargs)

    def _cache_size(self) -> int:
        """Programs compiled so far, as ``jax.jit``'s ``_cache_size`` (0 before the first call)."""
        return 0 if self._jitted is None else self._jitted._cache_size()


def quick_jit(fn: Callable, *, runs: float = 1, **jit_kwargs: Any) -> QuickJit:
    """:class:`QuickJit` of ``fn``: a jaxsane analysis program compiled for about ``runs`` runs."""
    return QuickJit(fn, runs=runs, **jit_kwargs)
