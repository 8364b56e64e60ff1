"""Naming the cause of a non-finite value found by :func:`jaxsane.locate`, with a specific fix.

Given the equation where a NaN/Inf is born and the real values around it, :func:`explain` says
what happened in numbers (``sqrt'(0.0) -> inf``, ``div(0.0, 0.0) -> nan``), which classic bug
that is (log of 0, the ``jnp.where`` trap, a masked mean over an all-padding row, ``-inf``
masks, exp/float16 overflow, optimizer eps underflow, ...) and what to change: the first rule of
:data:`_RULES` for the equation's primitive that fits its values. Host-side only, not jit-safe.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from .nan_values import (
    LOW_PRECISION,
    describe,
    first_bad_index,
    fmt_value,
    in_files,
    masked_count,
    node_loc,
    node_source,
    out_dtype,
    primal_eqn,
    producers,
    then_text,
    value_array,
    value_at,
    zero_cotangent,
)

_SOFTMAX_FILES = (
    os.path.join("jax", "_src", "nn", "functions.py"),
    os.path.join("jax", "_src", "ops", "special.py"),
    os.path.join("optax", "losses"),
    os.path.join("jax", "_src", "lax", "lax.py"),
)


@dataclasses.dataclass
class Cause:
    values: str  # what produced it, in numbers
    cause: str  # the classic bug it is
    fix: str  # what to change
    then: str = ""  # what it turned into downstream (e.g. 0 * inf = NaN in the backward pass)


# ----------------------------------------------------------------------------- the causes

# primitive -> the user-level function that binds it (valid Python in a fix text)
_USER_FN = {
    "pow": "jnp.power",
    "integer_pow": "jnp.power",
    "acos": "jnp.arccos",
    "asin": "jnp.arcsin",
    "atan": "jnp.arctan",
    "acosh": "jnp.arccosh",
    "asinh": "jnp.arcsinh",
    "atanh": "jnp.arctanh",
    "atan2": "jnp.arctan2",
    "div": "jnp.divide",
    "rsqrt": "jax.lax.rsqrt",
    "logistic": "jax.nn.sigmoid",
    "erf_inv": "jax.scipy.special.erfinv",
    "lgamma": "jax.scipy.special.gammaln",
    "digamma": "jax.scipy.special.digamma",
}
_SAFE_AT_ZERO = ("acos", "asin", "atanh")  # 1.0 is the edge of their domain: evaluate the untaken branch at 0


def _user_fn(prim: str) -> str:
    return _USER_FN.get(prim, f"jnp.{prim}")


def _where_fix(prim: str) -> str:
    """The double-where fix for ``prim``, as valid Python with the operator's own arity."""
    tail = ", so the untaken branch is evaluated at a harmless point and its derivative is finite"
    if prim == "div":
        return (
            'apply the where to the denominator as well ("double where"): safe = jnp.where(cond, d, 1.0); '
            "y = jnp.where(cond, x / safe, 0.0)" + tail
        )
    if prim in ("pow", "integer_pow"):
        return (
            'apply the where to the base as well ("double where"): safe = jnp.where(cond, x, 1.0); '
            "y = jnp.where(cond, safe ** p, 0.0)" + tail
        )
    if prim == "atan2":
        return (
            'apply the where to the arguments as well ("double where"): safe_y = jnp.where(cond, y, 0.0); '
            "safe_x = jnp.where(cond, x, 1.0); r = jnp.where(cond, jnp.arctan2(safe_y, safe_x), 0.0)" + tail
        )
    harmless = "0.0" if prim in _SAFE_AT_ZERO else "1.0"
    return (
        f'apply the where to the input as well ("double where"): safe = jnp.where(cond, x, {harmless}); '
        f"y = jnp.where(cond, {_user_fn(prim)}(safe), 0.0)" + tail
    )


@dataclasses.dataclass
class _Site:
    """The equation where a NaN/Inf is born, with what the rules of :func:`explain` read off it."""

    analysis: Any
    node: Any
    phase: str
    prim: str
    dt: str  # its output dtype
    ins: list[np.ndarray]
    vals: list  # the inputs at the first non-finite output element (None where one does not broadcast)
    text: str  # its source line, without spaces
    values: str  # what produced it, in numbers (:func:`describe`)
    then: str  # what it turned into downstream

    @classmethod
    def of(cls, analysis: Any, node: Any, phase: str) -> _Site:
        values = describe(node)
        dt = out_dtype(node)
        ins = [value_array(x) for x in node.ins]
        out = value_array(next((o for o in node.outs if o.bad), node.outs[0]))
        idx = first_bad_index(out)
        vals = [value_at(a, idx, out.shape) for a in ins]
        then = then_text(analysis, node)
        text = node_source(node).replace(" ", "")
        return cls(analysis, node, phase, node.prim, dt, ins, vals, text, values, then)

    def cause(self, cause: str, fix: str) -> Cause:
        return Cause(self.values, cause, fix, self.then)


