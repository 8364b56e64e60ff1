"""Which leaves a gradient check can trust to autodiff without finite differences (``trust_autodiff=True``).

JAX differentiates its own primitives exactly up to rounding: a gradient can be wrong only where a derivative rule
someone wrote takes over (``jax.custom_jvp``/``jax.custom_vjp``, Equinox's and Flax's wrappers of them, a custom
linear solve), and it differs from the loss's slope by design where a ``stop_gradient`` the user wrote cuts it.
Finite differences are what find those, and what tell a leaf with an identically zero gradient that the loss still
reads from one it does not. A leaf with none of these on its way has nothing for them to find.

A rule counts as JAX's own when the function it wraps and the rule itself are both defined inside the ``jax``
package (``jax.nn.relu``'s rule, for one); every other rule, a library's included, is checked. (A rule written
with ``defjvps`` around a function of jax itself passes for JAX's own: the names tell nothing more.)

Host-side, on a traced jaxpr; not jit-safe.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._jaxpr.interpret import all_eqns

JAX_OWN = "/jax/_src/"
"""Where JAX's own derivative rules are defined."""
_RULE_PARAMS = ("call_jaxpr", "fun_jaxpr", "jvp_jaxpr_fun", "jvp_jaxpr_thunk", "bwd", "fwd_jaxpr_thunk")
"""The parameters of a ``custom_jvp_call``/``custom_vjp_call`` equation that hold the wrapped function and its
rule, each with the ``debug_info`` of the Python function it was made from."""


def _source(value: Any) -> str | None:
    """``"name at file:line"`` of the Python function a jaxpr or wrapped function was traced from, or None."""
    info = getattr(value, "debug_info", None)
    if info is None and hasattr(value, "jaxpr"):  # a ClosedJaxpr
        info = getattr(value.jaxpr, "debug_info", None)
    return getattr(info, "func_src_info", None) or None


def _jax_own(eqn: Any) -> bool:
    """Whether a custom-derivative equation's function and rule are all defined inside jax itself."""
    if eqn.primitive.name not in ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"):
        return False  # a custom linear solve, a custom transpose: their rules are the caller's
    sources = [_source(eqn.params[k]) for k in _RULE_PARAMS if k in eqn.params]
    return bool(sources) and all(s is not None and JAX_OWN in s.replace("\\", "/") for s in sources)


def foreign_rules(jaxpr: Any) -> list[str]:
    """The derivative rules in ``jaxpr`` and every jaxpr it calls that are not JAX's own (module docstring), each
    as the source of the function it wraps (``"f at train.py:12"``) or its primitive's name; empty when autodiff
    of the jaxpr runs on JAX's own rules only. Not jit-safe."""
    found: list[str] = []
    for eqn in all_eqns(jaxpr):
        name = eqn.primitive.name
        if (name.startswith("custom_") or name == "linear_solve") and not _jax_own(eqn):
            where = _source(eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")) or name
            if where not in found:
                found.append(where)
    return found


def needs_differences(grads: list, user_stops: list[bool], foreign: list[str]) -> list[bool]:
    """Per checked leaf, whether finite differences must judge it: a rule not JAX's own in the function (then
    every leaf), a ``stop_gradient`` the user wrote on its way (``user_stops``), or a gradient that is identically
    zero or not finite. Host-side."""
    if foreign:
        return [True] * len(grads)
    return [bool(stop or not np.all(np.isfinite(g)) or not np.any(g)) for g, stop in zip(grads, user_stops)]
