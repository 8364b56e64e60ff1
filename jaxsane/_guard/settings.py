"""guard's settings: the checks of :func:`jaxsane.guard`'s arguments (:func:`check_settings`) and the frozen
record of them that the guarded step and its host side read (:class:`GuardSettings`).

Not jit-safe: this runs once, when a step is wrapped.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from .._core.errors import GuardConfigError
from .._core.validate import GUARD_POLICIES, require_policy

POLICIES = GUARD_POLICIES  # the words of the one raise/skip/warn vocabulary that guard carries out
ENV_ONLY = ("breakpoint",)  # and of ENV_ONLY_POLICIES (JAXSANE_ON_NONFINITE only)


@dataclasses.dataclass(frozen=True)
class GuardSettings:
    """guard's settings once checked (each is the :func:`jaxsane.guard` argument of the same name; ``locate``
    is its ``locate=``). ``breakpoint``: ``JAXSANE_ON_NONFINITE=breakpoint`` was read, ``on_nonfinite`` is
    then ``"raise"``."""

    on_nonfinite: str = "raise"
    dump_dir: str | None = None
    max_consecutive_skips: int = 10
    max_lag: int = 2
    keep_inputs: bool = True
    sync: bool = False
    locate: bool = True
    check_replicas: bool | int = False
    warn_recompiles: bool = True
    breakpoint: bool = False

    @property
    def policy(self) -> str:
        """The policy a failure's finding names (``extra["policy"]``)."""
        return "breakpoint" if self.breakpoint else self.on_nonfinite


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_settings(
    step: Any,
    *,
    on_nonfinite: Any,
    dump_dir: Any,
    max_consecutive_skips: Any,
    max_lag: Any,
    keep_inputs: Any,
    sync: Any,
    locate: Any,
    check_replicas: Any,
    warn_recompiles: Any = True,
) -> GuardSettings:
    """Validate guard's arguments before any work; returns them as :class:`GuardSettings` (``dump_dir`` as a
    ``str`` or None). Not jit-safe.

    Raises:
      GuardConfigError: naming the argument, what it got, and the values it accepts.
    """

    def bad(name: str, value: Any, valid: str) -> GuardConfigError:
        return GuardConfigError(
            f"[jaxsane] {name} must be {valid}; got {value!r} ({type(value).__name__}). "
            f"Fix the {name}= argument of jaxsane.guard."
        )

    if not callable(step):
        raise GuardConfigError(
            f"[jaxsane] guard needs a callable step, e.g. (state, batch) -> (state, metrics); "
            f"got {type(step).__name__}. Pass the train step function itself, not its result."
        )
    require_policy("jaxsane.guard", on_nonfinite, POLICIES, error=GuardConfigError)
    if dump_dir is not None:
        if not isinstance(dump_dir, (str, os.PathLike)) or isinstance(dump_dir, bytes):
            raise bad("dump_dir", dump_dir, "None or a directory path (str or os.PathLike)")
        dump_dir = os.fspath(dump_dir)
        if not isinstance(dump_dir, str) or not dump_dir:
            raise bad("dump_dir", dump_dir, "None or a non-empty directory path (str or os.PathLike)")
        if os.path.exists(dump_dir) and not os.path.isdir(dump_dir):
            raise GuardConfigError(
                f"[jaxsane] guard(dump_dir={dump_dir!r}): the path exists and is not a "
                f"directory. Pass a directory (it is created on the first failure) or None."
            )
    if not _is_int(max_consecutive_skips) or max_consecutive_skips < 1:
        raise bad("max_consecutive_skips", max_consecutive_skips, "an int >= 1 (default 10)")
    if not _is_int(max_lag) or max_lag < 0:
        raise bad("max_lag", max_lag, "an int >= 0 (default 2; 0 reads each step's flags at the next call)")
    for name, value in (
        ("keep_inputs", keep_inputs),
        ("sync", sync),
        ("locate", locate),
        ("warn_recompiles", warn_recompiles),
    ):
        if not isinstance(value, (bool, np.bool_)):
            raise bad(name, value, "True or False")
    if not isinstance(check_replicas, (bool, np.bool_)) and not (_is_int(check_replicas) and check_replicas >= 1):
        raise bad("check_replicas", check_replicas, "True, False, or a step interval int >= 1 (check every N-th step)")
    return GuardSettings(
        on_nonfinite=on_nonfinite,
        dump_dir=dump_dir,
        max_consecutive_skips=max_consecutive_skips,
        max_lag=max_lag,
        keep_inputs=keep_inputs,
        sync=sync,
        locate=locate,
        check_replicas=check_replicas,
        warn_recompiles=warn_recompiles,
    )