def _inf_passed_on(s: _Site) -> Cause | None:
    """An infinite input comes out infinite (no NaN born here)."""
    node = s.node
    if not any(x.bad for x in node.ins) or any(o.nan for o in node.outs):
        return None
    xent = any(
        in_files(c, (os.path.join("optax", "losses"), os.path.join("jax", "_src", "nn")))
        for c in s.analysis.downstream(node, limit=64)
        if c != "output" and not getattr(c, "link", True)
    )
    if xent:
        return s.cause(
            "a -inf mask reaches a cross-entropy/log-softmax: the label (or target mass) sits on a masked "
            "position, so its log-probability is -inf",
            "make sure labels never point at masked positions, and mask with a large finite negative "
            "(jnp.finfo(x.dtype).min) instead of -inf",
        )
    return s.cause(
        "an infinite constant (e.g. a -inf mask) flows into the outputs unchanged",
        "use a large finite value (jnp.finfo(dtype).min/max) instead of inf, or mask the outputs too",
    )


def _inf_to_nan(s: _Site) -> Cause | None:
    """An infinite input turned into NaN: -inf masks, inf - inf, 0 * inf, inf / inf."""
    prim = s.prim
    if not any(x.bad for x in s.node.ins):
        return None
    if prim in ("sub", "add", "mul", "div") and in_files(s.node, _SOFTMAX_FILES[:3]):
        return s.cause(
            "a -inf mask in a softmax/logsumexp/cross-entropy: a fully masked row has max = -inf, "
            "and -inf - (-inf) = NaN",
            "mask with a large finite negative (jnp.finfo(x.dtype).min or -1e9) instead of -inf, or pass "
            "where=mask to jax.nn.softmax; drop rows with no valid position",
        )
    if prim in ("sub", "add"):
        return s.cause(
            "inf - inf = NaN: both operands are infinite",
            "keep the operands finite: replace the infinite constant by jnp.finfo(dtype).max/min, or "
            "mask the result instead of the operands",
        )
    if prim == "mul":
        return s.cause(
            "0 * inf = NaN",
            "make the infinite factor finite before multiplying (clip it, or use "
            "jnp.where on the input rather than the output)",
        )
    if prim == "div":
        return s.cause("inf / inf = NaN", "keep numerator and denominator finite (compute the ratio in log space)")
    return s.cause(f"{prim} turned an infinite input into NaN", "keep the infinite input out of this computation")


def _eps_underflow(s: _Site) -> Cause | None:
    """float16 Adam: ``m / (sqrt(v) + eps)`` with eps rounded to 0."""
    node = s.node
    if not (
        s.dt == "float16"
        and s.phase == "update"
        and len(node.ins) == 2
        and any(p.prim in ("sqrt", "rsqrt") for p in producers(node.ins[1], depth=3) if not p.link)
    ):
        return None
    return s.cause(
        "the optimizer's eps underflows in float16: eps=1e-8 rounds to 0 (float16's smallest subnormal "
        "is 6e-8), so m / (sqrt(v) + eps) divides by 0 where the gradient is 0",
        "keep the optimizer state and update in float32 (cast params and grads to float32 before "
        "tx.update, or use optax's mu_dtype=jnp.float32), or raise eps to >= 1e-4 in float16",
    )


def _log(s: _Site) -> Cause | None:
    x = s.vals[0]
    edge = -1.0 if s.prim == "log1p" else 0.0
    if x is not None and float(x) == edge:
        return s.cause(
            f"{s.prim} of {fmt_value(edge)} is -inf",
            "keep the argument positive: jnp.log(jnp.maximum(x, eps)) or jnp.log(x + eps); for "
            "log(softmax(z)) use jax.nn.log_softmax(z), for log(sigmoid(z)) jax.nn.log_sigmoid(z), "
            "for cross-entropy optax.softmax_cross_entropy on logits",
        )
    return s.cause(
        f"{s.prim} of a negative number is NaN",
        "the argument went negative: clamp it (jnp.log(jnp.maximum(x, eps))) or fix the computation "
        "that makes it negative",
    )


def _sqrt(s: _Site) -> Cause | None:
    x = s.vals[0]
    if x is not None and float(x) == 0.0 and s.prim == "rsqrt":
        return s.cause(
            "rsqrt(0) = inf: normalising by a zero variance/norm",
            "add eps inside: jax.lax.rsqrt(var + eps) (LayerNorm/BatchNorm use eps=1e-5/1e-6)",
        )
    return s.cause(
        f"{s.prim} of a negative number is NaN",
        "clamp the argument (jnp.sqrt(jnp.maximum(x, 0.0))); a variance computed as E[x^2] - E[x]^2 "
        "can round below 0: use jnp.var, or clamp",
    )


