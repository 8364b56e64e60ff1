"""Whether a batch is of the same kind as a reference batch of the same program (the first train batch): the
same structure, and per leaf the same rank and dtype kind beyond the batch axis, or at least shapes the
program can trace. Used before the first step, so a mismatch is named instead of failing deep inside
``jnp.matmul`` (fit's eval batches, ``check_step(batch=...)``). Host-side, not jit-safe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def layout(batch: Any) -> list[tuple[str, tuple, str]]:
    """``(path, shape beyond the batch axis, dtype)`` of each leaf of a batch."""
    out = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        dtype = getattr(leaf, "dtype", None)
        out.append(
            (
                jax.tree_util.keystr(path) or "<root>",
                tuple(np.shape(leaf))[1:],
                str(dtype) if dtype is not None else type(leaf).__name__,
            )
        )
    return out


def show(leaves: list[tuple[str, tuple, str]]) -> str:
    """``['x'] [4] float32, ['y'] [] int32``: a batch's leaves as a message shows them."""
    return ", ".join(f"{p} {list(shape)} {dtype}" for p, shape, dtype in leaves)


def _kind(dtype: str) -> str:
    try:
        return np.dtype(dtype).kind
    except TypeError:  # jax's own dtypes (PRNG keys) and Python scalar type names
        return dtype


def batch_mismatch(reference: Any, batch: Any, what: str, trace: Callable[[Any], Any] | None = None) -> tuple:
    """``(problem, cause)``: what makes ``batch`` another kind of batch than ``reference``, or ``(None, None)``.

    A leaf of another rank or dtype kind beyond the batch axis is a problem as it is (a model fitted to one
    silently broadcasts, or computes on unscaled integers, on the other). Another structure (keys) or another
    per-example size is one only when ``trace(batch)`` (an ``eval_shape`` of the program that reads it) fails;
    ``cause`` is then that exception. Without ``trace`` any difference is a problem. Not jit-safe.
    """
    a, b = layout(reference), layout(batch)
    ref = f"the {what} batch's"
    if [p for p, _, _ in a] == [p for p, _, _ in b]:
        for (p, sa, da), (_, sb, db) in zip(a, b):
            if len(sa) != len(sb) or _kind(da) != _kind(db):
                shapes = f"per-example shape {list(sb)} and dtype {db} but {ref} {p} has {list(sa)} and {da}"
                return f"its leaf {p} has {shapes}", None
        differ = [(p, sa, da, sb, db) for (p, sa, da), (_, sb, db) in zip(a, b) if (sa, da) != (sb, db)]
        if not differ:
            return None, None
        p, sa, da, sb, db = differ[0]
        problem = f"its leaf {p} has per-example shape {list(sb)} {db} but {ref} {p} has {list(sa)} {da}"
    else:
        problem = f"its leaves are [{show(b)}] but {ref} are [{show(a)}]"
    if trace is None:
        return problem, None
    try:
        trace(batch)
    except Exception as e:  # the user's program on this batch: the shapes say why
        return problem, e
    return None, None


def cause_text(cause: BaseException | None) -> str:
    """`` (TypeError: first line of the message)`` for a message, or ``""``."""
    if cause is None:
        return ""
    lines = str(cause).splitlines()
    return f" ({type(cause).__name__}: {(lines[0] if lines else '')[:200]})"
