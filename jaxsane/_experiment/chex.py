"""chex, read without importing it: what a ``chex.chexify``-ed function is, which chex assertion an error
reports, and chex's assertions switched off for a replay.

chex's value assertions (``chex.assert_tree_all_finite``) need concrete values, or chexify's
functionalisation under jit; jaxsane's replays (:func:`jaxsane.locate`) trace the step without it, so they
run with chex's assertions off (``chex.disable_asserts``, public) and on the function under a chexify
layer. Nothing here imports chex: a program that uses it has imported it already. Not jit-relevant.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable
from typing import Any, cast

from .purify import unwrap

FINITE_ASSERTIONS = ("assert_tree_all_finite",)  # chex value assertions that are about NaN/Inf
_CHEX_FAILED = re.compile(r"\[Chex\] chexify assertion '([A-Za-z_][A-Za-z0-9_]*)' failed")


def is_chexified(fn: Any) -> bool:
    """True for a function returned by ``chex.chexify`` (chex's wrapper, with ``wait_checks``). Not jit-relevant."""
    code = getattr(fn, "__code__", None)
    return (
        callable(getattr(fn, "wait_checks", None))
        and callable(getattr(fn, "__wrapped__", None))
        and code is not None
        and code.co_name == "_chexified_fn"
        and os.path.basename(code.co_filename).startswith("asserts_chexify")
    )


def failed_assertion(exc: BaseException) -> str | None:
    """The name of the chex value assertion an exception reports (``assert_tree_all_finite``), or None."""
    if not isinstance(exc, AssertionError):
        return None
    match = _CHEX_FAILED.search(str(exc))
    return match[1] if match else None


@contextlib.contextmanager
def chex_asserts_off():
    """chex's assertions switched off (``chex.disable_asserts``) for a replay, and back on after, unless they
    were off already."""
    chex = sys.modules.get("chex")
    internal = sys.modules.get("chex._src.asserts_internal")
    if chex is None:
        yield
        return
    was_off = bool(getattr(internal, "DISABLE_ASSERTIONS", False))
    chex.disable_asserts()
    try:
        yield
    finally:
        if not was_off:
            chex.enable_asserts()


def locate_target(step: Callable) -> Callable:
    """The function locate replays for ``step``: for a chexified step, the Python function under chexify and
    its jits (a jit's cached trace would still hold chex's checks, which only chexify can run)."""
    return unwrap(cast(Any, step).__wrapped__) if is_chexified(step) else step  # chexify sets __wrapped__


__all__ = ["FINITE_ASSERTIONS", "chex_asserts_off", "failed_assertion", "is_chexified", "locate_target"]
