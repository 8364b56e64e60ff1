"""Frames: the user's own ``file:line`` behind a jaxpr equation, and its source text.

Tracebacks are walked from the innermost frame outwards, skipping jax, jaxlib, flax, optax,
chex, numpy, jaxsane itself (not its examples) and the stdlib. Host-side only, not jit-safe.
"""
from __future__ import annotations

import inspect
import linecache
import os
import re
import sys

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


_IPYKERNEL_CELL = re.compile(r"ipykernel_\d+[/\\]\d+\.py$")       # ipykernel >= 6: /tmp/ipykernel_PID/HASH.py
_IPYTHON_INPUT = re.compile(r"^<ipython-input-(\d+)-[0-9a-f]+>$")     # older IPython: <ipython-input-N-HASH>


def cell_number(file: str) -> int | None:
    """The execution count of the notebook/IPython cell compiled to ``file``, or None.

    ipykernel names each cell's code after a hash of it (``/tmp/ipykernel_1234/667549009.py``);
    IPython's compiler records which execution count each such name was compiled for
    (``get_ipython().compile._filename_map``). Older IPython put the count in the name itself.
    Host-side only; never imports IPython (only reads it when the session already has it).
    """
    m = _IPYTHON_INPUT.match(file)
    if m:
        return int(m.group(1))
    if not _IPYKERNEL_CELL.search(file):
        return None
    ipython = sys.modules.get("IPython")
    try:
        shell = ipython.get_ipython() if ipython is not None else None
        number = getattr(getattr(shell, "compile", None), "_filename_map", {}).get(file)
    except Exception:  # noqa: BLE001 - naming a cell is best effort
        return None
    return number if isinstance(number, int) else None


def display_location(file: str | None, line: int | None) -> str:
    """``file:line`` as a user reads it: ``<cell 3>, line 6`` for a notebook cell (``<cell>, line 6``
    when its execution count is unknown), else the file's base name and the line."""
    if not file:
        return "<unknown location>"
    if _IPYTHON_INPUT.match(file) or _IPYKERNEL_CELL.search(file):
        n = cell_number(file)
        return f"<cell {n}>, line {line}" if n is not None else f"<cell>, line {line}"
    return f"{os.path.basename(file)}:{line}"
