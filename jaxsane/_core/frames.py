"""Frames: the one "is this library code" predicate, the user's ``file:line`` behind a jaxpr
equation, its source text, and the user's call chain behind it (for the debugger at an origin).

Library code is jax, jaxlib, flax, optax, chex, equinox, orbax, numpy, jaxsane itself (not its
examples) and the Python stdlib. Everything else is the user's, including a user's own package
installed in site-packages. Tracebacks are walked from the innermost frame outwards, skipping
library frames. Host-side only, not jit-safe.
"""

from __future__ import annotations

import inspect
import linecache
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

LIBRARY_PACKAGES = ("jax", "jaxlib", "flax", "optax", "chex", "equinox", "orbax", "numpy", "jaxsane")
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # jaxsane/, above _core/
_EXAMPLES_DIR = os.path.join(_PKG_DIR, "examples")
_STDLIB = os.path.dirname(os.path.abspath(inspect.__file__))
_LIBRARY_ROOTS: tuple[str, ...] = ()


def _library_roots() -> tuple[str, ...]:
    """The directories of the library packages that are importable here (found once)."""
    global _LIBRARY_ROOTS
    if not _LIBRARY_ROOTS:
        import importlib.util

        roots = []
        for name in LIBRARY_PACKAGES:
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                spec = None
            for loc in (spec.submodule_search_locations or []) if spec is not None else []:
                roots.append(os.path.abspath(loc))
        _LIBRARY_ROOTS = tuple(roots) or ("\0",)
    return _LIBRARY_ROOTS


def is_library_file(path: str) -> bool:
    """True for a file of jax, jaxlib, flax, optax, chex, equinox, orbax, numpy, jaxsane (not its
    examples) or the stdlib; False for the user's code, wherever it is installed.

    Example:
      >>> import jax, os
      >>> is_library_file(jax.__file__), is_library_file(os.path.join(os.getcwd(), "train.py"))
      (True, False)
    """
    if not path:
        return False
    if path.startswith("<frozen"):
        return True
    if path.startswith("<"):  # <stdin>, <string>, notebooks: the user's
        return False
    p = os.path.abspath(path)
    if p.startswith(_PKG_DIR + os.sep):
        return not p.startswith(_EXAMPLES_DIR + os.sep)
    parts = p.replace("\\", "/").split("/")
    if "site-packages" in parts or "dist-packages" in parts:
        i = max(i for i, x in enumerate(parts) if x in ("site-packages", "dist-packages"))
        return i + 1 < len(parts) and parts[i + 1].split(".")[0] in LIBRARY_PACKAGES
    if p.startswith(_STDLIB + os.sep):
        return True
    return any(p.startswith(root + os.sep) for root in _library_roots())


def frames_of(eqn) -> list:
    tb = getattr(eqn.source_info, "traceback", None)
    return list(tb.frames) if tb is not None else []


def user_frame(eqn) -> tuple[str, int] | None:
    """The innermost ``(file, line)`` of ``eqn``'s traceback outside library code (see :func:`is_library_file`)."""
    for fr in frames_of(eqn):
        if not is_library_file(fr.file_name):
            return fr.file_name, fr.line_num
    return None


def _is_jaxsane_file(path: str) -> bool:
    p = os.path.abspath(path) if path and not path.startswith("<") else ""
    return p.startswith(_PKG_DIR + os.sep) and not p.startswith(_EXAMPLES_DIR + os.sep)


