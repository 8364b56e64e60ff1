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


def _unsigned(x: np.ndarray) -> np.ndarray:
    """``x``'s bits as the unsigned integers of its width (a view, no copy)."""
    return x.view(np.dtype(f"uint{8 * x.dtype.itemsize}"))


def _np_shift(x, y, *, left: bool, logical: bool = True):
    """XLA's shifts: a shift by the width or more gives 0 (or the sign, arithmetic right), never wraps."""
    bits = 8 * x.dtype.itemsize
    y = np.asarray(y).astype(np.int64)
    big = (y < 0) | (y >= bits)
    amount = np.where(big, 0, y).astype(_unsigned(x).dtype)
    if left:
        return np.where(big, 0, _unsigned(x) << amount).astype(_unsigned(x).dtype).view(x.dtype)
    if logical:
        return np.where(big, 0, _unsigned(x) >> amount).astype(_unsigned(x).dtype).view(x.dtype)
    signed = x.view(np.dtype(f"int{bits}"))  # arithmetic: the sign bit fills, as far as the whole width
    return (signed >> np.where(big, bits - 1, y).astype(signed.dtype)).view(x.dtype)


def _np_bitcast(x, *, new_dtype, **_):
    if np.dtype(new_dtype).itemsize != x.dtype.itemsize:
        raise ValueError("a bitcast that changes the width changes the shape")  # the replay binds it
    return np.ascontiguousarray(x).view(new_dtype)


def _np_iota(*, dtype, shape, dimension, **_):
    index = np.arange(shape[dimension], dtype=dtype).reshape([-1 if d == dimension else 1 for d in range(len(shape))])
    return np.broadcast_to(index, shape)


def _np_iota_2x32(*, shape, **_):
    counts = np.arange(int(np.prod(shape)), dtype=np.uint64).reshape(shape)
    return [(counts >> np.uint64(32)).astype(np.uint32), counts.astype(np.uint32)]


_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def np_threefry2x32(k1, k2, x1, x2, **_):
    """The Threefry-2x32 hash (20 rounds) as jax's lowering computes it, bit for bit, with numpy."""
    k1, k2, x1, x2 = np.broadcast_arrays(*(np.asarray(a, np.uint32) for a in (k1, k2, x1, x2)))
    ks = (k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA))
    x0, x1 = x1 + ks[0], x2 + ks[1]
    with np.errstate(over="ignore"):
        for i in range(5):
            for r in _THREEFRY_ROTATIONS[i % 2]:
                x0 = x0 + x1
                x1 = (x1 << np.uint32(r)) | (x1 >> np.uint32(32 - r))
                x1 = x0 ^ x1
            x0 = x0 + ks[(i + 1) % 3]
            x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return [x0, x1]


def np_threefry_fold_in(key_data: np.ndarray, data: np.ndarray) -> np.ndarray:
    """``jax.random.fold_in``'s new key data for one threefry key and one integer, as jax computes it."""
    seed = np.asarray(data).astype(np.uint32).reshape(1)  # threefry_seed of a 32-bit integer: (0, data)
    hi, lo = np_threefry2x32(key_data[0], key_data[1], np.zeros(1, np.uint32), seed)
    return np.concatenate([hi, lo])


def np_random_bits(key_data: np.ndarray, *, bit_width: int, shape: tuple) -> np.ndarray:
    """``jax.random.bits`` of one threefry key (its ``key_data``) as jax's partitionable threefry draws them."""
    counts_hi, counts_lo = _np_iota_2x32(shape=tuple(shape)) if len(shape) else (np.uint32(0), np.uint32(0))
    hi, lo = np_threefry2x32(key_data[0], key_data[1], counts_hi, counts_lo)
    dtype = np.dtype(f"uint{bit_width}")
    if bit_width == 64:
        return (hi.astype(np.uint64) << np.uint64(32)) | lo.astype(np.uint64)
    return (hi ^ lo).astype(dtype)


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
    "shift_left": lambda x, y, **_: _np_shift(x, y, left=True),
    "shift_right_logical": lambda x, y, **_: _np_shift(x, y, left=False),
    "shift_right_arithmetic": lambda x, y, **_: _np_shift(x, y, left=False, logical=False),
    "bitcast_convert_type": _np_bitcast,
    "iota": _np_iota,
    "iota_2x32_shape": _np_iota_2x32,
    "threefry2x32": np_threefry2x32,
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
