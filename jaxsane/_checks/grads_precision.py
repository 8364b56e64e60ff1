"""The precision of the gradient check: the dtype a function really computes in on the path from the checked
leaves (an explicit ``astype`` or a ``dtype=jnp.bfloat16`` layer inside a float64 check), and the
finite-difference step and tolerances that go with it (:data:`GRAD_DEFAULTS`). Host-side, not jit-safe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._jaxpr.interpret import bodies

# effective compute dtype (by bits) -> (eps, atol, rtol). float64 is tighter than
# jax.test_util's 1e-5 step (eps 1e-6 keeps ReLU kinks out of the finite difference); the others
# follow jax.test_util.check_grads' default gradient tolerances (float32 2e-3, float16 1e-2,
# bfloat16 1e-1), loosened for float32/float16 because a loss of O(1) has finite-difference round-off
# of ~1e-7 / eps in float32.
GRAD_DEFAULTS: dict[str, tuple[float, float, float]] = {
    "float64": (1e-6, 1e-5, 1e-5),
    "float32": (1e-3, 5e-3, 2e-2),
    "float16": (1e-2, 5e-2, 5e-2),
    "bfloat16": (3e-2, 1e-1, 1e-1),
}


def is_real_float(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return isinstance(x, float)
    try:
        return bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:  # key dtypes
        return False


def tainted_float_dtypes(jaxpr, mask: Sequence[bool]) -> set:
    """Float dtypes of every value computed from the invars flagged in ``mask`` (recursing into calls)."""
    from jax.extend.core import Literal

    tainted = {v for v, m in zip(jaxpr.invars, mask) if m}
    found: set = set()
    for eqn in jaxpr.eqns:
        flags = [not isinstance(v, Literal) and v in tainted for v in eqn.invars]
        if not any(flags):
            continue
        for sub, index in bodies(eqn):
            found |= tainted_float_dtypes(sub, [flags[i] for i in index])
        for out in eqn.outvars:
            dtype = getattr(out.aval, "dtype", None)
            if dtype is not None and is_real_float(out.aval):
                found.add(np.dtype(dtype))
            tainted.add(out)
    return found


def dtype_name(dtype: Any) -> str:
    name = np.dtype(dtype).name
    return name if name in GRAD_DEFAULTS else ("float64" if np.dtype(dtype).itemsize >= 8 else "float32")


def lowest(dtypes: Iterable[Any], default: str) -> str:
    order = ["bfloat16", "float16", "float32", "float64"]
    names = [dtype_name(d) for d in dtypes]
    for name in order:
        if name in names:
            return name
    return default


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """The comparison's settings: the dtype the function really computes in on the path from the checked
    leaves, and the step and tolerances (the ones asked for, else that dtype's ``GRAD_DEFAULTS``)."""

    compute: str
    eps: float
    atol: float
    rtol: float
    kink_rtol: float

    @classmethod
    def of(
        cls,
        jaxpr: Any,
        n: int,
        tdtype: np.dtype,
        *,
        eps: float | None,
        atol: float | None,
        rtol: float | None,
        kink_rtol: float | None,
    ) -> Tolerance:
        """The settings for the first ``n`` inputs of the closed ``jaxpr``, checked in ``tdtype``; the given
        step and tolerances win over the defaults."""
        mask = [True] * n + [False] * (len(jaxpr.jaxpr.invars) - n)
        compute = lowest(tainted_float_dtypes(jaxpr.jaxpr, mask) or {tdtype}, dtype_name(tdtype))
        d_eps, d_atol, d_rtol = GRAD_DEFAULTS[compute]
        eps = d_eps if eps is None else float(eps)
        atol = d_atol if atol is None else float(atol)
        rtol = d_rtol if rtol is None else float(rtol)
        kink_rtol = rtol if kink_rtol is None else float(kink_rtol)
        return cls(compute, eps, atol, rtol, kink_rtol)

    @property
    def ladder(self) -> tuple[float, ...]:
        """Finite-difference steps tried in turn; a leaf fails only if it fails at every one and the gap
        does not shrink with the step. ReLU kinks crossed by the step spoil the difference quotient
        (on a 2M-parameter MLP by ~1e-3 at step 1e-6) in proportion to the step; a real bug
        (a wrong sign, a missing factor) leaves the same gap at every step."""
        eps = self.eps
        return (eps, eps / 10, eps / 100, eps / 1000) if self.compute == "float64" else (eps, eps / 3, eps / 10)