def _pow(s: _Site) -> Cause | None:
    x = s.vals[0]
    if x is not None and float(x) == 0.0:
        return s.cause("0 raised to a negative power is inf", "add eps to the base or clip it away from 0")
    return s.cause(
        "a negative number raised to a fractional power is NaN",
        "clamp the base to >= 0 (jnp.maximum(x, 0.0) ** p) or use jnp.abs(x) ** p * jnp.sign(x)",
    )


def _arc(s: _Site) -> Cause | None:
    return s.cause(
        f"{s.prim} outside its domain is NaN",
        f"clip the argument into the domain: jnp.{s.prim.replace('a', 'arc', 1)}(jnp.clip(x, -1 + eps, 1 - eps))",
    )


def _div(s: _Site) -> Cause | None:
    """Division by zero: a masked mean over an all-padding row, 0/0 or x/0 (None for other divisions)."""
    a, b = s.vals if len(s.vals) == 2 else (None, None)
    if b is None or float(b) != 0.0:
        return None
    if len(s.node.ins) == 2 and masked_count(s.node.ins[1]):
        return s.cause(
            "a masked mean over an all-padding row: the mask sums to 0, so sum / count = "
            + ("0/0 = NaN" if a is not None and float(a) == 0.0 else "x/0 = inf"),
            "divide by jnp.maximum(count, 1) (keeping the where on the result), and drop "
            "all-padding rows (jaxsane.check_data reports them as data.all_padding)",
        )
    if a is not None and float(a) == 0.0:
        return s.cause(
            "0/0 = NaN",
            "guard the denominator: x / jnp.where(d == 0, 1, d) (mask the result with a second where), or add eps to d",
        )
    return s.cause(
        "x/0 = inf (division by zero)",
        "guard the denominator: x / jnp.where(d == 0, 1, d), or "
        "d + eps with eps > 0; under grad also mask the result with a second where",
    )


def _exp(s: _Site) -> Cause | None:
    dt = s.dt
    limit = float(np.log(float(jnp.finfo(dt).max))) if dt else 88.7
    if "softplus" in s.text or "log(1+" in s.text or "log1p(" in s.text:
        return s.cause(
            f"softplus overflow: exp(x) exceeds the largest {dt} for x > {limit:.1f}, so log(1 + exp(x)) is inf",
            "use jax.nn.softplus(x) or jnp.logaddexp(0.0, x), which are stable for large x",
        )
    return s.cause(
        f"exp overflow: exp(x) exceeds the largest {dt} for x > {limit:.1f}",
        "subtract the max before exponentiating (jax.nn.softmax / jax.nn.logsumexp do), work in log "
        "space, or clip x (jnp.minimum(x, 80.0))",
    )


def _low_precision(s: _Site) -> Cause | None:
    if s.dt not in LOW_PRECISION:
        return None
    big = float(jnp.finfo(s.dt).max)
    return s.cause(
        f"{s.dt} overflow: the result exceeds finfo({s.dt}).max = {big:.6g}",
        "compute this in float32 (x.astype(jnp.float32)) and cast back, use bfloat16 (float32's "
        "range) instead of float16, or use dynamic loss scaling",
    )


def _gather(s: _Site) -> Cause | None:
    ins = s.ins
    if not (len(ins) >= 2 and ins[1].dtype.kind in "iu" and ins[1].size):
        return None
    lo, hi, n = int(ins[1].min()), int(ins[1].max()), max(ins[0].shape, default=0)
    if not (lo < -n or hi >= n):
        return None
    return s.cause(
        f"an out-of-range index: jnp indexing under jit fills out-of-bounds gathers with NaN, and "
        f"the indices run from {lo} to {hi} for an axis of at most {n} (a label outside "
        "[0, num_classes), or an ignore index such as -100 reaching the loss)",
        "mask ignored positions before indexing (labels = jnp.where(valid, labels, 0)) and drop them "
        "from the mean; jaxsane.check_data reports bad labels as data.label_range",
    )


def _cast(s: _Site) -> Cause | None:
    return s.cause(f"casting to {s.dt} overflows", "clip before the cast (jnp.clip(x, finfo.min, finfo.max))")


