"""Naming the cause of a non-finite value found by :func:`jaxsane.locate`, with a specific fix.

Given the equation where a NaN/Inf is born and the real values around it, :func:`explain` says
what happened in numbers (``sqrt'(0.0) -> inf``, ``div(0.0, 0.0) -> nan``), which classic bug
that is (log of 0, the ``jnp.where`` trap, a masked mean over an all-padding row, ``-inf``
masks, exp/float16 overflow, optimizer eps underflow, ...) and what to change. Host-side only.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

_LOW_PRECISION = ("float16", "bfloat16")
# primitives whose derivative blows up at the edge of their domain
_DERIV_PRIMS = (
    "sqrt",
    "rsqrt",
    "cbrt",
    "log",
    "log1p",
    "pow",
    "acos",
    "asin",
    "atan2",
    "atanh",
    "acosh",
    "div",
    "tan",
    "integer_pow",
    "erf_inv",
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


# ----------------------------------------------------------------------------- value helpers


def _arr(v: Any) -> np.ndarray:
    x = v.value if hasattr(v, "value") and not isinstance(v, np.ndarray) else v
    x = getattr(x, "value", x)  # _Stacked
    return np.asarray(x)


def _fmt(x: Any) -> str:
    try:
        f = float(x)
    except (TypeError, ValueError):
        return str(x)
    if np.isnan(f):
        return "nan"
    if np.isinf(f):
        return "inf" if f > 0 else "-inf"
    if f == int(f) and abs(f) < 1e6:
        return f"{f:.1f}"
    return f"{f:.4g}"


def _first_bad(a: np.ndarray) -> tuple:
    """Index of the first NaN (else the first Inf) of ``a``."""
    if a.ndim == 0:
        return ()
    idx = np.argwhere(np.isnan(a))
    if not len(idx):
        idx = np.argwhere(~np.isfinite(a))
    return tuple(int(i) for i in idx[0]) if len(idx) else tuple(0 for _ in a.shape)


def _at(a: np.ndarray, idx: tuple, shape: tuple) -> Any:
    """``a`` broadcast to ``shape`` at ``idx``; None when it does not broadcast."""
    try:
        return np.broadcast_to(a, shape)[idx]
    except ValueError:
        return None


def _dtype(node) -> str:
    for o in node.outs:
        return str(_arr(o).dtype)
    return ""


def _loc(node) -> str:
    frame = node.frame
    return f"{os.path.basename(frame[0])}:{frame[1]}" if frame else "<unknown location>"


def _in_files(node, parts: tuple) -> bool:
    tb = getattr(node.eqn.source_info, "traceback", None) if node.eqn is not None else None
    if tb is None:
        return False
    return any(any(p in fr.file_name for p in parts) for fr in tb.frames)


def _text(node) -> str:
    from .._core.frames import source_text

    frame = node.frame
    return source_text(*frame) if frame else ""


def describe(node) -> str:
    """``prim(a, b) -> out`` at the first non-finite element (or shapes and ranges for reductions)."""
    if not node.outs:
        return node.prim
    out = _arr(next((o for o in node.outs if o.bad), node.outs[0]))
    idx = _first_bad(out)
    ins = [_arr(x) for x in node.ins]
    vals = [_at(a, idx, out.shape) for a in ins]
    if all(v is not None for v in vals) and all(a.size <= out.size for a in ins):
        text = f"{node.prim}({', '.join(_fmt(v) for v in vals)}) -> {_fmt(out[idx] if idx else out)}"
        if idx:
            text += f" at index {list(idx)}"
    else:
        parts = []
        for a in ins:
            if a.dtype.kind in "fc" and a.size:
                parts.append(f"{a.dtype}{list(a.shape)} max|x|={_fmt(np.nanmax(np.abs(a)))}")
            else:
                parts.append(f"{a.dtype}{list(a.shape)}")
        n_nan, n_inf = int(np.isnan(out).sum()), int(np.isinf(out).sum())
        text = f"{node.prim}({', '.join(parts)}) -> {n_nan} NaN, {n_inf} Inf (first at index {list(idx)})"
    dt = str(out.dtype)
    if dt in _LOW_PRECISION:
        text += f" in {dt}"
    return text


# ----------------------------------------------------------------------------- structural helpers


def _producers(v, depth: int = 6, limit: int = 40) -> list:
    """Nodes that computed ``v`` (breadth first, through any input)."""
    out, frontier, seen = [], [v], set()
    for _ in range(depth):
        nxt = []
        for x in frontier:
            p = getattr(x, "producer", None)
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            out.append(p)
            nxt += list(p.ins)
            if p.inner is not None:
                k = p.outs.index(x) if x in p.outs else -1
                if k >= 0:
                    nxt += p.inner[k]
            if len(out) >= limit:
                return out
        frontier = nxt
    return out


def _is_where(node) -> bool:
    if node.link or node.eqn is None:
        return False
    if node.prim == "select_n":
        return True
    if node.prim in ("pjit", "jit"):
        return node.eqn.params.get("name") in ("_where", "where") or any(
            e.primitive.name == "select_n" for e in node.eqn.params["jaxpr"].jaxpr.eqns
        )
    return False


def primal_eqn(node, backward: bool = False):
    """The forward equation whose derivative ``node`` computes: same line, just before it.

    With ``backward`` the primal may itself be recomputed in the backward pass (remat). Not jit-safe."""
    frame = node.frame
    sibs = node.siblings
    for j in range(node.index - 1, max(-1, node.index - 40), -1):
        if j >= len(sibs):
            continue
        s = sibs[j]
        if s.prim in _DERIV_PRIMS and s.frame == frame and (backward or "transpose(" not in s.stack):
            return s
    for x in node.ins:  # e.g. div(0.5, sqrt(x)): the primal produced an input
        p = getattr(x, "producer", None)
        if p is not None and not p.link and p.prim in _DERIV_PRIMS:
            return p
    return None


def _zero_cotangent(analysis, node):
    """(multiplying node, where node) when a backward product/quotient meets a 0 cotangent from a where.

    The product may be ``node`` itself (``ct / x`` with ``ct = 0`` and ``x = 0`` for log) or a node
    downstream of it (``ct * inf``)."""
    if node.prim in ("mul", "div") and "transpose(" in node.stack and node.outs:
        out = _arr(next((o for o in node.outs if o.bad), node.outs[0]))
        idx = _first_bad(out)
        for x in node.ins:
            v = _at(_arr(x), idx, out.shape)
            if v is not None and float(v) == 0.0:
                where = next((p for p in _producers(x, depth=8) if _is_where(p)), None)
                if where is not None:
                    return node, where
    for c in analysis.downstream(node, limit=48):
        if c == "output" or getattr(c, "link", True) or c.prim not in ("mul", "div", "dot_general"):
            continue
        if "transpose(" not in c.stack:
            continue
        bad = [x for x in c.ins if x.bad]
        good = [x for x in c.ins if not x.bad]
        if not bad or not good:
            continue
        try:
            a, b = np.broadcast_arrays(_arr(bad[0]), _arr(good[0]))
        except ValueError:
            continue
        if np.any(~np.isfinite(a) & (b == 0)):
            where = next((p for p in _producers(good[0], depth=8) if _is_where(p)), None)
            if where is not None:
                return c, where
    return None, None


def _first_nan_after(analysis, node):
    for c in analysis.downstream(node, limit=48):
        if c == "output" or getattr(c, "link", True):
            continue
        if any(o.nan for o in c.outs) and not any(x.nan for x in c.ins):
            return c
    return None


def _masked_count(v) -> bool:
    """True when a denominator counts a 0/1 mask, e.g. ``mask.sum(-1)``."""
    for p in _producers(v, depth=4, limit=8):
        if not p.link and p.prim in ("reduce_sum", "cumsum") and p.ins:
            a = _arr(p.ins[0])
            if a.size and a.dtype.kind in "biuf" and np.isin(a, (0, 1)).all() and (a == 1).any():
                return True
    return False


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


def explain(analysis, node, *, phase: str, derivative: bool) -> Cause:
    """Name the cause of the non-finite value born at ``node``. Host-side only."""
    if derivative:
        return _explain_derivative(analysis, node)
    values = describe(node)
    dt = _dtype(node)
    ins = [_arr(x) for x in node.ins]
    out = _arr(next((o for o in node.outs if o.bad), node.outs[0]))
    idx = _first_bad(out)
    vals = [_at(a, idx, out.shape) for a in ins]
    inf_inputs = any(x.bad for x in node.ins)
    then = _then(analysis, node)
    prim = node.prim
    text = _text(node).replace(" ", "")

    def mk(cause, fix):
        return Cause(values, cause, fix, then)

    if inf_inputs and not any(o.nan for o in node.outs):
        xent = any(
            _in_files(c, (os.path.join("optax", "losses"), os.path.join("jax", "_src", "nn")))
            for c in analysis.downstream(node, limit=64)
            if c != "output" and not getattr(c, "link", True)
        )
        if xent:
            return mk(
                "a -inf mask reaches a cross-entropy/log-softmax: the label (or target mass) sits on a masked "
                "position, so its log-probability is -inf",
                "make sure labels never point at masked positions, and mask with a large finite negative "
                "(jnp.finfo(x.dtype).min) instead of -inf",
            )
        return mk(
            "an infinite constant (e.g. a -inf mask) flows into the outputs unchanged",
            "use a large finite value (jnp.finfo(dtype).min/max) instead of inf, or mask the outputs too",
        )
    if inf_inputs:
        masked = _in_files(node, _SOFTMAX_FILES[:3])
        if prim in ("sub", "add", "mul", "div") and masked:
            return mk(
                "a -inf mask in a softmax/logsumexp/cross-entropy: a fully masked row has max = -inf, "
                "and -inf - (-inf) = NaN",
                "mask with a large finite negative (jnp.finfo(x.dtype).min or -1e9) instead of -inf, or pass "
                "where=mask to jax.nn.softmax; drop rows with no valid position",
            )
        if prim in ("sub", "add"):
            return mk(
                "inf - inf = NaN: both operands are infinite",
                "keep the operands finite: replace the infinite constant by jnp.finfo(dtype).max/min, or "
                "mask the result instead of the operands",
            )
        if prim == "mul":
            return mk(
                "0 * inf = NaN",
                "make the infinite factor finite before multiplying (clip it, or use "
                "jnp.where on the input rather than the output)",
            )
        if prim == "div":
            return mk("inf / inf = NaN", "keep numerator and denominator finite (compute the ratio in log space)")
        return mk(f"{prim} turned an infinite input into NaN", "keep the infinite input out of this computation")

    if (
        dt == "float16"
        and phase == "update"
        and prim == "div"
        and len(node.ins) == 2
        and any(p.prim in ("sqrt", "rsqrt") for p in _producers(node.ins[1], depth=3) if not p.link)
    ):
        return mk(
            "the optimizer's eps underflows in float16: eps=1e-8 rounds to 0 (float16's smallest subnormal "
            "is 6e-8), so m / (sqrt(v) + eps) divides by 0 where the gradient is 0",
            "keep the optimizer state and update in float32 (cast params and grads to float32 before "
            "tx.update, or use optax's mu_dtype=jnp.float32), or raise eps to >= 1e-4 in float16",
        )
    if prim in ("log", "log1p"):
        x = vals[0]
        edge = -1.0 if prim == "log1p" else 0.0
        if x is not None and float(x) == edge:
            return mk(
                f"{prim} of {_fmt(edge)} is -inf",
                "keep the argument positive: jnp.log(jnp.maximum(x, eps)) or jnp.log(x + eps); for "
                "log(softmax(z)) use jax.nn.log_softmax(z), for log(sigmoid(z)) jax.nn.log_sigmoid(z), "
                "for cross-entropy optax.softmax_cross_entropy on logits",
            )
        return mk(
            f"{prim} of a negative number is NaN",
            "the argument went negative: clamp it (jnp.log(jnp.maximum(x, eps))) or fix the computation "
            "that makes it negative",
        )
    if prim in ("sqrt", "rsqrt", "cbrt"):
        x = vals[0]
        if x is not None and float(x) == 0.0 and prim == "rsqrt":
            return mk(
                "rsqrt(0) = inf: normalising by a zero variance/norm",
                "add eps inside: jax.lax.rsqrt(var + eps) (LayerNorm/BatchNorm use eps=1e-5/1e-6)",
            )
        return mk(
            f"{prim} of a negative number is NaN",
            "clamp the argument (jnp.sqrt(jnp.maximum(x, 0.0))); a variance computed as E[x^2] - E[x]^2 "
            "can round below 0: use jnp.var, or clamp",
        )
    if prim in ("pow", "integer_pow"):
        x = vals[0]
        if x is not None and float(x) == 0.0:
            return mk("0 raised to a negative power is inf", "add eps to the base or clip it away from 0")
        return mk(
            "a negative number raised to a fractional power is NaN",
            "clamp the base to >= 0 (jnp.maximum(x, 0.0) ** p) or use jnp.abs(x) ** p * jnp.sign(x)",
        )
    if prim in ("acos", "asin", "atanh", "acosh"):
        return mk(
            f"{prim} outside its domain is NaN",
            f"clip the argument into the domain: jnp.{prim.replace('a', 'arc', 1)}(jnp.clip(x, -1 + eps, 1 - eps))",
        )
    if prim == "div":
        a, b = vals if len(vals) == 2 else (None, None)
        masked = len(node.ins) == 2 and _masked_count(node.ins[1])
        if b is not None and float(b) == 0.0:
            if masked:
                return mk(
                    "a masked mean over an all-padding row: the mask sums to 0, so sum / count = "
                    + ("0/0 = NaN" if a is not None and float(a) == 0.0 else "x/0 = inf"),
                    "divide by jnp.maximum(count, 1) (keeping the where on the result), and drop "
                    "all-padding rows (jaxsane.check_data reports them as data.all_padding)",
                )
            if a is not None and float(a) == 0.0:
                return mk(
                    "0/0 = NaN",
                    "guard the denominator: x / jnp.where(d == 0, 1, d) (mask the result "
                    "with a second where), or add eps to d",
                )
            return mk(
                "x/0 = inf (division by zero)",
                "guard the denominator: x / jnp.where(d == 0, 1, d), or "
                "d + eps with eps > 0; under grad also mask the result with a second where",
            )
    if prim in ("exp", "exp2", "expm1"):
        soft = "softplus" in text or "log(1+" in text or "log1p(" in text
        limit = float(np.log(float(jnp.finfo(dt).max))) if dt else 88.7
        if soft:
            return mk(
                f"softplus overflow: exp(x) exceeds the largest {dt} for x > {limit:.1f}, so log(1 + exp(x)) is inf",
                "use jax.nn.softplus(x) or jnp.logaddexp(0.0, x), which are stable for large x",
            )
        return mk(
            f"exp overflow: exp(x) exceeds the largest {dt} for x > {limit:.1f}",
            "subtract the max before exponentiating (jax.nn.softmax / jax.nn.logsumexp do), work in log "
            "space, or clip x (jnp.minimum(x, 80.0))",
        )
    if dt in _LOW_PRECISION:
        big = float(jnp.finfo(dt).max)
        return mk(
            f"{dt} overflow: the result exceeds finfo({dt}).max = {big:.6g}",
            "compute this in float32 (x.astype(jnp.float32)) and cast back, use bfloat16 (float32's "
            "range) instead of float16, or use dynamic loss scaling",
        )
    if prim == "gather" and len(ins) >= 2 and ins[1].dtype.kind in "iu" and ins[1].size:
        lo, hi, n = int(ins[1].min()), int(ins[1].max()), max(ins[0].shape, default=0)
        if lo < -n or hi >= n:
            return mk(
                f"an out-of-range index: jnp indexing under jit fills out-of-bounds gathers with NaN, and "
                f"the indices run from {lo} to {hi} for an axis of at most {n} (a label outside "
                "[0, num_classes), or an ignore index such as -100 reaching the loss)",
                "mask ignored positions before indexing (labels = jnp.where(valid, labels, 0)) and drop them "
                "from the mean; jaxsane.check_data reports bad labels as data.label_range",
            )
    if prim == "convert_element_type":
        return mk(f"casting to {dt} overflows", "clip before the cast (jnp.clip(x, finfo.min, finfo.max))")
    if any(o.inf for o in node.outs) and all(np.isfinite(a).all() for a in ins if a.dtype.kind in "fc"):
        big = float(jnp.finfo(dt).max) if dt and jnp.issubdtype(dt, jnp.floating) else float("inf")
        return mk(
            f"overflow: the result exceeds finfo({dt}).max = {big:.3g} (exploding values: a learning-rate "
            "blow-up or unnormalised activations)",
            "lower the learning rate, clip gradients (optax.clip_by_global_norm), normalise activations, "
            "or compute in log space",
        )
    return mk(
        f"{prim} produced NaN/Inf from finite inputs",
        f"keep {prim}'s inputs inside its domain (clip them), or compute it in a stable form",
    )


def _then(analysis, node) -> str:
    if any(o.nan for o in node.outs):
        return ""
    c = _first_nan_after(analysis, node)
    if c is None:
        return ""
    return f"{describe(c)} in {c.phase} at {_loc(c)}"


def _explain_derivative(analysis, node) -> Cause:
    primal = primal_eqn(node, backward="transpose(" in node.stack)
    out = _arr(next((o for o in node.outs if o.bad), node.outs[0]))
    idx = _first_bad(out)
    val = _fmt(out[idx] if idx else out)
    if primal is not None:
        name = primal.prim
        xs = [
            _at(_arr(x), idx, out.shape) if _arr(x).shape == out.shape or _arr(x).size == 1 else _arr(x).reshape(-1)[0]
            for x in primal.ins
        ]
        arg = ", ".join(_fmt(x) for x in xs if x is not None)
        values = f"{name}'({arg}) -> {val}"
    else:
        name = node.prim
        values = f"d{name} -> {val} ({describe(node)})"
    mulnode, where = _zero_cotangent(analysis, node)
    if mulnode is node and node.prim == "div":  # ct / x with ct = 0 and x = 0: the derivative 1/x is inf
        values = values.rsplit(" -> ", 1)[0] + " -> inf"
        val = "inf"
    fname = _user_fn(name)
    if mulnode is not None:
        src = (
            f"the {where.prim if where.prim == 'select_n' else 'select_n'} (jnp.where) at {_loc(where)}"
            if where is not None
            else f"the product at {_loc(mulnode)}"
        )
        values += f", times a 0 cotangent from {src} -> nan"
        return Cause(
            values,
            f"the derivative of {name} at the edge of its domain is {val}, and the jnp.where that discards "
            f"this branch multiplies it by a 0 cotangent: 0 * {val} = NaN in the backward pass although the "
            "forward value is finite (the double-where trap)",
            _where_fix(name),
            _then(analysis, node),
        )
    if name in ("sqrt", "rsqrt", "pow", "integer_pow", "cbrt"):
        return Cause(
            values,
            f"the derivative of {name} at 0 is {val}: the gradient of a norm or a standard deviation "
            "(jnp.linalg.norm, jnp.std, a distance) at a zero/constant vector",
            "add eps inside the sqrt (jnp.sqrt(jnp.sum(x**2) + eps), jnp.sqrt(var + eps)) or use the double "
            "where so the gradient at 0 is 0: safe = jnp.where(s > 0, s, 1.0); "
            "jnp.where(s > 0, jnp.sqrt(safe), 0.0)",
            _then(analysis, node),
        )
    return Cause(
        values,
        f"the derivative of {name} at the edge of its domain is {val} (the backward pass is non-finite "
        "although the forward value is finite)",
        f"keep the argument of {fname} away from the boundary (e.g. jnp.clip(x, -1 + eps, 1 - eps) for "
        "arccos, eps added to a log argument) or use the double where",
        _then(analysis, node),
    )