def user_chain(eqn, enclosing: Sequence[Any] = ()) -> list[tuple[str, int, str, int]]:
    """The user's call chain behind ``eqn``: ``(file, line, function, function start line)`` per user frame,
    outermost first, inside the traced function only (the walk outwards stops at jaxsane's own frames, the
    ``locate`` that traced it). Library frames (jax's ``jit``/``grad``/``vmap`` wrappers) are left out. A
    traceback that stops short (jax records a loop body's without the code around it) is continued with the
    chains of the ``enclosing`` equations (the loop/call equations around ``eqn``, outermost first). Host-side
    only, not jit-safe."""
    chain: list[tuple[str, int, str, int]] = []
    for candidate in (eqn, *reversed(tuple(enclosing))):
        complete = False
        for fr in frames_of(candidate) if candidate is not None else []:
            if _is_jaxsane_file(fr.file_name):
                complete = True
                break
            if is_library_file(fr.file_name):
                continue
            entry = (fr.file_name, fr.line_num, fr.function_name, fr.function_start_line)
            if entry not in chain:
                chain.append(entry)
        if complete:
            break
    return chain[::-1]


def user_location(eqn, enclosing: Sequence[Any] = ()) -> str | None:
    """``file:line`` of ``eqn`` in the user's code, else of the innermost enclosing equation that has
    one (the traceback of an equation inside a nested ``jit`` may stop at its boundary)."""
    for candidate in (eqn, *reversed(tuple(enclosing))):
        frame = user_frame(candidate)
        if frame is not None:
            return f"{frame[0]}:{frame[1]}"
    return None


def in_optax(eqn) -> bool:
    """Whether ``eqn`` was made by optax code called directly from user code (the update phase)."""
    for fr in frames_of(eqn):
        if not is_library_file(fr.file_name):
            return False
        if f"{os.sep}optax{os.sep}" in fr.file_name:
            return True
    return False


def source_text(file: str | None, line: int | None) -> str:
    if not file or not line:
        return ""
    return linecache.getline(file, line).strip()


_IPYKERNEL_CELL = re.compile(r"ipykernel_\d+[/\\]\d+\.py$")  # ipykernel >= 6: /tmp/ipykernel_PID/HASH.py
_IPYTHON_INPUT = re.compile(r"^<ipython-input-(\d+)-[0-9a-f]+>$")  # older IPython: <ipython-input-N-HASH>


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


def is_cell_file(file: str | None) -> bool:
    """Whether ``file`` is the code of a notebook/IPython cell (``/tmp/ipykernel_PID/HASH.py``)."""
    if not file:
        return False
    return bool(_IPYTHON_INPUT.match(file) or _IPYKERNEL_CELL.search(file))


def shown_location(file: str | None, line: int | None) -> str:
    """``file:line`` for a finding's text: a notebook cell as ``<cell 3>, line 6`` (its temporary path names the
    kernel's process id, which no reader can use), any other file as given."""
    if is_cell_file(file):
        return display_location(file, line)
    return "" if not file else f"{file}:{line}" if line is not None else file


def display_location(file: str | None, line: int | None) -> str:
    """``file:line`` as a user reads it: ``<cell 3>, line 6`` for a notebook cell (``<cell>, line 6``
    when its execution count is unknown), else the file's base name and the line."""
    if not file:
        return "<unknown location>"
    if _IPYTHON_INPUT.match(file) or _IPYKERNEL_CELL.search(file):
        n = cell_number(file)
        return f"<cell {n}>, line {line}" if n is not None else f"<cell>, line {line}"
    return f"{os.path.basename(file)}:{line}"


def _first_user_frame(frame: Any) -> tuple[Any, int]:
    """``(frame, depth)``: the first frame from ``frame`` outwards that is not library code, and how many
    frames out it is (1 for ``frame`` itself); ``(None, depth)`` when every frame is library code."""
    level = 1
    while frame is not None and is_library_file(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return frame, level


def user_call_site() -> str | None:
    """``file:line`` of the innermost frame of the current Python stack outside library code (see
    :func:`is_library_file`): where the user called into jaxsane. Host-side only, not jit-safe."""
    frame, _ = _first_user_frame(sys._getframe(1))
    return None if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def user_stacklevel() -> int:
    """The ``warnings.warn(stacklevel=...)`` that points at the innermost frame outside library code, for a
    warning raised by the caller of this function (however many jaxsane frames sit between). Not jit-safe."""
    return _first_user_frame(sys._getframe(1))[1]
