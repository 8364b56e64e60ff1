"""Frames: the user's own ``file:line`` behind a jaxpr equation, and its source text.

Tracebacks are walked from the innermost frame outwards, skipping jax, jaxlib, flax, optax,
chex, numpy, jaxsane itself (not its examples) and the stdlib. Host-side only, not jit-safe.
"""
from __future__ import annotations

import inspect
import linecache
import os

_SKIP_PACKAGES = ("jax", "jaxlib", "flax", "optax", "chex", "jaxsane", "numpy")
_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_STDLIB = os.path.dirname(os.path.abspath(inspect.__file__))


def _is_library_file(path: str) -> bool:
    """True for frames inside jax, flax, optax, chex, jaxsane itself (not its examples) or the stdlib."""
    p = os.path.abspath(path)
    if p.startswith(_PKG_DIR + os.sep):
        return not p.startswith(os.path.join(_PKG_DIR, "examples") + os.sep)
    if p.startswith(_STDLIB + os.sep) and "site-packages" not in p:
        return True
    parts = p.replace("\\", "/").split("/")
    if "site-packages" in parts or "dist-packages" in parts:
        i = max(i for i, x in enumerate(parts) if x in ("site-packages", "dist-packages"))
        return i + 1 < len(parts) and parts[i + 1].split(".")[0] in _SKIP_PACKAGES
    return path.startswith("<frozen")


def _frames(eqn) -> list:
    tb = getattr(eqn.source_info, "traceback", None)
    return list(tb.frames) if tb is not None else []


def user_frame(eqn) -> tuple[str, int] | None:
    """The innermost ``(file, line)`` of ``eqn``'s traceback outside jax/flax/optax/chex/jaxsane."""
    for fr in _frames(eqn):
        if not _is_library_file(fr.file_name):
            return fr.file_name, fr.line_num
    return None


def _in_optax(eqn) -> bool:
    for fr in _frames(eqn):
        if not _is_library_file(fr.file_name):
            return False
        if f"{os.sep}optax{os.sep}" in fr.file_name:
            return True
    return False


def source_text(file: str | None, line: int | None) -> str:
    if not file or not line:
        return ""
    return linecache.getline(file, line).strip()
