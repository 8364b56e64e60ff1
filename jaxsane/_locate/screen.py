"""A compiled screen for the replay: whether the replay's outputs would be finite, from one XLA program.

The replay (``replay.py``) evaluates a jaxpr on the host equation by equation: numpy for the common primitives,
and a compile of its own for every other primitive's shape (``bind``). A model with convolutions compiles each
convolution alone: an Equinox WaveNet's gradient binds 42 convolution shapes, 3.5 s of a 2-core machine, 7 s
beside doctor's other work. The question doctor's grads stage asks of the replay is the latent-NaN one
(``latent_nan_findings``): is the gradient non-finite when evaluated operation by operation, where the compiled
one is finite? On most programs the answer is no, and :func:`finite_everywhere` gives it from one program that
walks the jaxpr as the replay does (calls opened, loops and ``cond`` whole), with every equation's outputs behind
an ``optimization_barrier``: XLA then evaluates each equation on its own, with no fusion or rewrite across two
of them (how a compiled gradient hides a ``0 * inf``), so its outputs are the replay's, up to the last bits of
each operation. Only a program whose outputs are not all finite is replayed. :func:`screen_pays` says when the
screen's one compile costs less than the replay's own. Not jit-safe (it compiles and runs the screen).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import core as jcore

from .._jaxpr.compile_level import quick_jit
from .._jaxpr.interpret import CALLS, Interpreter, call_body
from .replay import HOST_PRIMITIVES

BIND_SECONDS = 0.1
"""A replay's compile of one primitive's shape on XLA:CPU (a convolution's: 0.05-0.25 s on 2 cores)."""
SCREEN_SECONDS_PER_EQUATION = 1e-3
"""The screen's compile and run per equation of the walked jaxpr (a 1M-parameter LM's 1406-equation gradient:
1.5 s; the WaveNet's 896: 1.0 s)."""


def _floating(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.inexact))


def _plain(x: Any) -> bool:
    """An array an ``optimization_barrier`` takes (not a PRNG key or another extended dtype)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


class _Screen(Interpreter):
    """The replay's walk, traced: calls opened, loops and ``cond`` bound whole, every equation's outputs held
    behind a barrier. Jit-safe (it runs inside the screen's program)."""

    def enters(self, eqn: Any, ectx: Any) -> bool:
        return eqn.primitive.name in CALLS

    def after(self, eqn: Any, invals: list, outs: list, tags: list, out_tags: list, ectx: Any) -> tuple[list, list]:
        held = [i for i, o in enumerate(outs) if _plain(o)]
        if not held:
            return outs, out_tags
        outs = list(outs)
        for i, o in zip(held, jax.lax.optimization_barrier([outs[i] for i in held])):
            outs[i] = o
        return outs, out_tags


def finite_everywhere(closed: jcore.ClosedJaxpr, args: Sequence[Any]) -> bool:
    """Whether ``closed``'s outputs on ``args`` are all finite with every equation evaluated on its own (calls
    opened, loops whole: what the replay computes). One compiled program; not jit-safe."""

    def program(consts: list, xs: list) -> jax.Array:
        outs, _ = _Screen().run(closed.jaxpr, consts, xs)
        bad = [jnp.any(~jnp.isfinite(o)) for o in outs if _floating(o)]
        return jnp.any(jnp.stack(bad)) if bad else jnp.asarray(False)

    return not bool(quick_jit(program)(list(closed.consts), list(args)))


def _key(value: Any) -> Any:
    """A parameter as part of a bound shape's identity (a loop's body by identity, not by its printout)."""
    return id(value) if isinstance(value, (jcore.Jaxpr, jcore.ClosedJaxpr)) else repr(value)


def screen_pays(closed: jcore.ClosedJaxpr) -> bool:
    """Whether the screen's compile costs less than the replay's: each distinct shape of a primitive the replay
    compiles (:data:`BIND_SECONDS`) against the screen's equations (:data:`SCREEN_SECONDS_PER_EQUATION`). A
    transformer LM's gradient binds 7 shapes of gathers and scatters among 1406 equations (replay 0.6 s, screen
    1.5 s); a WaveNet's 54 among 896 (3.5 s against 1.0 s). Static; not jit-safe."""
    bound: set[tuple] = set()
    equations = 0

    def walk(jaxpr: Any) -> None:
        nonlocal equations
        for eqn in jaxpr.eqns:
            equations += 1
            body = call_body(eqn)
            if body is not None:
                walk(body[0])
            elif eqn.primitive.name not in HOST_PRIMITIVES:
                avals = tuple((getattr(v.aval, "shape", ()), str(getattr(v.aval, "dtype", ""))) for v in eqn.invars)
                params = tuple(sorted((k, _key(v)) for k, v in eqn.params.items()))
                bound.add((eqn.primitive.name, avals, params))

    walk(closed.jaxpr)
    return len(bound) * BIND_SECONDS > equations * SCREEN_SECONDS_PER_EQUATION