def _overflow(s: _Site) -> Cause | None:
    """Inf from finite inputs: exploding values."""
    dt = s.dt
    if not (any(o.inf for o in s.node.outs) and all(np.isfinite(a).all() for a in s.ins if a.dtype.kind in "fc")):
        return None
    big = float(jnp.finfo(dt).max) if dt and jnp.issubdtype(dt, jnp.floating) else float("inf")
    return s.cause(
        f"overflow: the result exceeds finfo({dt}).max = {big:.3g} (exploding values: a learning-rate "
        "blow-up or unnormalised activations)",
        "lower the learning rate, clip gradients (optax.clip_by_global_norm), normalise activations, "
        "or compute in log space",
    )


_Rule = Callable[[_Site], "Cause | None"]
# The rules of explain, in the order they are tried: (the primitives a rule is for, None for any; the rule). A rule
# returns None when the values do not fit its bug; the first Cause wins.
_RULES: tuple[tuple[tuple[str, ...] | None, _Rule], ...] = (
    (None, _inf_passed_on),
    (None, _inf_to_nan),
    (("div",), _eps_underflow),
    (("log", "log1p"), _log),
    (("sqrt", "rsqrt", "cbrt"), _sqrt),
    (("pow", "integer_pow"), _pow),
    (("acos", "asin", "atanh", "acosh"), _arc),
    (("div",), _div),
    (("exp", "exp2", "expm1"), _exp),
    (None, _low_precision),
    (("gather",), _gather),
    (("convert_element_type",), _cast),
    (None, _overflow),
)


def explain(analysis, node, *, phase: str, derivative: bool) -> Cause:
    """Name the cause of the non-finite value born at ``node``: the first of :data:`_RULES` for its primitive
    that fits its values, else a generic cause. Host-side only."""
    if derivative:
        return _explain_derivative(analysis, node)
    site = _Site.of(analysis, node, phase)
    for prims, rule in _RULES:
        if prims is None or site.prim in prims:
            cause = rule(site)
            if cause is not None:
                return cause
    return site.cause(
        f"{site.prim} produced NaN/Inf from finite inputs",
        f"keep {site.prim}'s inputs inside its domain (clip them), or compute it in a stable form",
    )


def _explain_derivative(analysis, node) -> Cause:
    primal = primal_eqn(node, backward="transpose(" in node.stack)
    out = value_array(next((o for o in node.outs if o.bad), node.outs[0]))
    idx = first_bad_index(out)
    val = fmt_value(out[idx] if idx else out)
    if primal is not None:
        name = primal.prim
        xs = [
            value_at(value_array(x), idx, out.shape)
            if value_array(x).shape == out.shape or value_array(x).size == 1
            else value_array(x).reshape(-1)[0]
            for x in primal.ins
        ]
        arg = ", ".join(fmt_value(x) for x in xs if x is not None)
        values = f"{name}'({arg}) -> {val}"
    else:
        name = node.prim
        values = f"d{name} -> {val} ({describe(node)})"
    mulnode, where = zero_cotangent(analysis, node)
    if mulnode is node and node.prim == "div":  # ct / x with ct = 0 and x = 0: the derivative 1/x is inf
        values = values.rsplit(" -> ", 1)[0] + " -> inf"
        val = "inf"
    fname = _user_fn(name)
    if mulnode is not None:
        src = (
            f"the {where.prim if where.prim == 'select_n' else 'select_n'} (jnp.where) at {node_loc(where)}"
            if where is not None
            else f"the product at {node_loc(mulnode)}"
        )
        values += f", times a 0 cotangent from {src} -> nan"
        return Cause(
            values,
            f"the derivative of {name} at the edge of its domain is {val}, and the jnp.where that discards "
            f"this branch multiplies it by a 0 cotangent: 0 * {val} = NaN in the backward pass although the "
            "forward value is finite (the double-where trap)",
            _where_fix(name),
            then_text(analysis, node),
        )
    if name in ("sqrt", "rsqrt", "pow", "integer_pow", "cbrt"):
        return Cause(
            values,
            f"the derivative of {name} at 0 is {val}: the gradient of a norm or a standard deviation "
            "(jnp.linalg.norm, jnp.std, a distance) at a zero/constant vector",
            "add eps inside the sqrt (jnp.sqrt(jnp.sum(x**2) + eps), jnp.sqrt(var + eps)) or use the double "
            "where so the gradient at 0 is 0: safe = jnp.where(s > 0, s, 1.0); "
            "jnp.where(s > 0, jnp.sqrt(safe), 0.0)",
            then_text(analysis, node),
        )
    return Cause(
        values,
        f"the derivative of {name} at the edge of its domain is {val} (the backward pass is non-finite "
        "although the forward value is finite)",
        f"keep the argument of {fname} away from the boundary (e.g. jnp.clip(x, -1 + eps, 1 - eps) for "
        "arccos, eps added to a log argument) or use the double where",
        then_text(analysis, node),
    )
