"""The host replay of the common primitives for locate's replay (``replay.py``): elementwise math,
reductions, ``dot_general``, shape ops and ``select_n`` with numpy, with no compilation and the values
XLA's kernels give up to rounding. ``NP`` maps a primitive name to its numpy function; those in
``NP_UFUNCS`` are called without the equation's params.

Not jit-safe: host-side only, off the hot path.
"""

from __future__ import annotations

import numpy as np


def _np_dot_general(x, y, *, dimension_numbers, preferred_element_type=None, **_):
    (lc, rc), (lb, rb) = dimension_numbers
    letters = iter("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    xs, ys = [None] * x.ndim, [None] * y.ndim
    for i, j in zip(lb, rb):
        xs[i] = ys[j] = next(letters)
    for i, j in zip(lc, rc):
        xs[i] = ys[j] = next(letters)
    for i in range(x.ndim):
        xs[i] = xs[i] or next(letters)
    for j in range(y.ndim):
        ys[j] = ys[j] or next(letters)
    out = (
        [xs[i] for i in lb]
        + [xs[i] for i in range(x.ndim) if i not in lb and i not in lc]
        + [ys[j] for j in range(y.ndim) if j not in rb and j not in rc]
    )
    dt = np.dtype(preferred_element_type) if preferred_element_type is not None else np.result_type(x, y)
    if dt.kind == "f" and dt.itemsize < 4:  # XLA's CPU dots accumulate float16/bfloat16 in float32
        x, y = x.astype(np.float32), y.astype(np.float32)
    return np.einsum(f"{''.join(xs)},{''.join(ys)}->{''.join(out)}", x, y, optimize=True)


def _np_broadcast(x, *, shape, broadcast_dimensions, **_):
    expanded = [1] * len(shape)
    for i, d in enumerate(broadcast_dimensions):
        expanded[d] = x.shape[i]
    return np.broadcast_to(x.reshape(expanded), shape)


def _np_select(pred, *cases):
    if pred.dtype == np.bool_:
        return np.where(pred, cases[1], cases[0]) if len(cases) == 2 else np.choose(pred.astype(int), cases)
    return np.choose(pred.astype(int), np.broadcast_arrays(*cases))


def _np_slice(x, *, start_indices, limit_indices, strides=None, **_):
    strides = strides or (1,) * x.ndim
    return x[tuple(slice(a, b, c) for a, b, c in zip(start_indices, limit_indices, strides))]


def _reduce(fn):
    return lambda x, *, axes, **_: fn(x, axis=tuple(axes))


NP = {
    "neg": np.negative,
    "sign": np.sign,
    "floor": np.floor,
    "ceil": np.ceil,
    "is_finite": np.isfinite,
    "exp": np.exp,
    "exp2": np.exp2,
    "log": np.log,
    "log1p": np.log1p,
    "expm1": np.expm1,
    "tanh": np.tanh,
    "logistic": lambda x, **_: 1 / (1 + np.exp(-x)),
    "sin": np.sin,
    "cos": np.cos,
    "tan": np.tan,
    "asin": np.arcsin,
    "acos": np.arccos,
    "atan": np.arctan,
    "sinh": np.sinh,
    "cosh": np.cosh,
    "asinh": np.arcsinh,
    "acosh": np.arccosh,
    "atanh": np.arctanh,
    "sqrt": np.sqrt,
    "rsqrt": lambda x, **_: 1 / np.sqrt(x),
    "cbrt": np.cbrt,
    "abs": np.abs,
    "not": np.invert,
    "square": np.square,
    "add": np.add,
    "add_any": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": lambda x, y, **_: np.trunc(x / y).astype(x.dtype) if x.dtype.kind in "iu" else np.divide(x, y),
    "rem": np.fmod,
    "pow": np.power,
    "max": np.maximum,
    "min": np.minimum,
    "atan2": np.arctan2,
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "xor": np.bitwise_xor,
    "integer_pow": lambda x, *, y, **_: x**y if y >= 0 else 1 / (x**-y),
    "select_n": _np_select,
    "convert_element_type": lambda x, *, new_dtype, **_: x.astype(new_dtype),
    "broadcast_in_dim": _np_broadcast,
    "reshape": lambda x, *, new_sizes, **_: x.reshape(new_sizes),
    "squeeze": lambda x, *, dimensions, **_: np.squeeze(x, axis=tuple(dimensions)),
    "expand_dims": lambda x, *, dimensions, **_: np.expand_dims(x, tuple(dimensions)),
    "transpose": lambda x, *, permutation, **_: np.transpose(x, permutation),
    "reduce_sum": _reduce(np.sum),
    "reduce_max": _reduce(np.max),
    "reduce_min": _reduce(np.min),
    "reduce_prod": _reduce(np.prod),
    "reduce_and": _reduce(np.all),
    "reduce_or": _reduce(np.any),
    "dot_general": _np_dot_general,
    "concatenate": lambda *xs, dimension, **_: np.concatenate(xs, dimension),
    "slice": _np_slice,
    "copy": lambda x, **_: x,
    "copy_p": lambda x, **_: x,
    "clamp": lambda lo, x, hi, **_: np.minimum(np.maximum(x, lo), hi),
    "stop_gradient": lambda x, **_: x,
}
NP_UFUNCS = {
    "neg",
    "sign",
    "floor",
    "ceil",
    "is_finite",
    "exp",
    "exp2",
    "log",
    "log1p",
    "expm1",
    "tanh",
    "sin",
    "cos",
    "tan",
    "asin",
    "acos",
    "atan",
    "sinh",
    "cosh",
    "asinh",
    "acosh",
    "atanh",
    "sqrt",
    "cbrt",
    "abs",
    "not",
    "square",
    "add",
    "add_any",
    "sub",
    "mul",
    "rem",
    "pow",
    "max",
    "min",
    "atan2",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "and",
    "or",
    "xor",
    "select_n",
}  # ufuncs: called without params
