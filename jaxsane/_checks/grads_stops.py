"""Which checked leaves flow into a ``lax.stop_gradient``: there autodiff takes the value as a constant while
finite differences see it move, so the two differ by design (a straight-through estimator ``z + stop_gradient(q -
z)``, a commitment loss, a target network). A ``grad.mismatch`` on such a leaf is that, not a wrong rule.

Read off the checked function's jaxpr: each value carries the set of checked leaves it depends on, through every
equation and into the jaxprs that calls run (``pjit``, ``custom_jvp_call``, ``remat``, a ``scan`` body); a
``stop_gradient`` records the leaves of its operand and passes none on. Loops whose bodies are not called on the
equation's own operands (``while``, ``cond``) pass their operands' leaves on without looking inside.

Not jit-safe (host-side, on a traced jaxpr).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax._src import core as jcore

from .._core.frames import frames_of, is_library_file, user_location
from .._jaxpr.compile_level import quick_jit
from .._jaxpr.interpret import Interpreter, bodies


def stop_gradient_crossings(jaxpr: Any, n: int) -> list[tuple[str, ...]]:
    """Per checked leaf (the jaxpr's first ``n`` inputs), the ``file:line`` of each ``stop_gradient`` its value
    flows into, in program order (empty when none). Not jit-safe."""
    found, inside = _crossings(jaxpr, n)
    return [tuple(found.get(i) or inside.get(i) or ()) for i in range(n)]


def user_stop_gradients(jaxpr: Any, n: int) -> list[bool]:
    """Per checked leaf, whether its value flows into a ``stop_gradient`` the user wrote (not one a library function
    wrote, such as softmax's max shift, which changes no derivative). Not jit-safe."""
    found, _ = _crossings(jaxpr, n)
    return [bool(found.get(i)) for i in range(n)]


def _crossings(jaxpr: Any, n: int) -> tuple[dict[int, list[str]], dict[int, list[str]]]:
    """``(the user's, the libraries')``: per checked leaf, the locations of the stop_gradients of each kind."""
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else jaxpr
    found: dict[int, list[str]] = {}
    inside: dict[int, list[str]] = {}  # those a library wrote (softmax's max shift): named only when no other is
    env = {v: 1 << i for i, v in enumerate(jaxpr.invars[:n])}
    _walk(jaxpr, env, found, inside, ())
    return found, inside


_LIBRARIES = ("/jax/_src/nn/", "/jax/_src/numpy/", "/jax/_src/scipy/", "/optax/", "/flax/", "/equinox/")


def _written_by_a_library(eqn: Any) -> bool:
    """Whether a library function the user called wrote this equation (``jax.nn.softmax``'s max shift, optax's
    losses), rather than the user calling ``lax.stop_gradient`` itself: a library frame between jax's core and the
    user's innermost frame."""
    for frame in frames_of(eqn):
        if not is_library_file(frame.file_name):
            return False
        if any(lib in frame.file_name.replace("\\", "/") for lib in _LIBRARIES):
            return True
    return False


def _leaves(env: dict, v: Any) -> int:
    return 0 if isinstance(v, jcore.Literal) else env.get(v, 0)


def _walk(jaxpr: Any, env: dict, found: dict[int, list[str]], inside: dict[int, list[str]], enclosing: tuple) -> None:
    for eqn in jaxpr.eqns:
        ins = [_leaves(env, v) for v in eqn.invars]
        if eqn.primitive.name == "stop_gradient":
            where = user_location(eqn, enclosing) or "a stop_gradient"
            into = inside if _written_by_a_library(eqn) else found
            for i in range(max(ins, default=0).bit_length()):
                if any(m >> i & 1 for m in ins) and where not in into.setdefault(i, []):
                    into[i].append(where)
            continue  # what comes out carries no gradient
        called = called_jaxpr(eqn)
        if called is not None:
            inner, operands = called
            inner_env = {v: m for v, m in zip(inner.invars, (_leaves(env, o) for o in operands)) if m}
            _walk(inner, inner_env, found, inside, (*enclosing, eqn))
            for o, v in zip(eqn.outvars, inner.outvars):
                if _leaves(inner_env, v):
                    env[o] = _leaves(inner_env, v)
            continue
        union = 0
        for m in ins:
            union |= m
        if union:
            for o in eqn.outvars:
                env[o] = union


def called_jaxpr(eqn: Any) -> tuple[Any, list] | None:
    """``(body, its operands)`` of a call-like equation or a ``scan`` (its body's outputs are the equation's), from
    jaxsane's one table of sub-jaxprs (:func:`~jaxsane._jaxpr.interpret.bodies`), else None. Host-side."""
    if eqn.primitive.name in ("while", "cond"):  # bodies whose outputs are not the equation's one for one
        return None
    found = bodies(eqn)
    if len(found) != 1:
        return None
    body, index = found[0]
    return body, [eqn.invars[k] for k in index]


class _ThroughStops(Interpreter):
    """Evaluates a jaxpr with every ``stop_gradient`` passing its gradient through; the ``custom_jvp``/``custom_vjp``
    calls run as written (their rules are what the check judges), every other call is entered."""

    def before(self, eqn: Any, invals: list, tags: list, ectx: Any) -> tuple[list, list] | None:
        if eqn.primitive.name == "stop_gradient":
            return list(invals), [None] * len(invals)
        return None

    def enters(self, eqn: Any, ectx: Any) -> bool:
        return not eqn.primitive.name.startswith("custom_")


def unstopped_directional(scalar: Callable, values: list, ops: Any, dirs: list) -> Callable[[int], float | None]:
    """``j -> `` leaf ``j``'s directional derivative of ``scalar(values, ops)`` with its ``stop_gradient``s passing
    the gradient through (None when it cannot be taken): one compile, on the first call. A leaf whose mismatch
    this closes differs from finite differences only through the stop_gradient. Not jit-safe."""
    cache: dict[str, list | None] = {}

    def directional(j: int) -> float | None:
        if "grads" not in cache:
            try:
                closed = jax.make_jaxpr(scalar)(values, ops)

                def through(vals: list, operands: Any) -> Any:
                    flat = jax.tree_util.tree_leaves((vals, operands))
                    return _ThroughStops().run(closed.jaxpr, closed.consts, flat)[0][0]

                grads = quick_jit(jax.grad(through), runs=1)(values, ops)
                cache["grads"] = [np.asarray(g) for g in grads]
            except Exception:  # noqa: BLE001 - a program the interpreter cannot run: the mismatch stays an error
                cache["grads"] = None
        grads = cache["grads"]
        return None if grads is None else float(np.vdot(grads[j].ravel(), np.asarray(dirs[j]).ravel()))

    return directional
