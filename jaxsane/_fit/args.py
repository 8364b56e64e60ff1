"""fit's arguments: types, ranges and paths, checked before any work (each a FitArgumentError). Host-side."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .._core.errors import FitArgumentError
from .._core.validate import require_policy

POLICIES = ("rollback", "skip", "raise")  # the words of _validate.NONFINITE_POLICIES that fit carries out


# ----------------------------------------------------------------------------- arguments


def _int_arg(name: str, value: Any, *, low: int, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise FitArgumentError(
            f"fit({name}=...) must be an int >= {low}{' or None' if none_ok else ''}, got "
            f"{type(value).__name__} {value!r}. fix: pass e.g. {name}={max(low, 1) * 10}."
        )
    if value < low:
        raise FitArgumentError(f"fit({name}=...) must be >= {low}, got {value}.")


def check_dir_arg(name: str, path: Any, *, create: bool) -> None:
    """``path`` (a directory fit writes into) must be a directory or creatable (``create``: create it now)."""
    if not isinstance(path, (str, os.PathLike)):
        raise FitArgumentError(f"fit({name}=...) must be a path (str or os.PathLike), got {type(path).__name__}.")
    if os.path.exists(path) and not os.path.isdir(path):
        raise FitArgumentError(
            f"fit({name}={os.fspath(path)!r}) is an existing file, not a directory. "
            "fix: pass a directory path (it is created when missing)."
        )
    if not create:  # created later, when needed: its nearest existing ancestor must be a directory
        parent = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise FitArgumentError(
                f"fit({name}={os.fspath(path)!r}) cannot be created: {parent} is a file. "
                "fix: pass a path in a writable directory."
            )
    else:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise FitArgumentError(
                f"fit({name}={os.fspath(path)!r}): the directory cannot be created "
                f"({type(e).__name__}: {e}). fix: pass a path in a writable directory."
            ) from e


def check_file_arg(name: str, path: Any, *, create_parent: bool) -> None:
    if not isinstance(path, (str, os.PathLike)):
        raise FitArgumentError(f"fit({name}=...) must be a file path (str or os.PathLike), got {type(path).__name__}.")
    if os.path.isdir(path):
        raise FitArgumentError(f"fit({name}={os.fspath(path)!r}) is a directory. fix: pass a file path.")
    parent = os.path.dirname(os.path.abspath(path))
    if create_parent:
        ancestor = parent
        while not os.path.exists(ancestor):
            ancestor = os.path.dirname(ancestor)
        if not os.path.isdir(ancestor):
            raise FitArgumentError(
                f"fit({name}={os.fspath(path)!r}): its directory cannot be created: {ancestor} "
                "is a file. fix: pass a path in a writable directory."
            )
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise FitArgumentError(
                f"fit({name}={os.fspath(path)!r}): its directory cannot be created "
                f"({type(e).__name__}: {e}). fix: pass a path in a writable directory."
            ) from e
    elif not os.path.isdir(parent):
        raise FitArgumentError(
            f"fit({name}={os.fspath(path)!r}): the directory {parent} does not exist. "
            "fix: create it first or pass a path in an existing directory."
        )


def check_fit_arguments(
    *,
    steps,
    eval_every,
    checkpoint_every,
    keep,
    on_nonfinite,
    max_rollbacks,
    patience,
    min_delta,
    eval_batches,
    telemetry_every,
    dead_every,
    log_every,
    rollback_every,
    thresholds,
) -> None:
    """Types and ranges of fit's arguments, checked before any work. Not jit-safe."""
    require_policy("fit", on_nonfinite, POLICIES, FitArgumentError)
    _int_arg("steps", steps, low=1)
    _int_arg("checkpoint_every", checkpoint_every, low=1)
    _int_arg("keep", keep, low=1)
    _int_arg("max_rollbacks", max_rollbacks, low=0)
    _int_arg("eval_every", eval_every, low=0, none_ok=True)
    _int_arg("patience", patience, low=1, none_ok=True)
    _int_arg("eval_batches", eval_batches, low=1)
    _int_arg("telemetry_every", telemetry_every, low=1, none_ok=True)
    _int_arg("dead_every", dead_every, low=0, none_ok=True)
    _int_arg("log_every", log_every, low=1)
    _int_arg("rollback_every", rollback_every, low=1, none_ok=True)
    if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float, np.number)) or not min_delta >= 0:
        raise FitArgumentError(f"fit(min_delta=...) must be a number >= 0, got {min_delta!r}.")
    if thresholds is not None and not isinstance(thresholds, dict):
        raise FitArgumentError(
            f"fit(thresholds=...) must be a dict of check_training keyword arguments, got {type(thresholds).__name__}."
        )
