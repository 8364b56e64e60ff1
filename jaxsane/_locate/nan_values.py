"""Reading the values around the equation where a NaN/Inf is born, for :mod:`nan_causes`: the values at the
first non-finite element in numbers (:func:`describe`), where an equation sits in the user's code, and the
structure around it (the equations that produced a value, the forward equation a derivative belongs to, the
``jnp.where`` whose 0 cotangent meets an infinite derivative). Host-side only, not jit-safe.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .replay import host_array, is_key

LOW_PRECISION = ("float16", "bfloat16")
# primitives whose derivative blows up at the edge of their domain
DERIV_PRIMS = (
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


# ----------------------------------------------------------------------------- value helpers


def value_array(v: Any) -> np.ndarray:
    """The concrete value of an analysis value (or of a plain array) as a numpy array (a typed PRNG key
    array: its key bits)."""
    return host_array(_unwrapped(v))


def _unwrapped(v: Any) -> Any:
    x = v.value if hasattr(v, "value") and not isinstance(v, np.ndarray) else v
    return getattr(x, "value", x)  # _Stacked


def fmt_value(x: Any) -> str:
    """A scalar for a message: ``nan``, ``inf``, ``1.0``, ``0.001234``; anything else as ``str``."""
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


def first_bad_index(a: np.ndarray) -> tuple:
    """Index of the first NaN (else the first Inf) of ``a``."""
    if a.ndim == 0:
        return ()
    idx = np.argwhere(np.isnan(a))
    if not len(idx):
        idx = np.argwhere(~np.isfinite(a))
    return tuple(int(i) for i in idx[0]) if len(idx) else tuple(0 for _ in a.shape)


def value_at(a: np.ndarray, idx: tuple, shape: tuple) -> Any:
    """``a`` broadcast to ``shape`` at ``idx``; None when it does not broadcast."""
    try:
        return np.broadcast_to(a, shape)[idx]
    except ValueError:
        return None


def out_dtype(node) -> str:
    """The dtype of ``node``'s first output ("" without outputs)."""
    for o in node.outs:
        return str(value_array(o).dtype)
    return ""


def node_loc(node) -> str:
    """``file.py:line`` of ``node`` in the user's code."""
    frame = node.frame
    return f"{os.path.basename(frame[0])}:{frame[1]}" if frame else "<unknown location>"


def in_files(node, parts: tuple) -> bool:
    """Whether ``node``'s traceback passes through a file whose path contains one of ``parts``."""
    tb = getattr(node.eqn.source_info, "traceback", None) if node.eqn is not None else None
    if tb is None:
        return False
    return any(any(p in fr.file_name for p in parts) for fr in tb.frames)


def node_source(node) -> str:
    """The source line of ``node`` ("" when unknown)."""
    from .._core.frames import source_text

    frame = node.frame
    return source_text(*frame) if frame else ""


def describe(node) -> str:
    """``prim(a, b) -> out`` at the first non-finite element (or shapes and ranges for reductions)."""
    if not node.outs:
        return node.prim
    out = value_array(next((o for o in node.outs if o.bad), node.outs[0]))
    idx = first_bad_index(out)
    keys = [_unwrapped(x) if is_key(_unwrapped(x)) else None for x in node.ins]  # typed PRNG keys: named, no value
    ins = [value_array(x) for x in node.ins]
    vals = [value_at(a, idx, out.shape) if k is None else _key_text(k) for a, k in zip(ins, keys)]
    if all(v is not None for v in vals) and all(a.size <= out.size or k is not None for a, k in zip(ins, keys)):
        text = f"{node.prim}({', '.join(fmt_value(v) for v in vals)}) -> {fmt_value(out[idx] if idx else out)}"
        if idx:
            text += f" at index {list(idx)}"
    else:
        parts = []
        for a, k in zip(ins, keys):
            if k is not None:
                parts.append(_key_text(k))
            elif a.dtype.kind in "fc" and (~np.isnan(a)).any():  # (an all-NaN operand has no max)
                parts.append(f"{a.dtype}{list(a.shape)} max|x|={fmt_value(np.abs(a[~np.isnan(a)]).max())}")
            else:
                parts.append(f"{a.dtype}{list(a.shape)}")
        n_nan, n_inf = int(np.isnan(out).sum()), int(np.isinf(out).sum())
        text = f"{node.prim}({', '.join(parts)}) -> {n_nan} NaN, {n_inf} Inf (first at index {list(idx)})"
    dt = str(out.dtype)
    if dt in LOW_PRECISION:
        text += f" in {dt}"
    return text


def _key_text(key: Any) -> str:
    """A typed PRNG key operand in a message: ``key<fry>[2, 4]``."""
    return f"{key.dtype}{list(key.shape)}"


# ----------------------------------------------------------------------------- structural helpers


def producers(v, depth: int = 6, limit: int = 40) -> list:
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


def is_where(node) -> bool:
    """Whether ``node`` is a ``jnp.where`` (a ``select_n``, or a ``where`` jit holding one)."""
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
        if s.prim in DERIV_PRIMS and s.frame == frame and (backward or "transpose(" not in s.stack):
            return s
    for x in node.ins:  # e.g. div(0.5, sqrt(x)): the primal produced an input
        p = getattr(x, "producer", None)
        if p is not None and not p.link and p.prim in DERIV_PRIMS:
            return p
    return None


def zero_cotangent(analysis, node):
    """(multiplying node, where node) when a backward product/quotient meets a 0 cotangent from a where.

    The product may be ``node`` itself (``ct / x`` with ``ct = 0`` and ``x = 0`` for log) or a node
    downstream of it (``ct * inf``)."""
    if node.prim in ("mul", "div") and "transpose(" in node.stack and node.outs:
        out = value_array(next((o for o in node.outs if o.bad), node.outs[0]))
        idx = first_bad_index(out)
        for x in node.ins:
            v = value_at(value_array(x), idx, out.shape)
            if v is not None and float(v) == 0.0:
                where = next((p for p in producers(x, depth=8) if is_where(p)), None)
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
            a, b = np.broadcast_arrays(value_array(bad[0]), value_array(good[0]))
        except ValueError:
            continue
        if np.any(~np.isfinite(a) & (b == 0)):
            where = next((p for p in producers(good[0], depth=8) if is_where(p)), None)
            if where is not None:
                return c, where
    return None, None


def first_nan_after(analysis, node):
    """The first equation downstream of ``node`` that makes a NaN from NaN-free inputs, or None."""
    for c in analysis.downstream(node, limit=48):
        if c == "output" or getattr(c, "link", True):
            continue
        if any(o.nan for o in c.outs) and not any(x.nan for x in c.ins):
            return c
    return None


def masked_count(v) -> bool:
    """True when a denominator counts a 0/1 mask, e.g. ``mask.sum(-1)``."""
    for p in producers(v, depth=4, limit=8):
        if not p.link and p.prim in ("reduce_sum", "cumsum") and p.ins:
            a = value_array(p.ins[0])
            if a.size and a.dtype.kind in "biuf" and np.isin(a, (0, 1)).all() and (a == 1).any():
                return True
    return False


def then_text(analysis, node) -> str:
    """What the Inf born at ``node`` turned into downstream (the first NaN after it), or ""."""
    if any(o.nan for o in node.outs):
        return ""
    c = first_nan_after(analysis, node)
    if c is None:
        return ""
    return f"{describe(c)} in {c.phase} at {node_loc(c)}"
