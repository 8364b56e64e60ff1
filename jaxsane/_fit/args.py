"""fit's arguments: one frozen dataclass with a field per parameter of :func:`jaxsane.fit`, and their types,
ranges and paths, checked before any work (each a FitArgumentError). Host-side, not jit-safe."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np

from .._core.errors import ExperimentError, FitArgumentError
from .._core.validate import FIT_POLICIES, is_prng_key, require_policy
from .._dist.hang import check_hang_timeout
from .._experiment.contract import Experiment
from .._monitor.writers import require_writer

POLICIES = FIT_POLICIES  # the words of the one raise/skip/warn vocabulary that fit carries out
SPIKE_POLICIES = ("warn", "rollback", "skip")  # fit(on_spike=...): a spike is seen on the host after its step


def check_spike_policy(value: Any) -> str:
    """``fit(on_spike=...)``: one of :data:`SPIKE_POLICIES`, else a FitArgumentError naming them."""
    if isinstance(value, str) and value in SPIKE_POLICIES:
        return value
    raise FitArgumentError(
        f"fit(on_spike=...) must be one of {', '.join(map(repr, SPIKE_POLICIES))}, got {value!r}. 'warn': record "
        "train.loss_spike with its forensics; 'rollback'/'skip': also restore the last verified state and skip "
        "only the spiking batch."
    )


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


# ----------------------------------------------------------------------------- the options


@dataclasses.dataclass(frozen=True)
class FitOptions:
    """The arguments of one :func:`jaxsane.fit` call, one field per parameter (same names, meanings and
    defaults: see fit's docstring). :meth:`checked` checks them all and fills the defaults that need no work.
    Not jit-safe."""

    experiment: Experiment
    steps: int
    eval_every: int | None
    checkpoint_dir: str | None
    checkpoint_every: int
    keep: int
    resume: bool
    key: jax.Array | None
    on_nonfinite: str
    max_rollbacks: int
    patience: int | None
    min_delta: float
    eval_batches: int
    telemetry_every: int | None
    dead_every: int | None
    log_every: int
    metrics_path: str | None
    tensorboard_dir: str | None
    writer: Any
    progress: bool
    report: str | None
    dump_dir: str | None
    thresholds: dict | None
    restore_best: bool
    repeat: bool
    rollback_every: int | None
    checks: bool
    hang_timeout: float | None | str
    on_spike: str = "warn"

    def checked(self) -> FitOptions:
        """Every argument checked, in fit's order (an ExperimentError or FitArgumentError, before any work;
        ``checkpoint_dir`` and the metrics file's directory are created), with the defaults filled that depend
        on the arguments only: ``metrics_path``, ``telemetry_every``, ``dead_every``, ``rollback_every``.
        ``eval_every`` (it needs the experiment's loss) and ``hang_timeout="auto"`` (the process count at
        the first step) are resolved by the loop."""
        if not isinstance(self.experiment, Experiment):
            raise ExperimentError(f"fit needs a jaxsane.Experiment, got {type(self.experiment).__name__}.")
        check_fit_arguments(
            steps=self.steps,
            eval_every=self.eval_every,
            checkpoint_every=self.checkpoint_every,
            keep=self.keep,
            on_nonfinite=self.on_nonfinite,
            max_rollbacks=self.max_rollbacks,
            patience=self.patience,
            min_delta=self.min_delta,
            eval_batches=self.eval_batches,
            telemetry_every=self.telemetry_every,
            dead_every=self.dead_every,
            log_every=self.log_every,
            rollback_every=self.rollback_every,
            thresholds=self.thresholds,
        )
        steps = int(self.steps)
        writer = require_writer("jaxsane.fit", self.writer)
        hang_timeout = self.hang_timeout
        if not (isinstance(hang_timeout, str) and hang_timeout == "auto"):
            hang_timeout = check_hang_timeout(hang_timeout, "fit", FitArgumentError)
        if self.report is not None:
            check_file_arg("report", self.report, create_parent=False)
        if self.dump_dir is not None:
            check_dir_arg("dump_dir", self.dump_dir, create=False)
        metrics_path = self.metrics_path
        if self.checkpoint_dir is not None:
            check_dir_arg("checkpoint_dir", self.checkpoint_dir, create=True)
            if metrics_path is None:
                metrics_path = os.path.join(self.checkpoint_dir, "metrics.jsonl")
        if metrics_path is not None:
            check_file_arg("metrics_path", metrics_path, create_parent=True)
        for name in ("resume", "progress", "restore_best", "repeat", "checks"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise FitArgumentError(
                    f"fit({name}=...) must be True or False, got {type(value).__name__} {value!r}. Likely cause: "
                    + (
                        "a string such as 'false' is truthy"
                        if isinstance(value, str)
                        else "a value for another argument"
                    )
                    + f". fix: pass {name}=True or {name}=False."
                )
        if self.key is not None and not is_prng_key(self.key):
            raise FitArgumentError(
                f"fit(key=...) must be a PRNG key (jax.random.key(seed)) or None, got {type(self.key).__name__} "
                f"{self.key!r}. fix: pass key=jax.random.key(0)."
            )
        if self.tensorboard_dir is not None:
            check_dir_arg("tensorboard_dir", self.tensorboard_dir, create=False)
        check_spike_policy(self.on_spike)
        telemetry_every = max(1, min(50, steps // 40)) if self.telemetry_every is None else self.telemetry_every
        return dataclasses.replace(
            self,
            steps=steps,
            resume=bool(self.resume),
            progress=bool(self.progress),
            restore_best=bool(self.restore_best),
            repeat=bool(self.repeat),
            checks=bool(self.checks),
            writer=writer,
            hang_timeout=hang_timeout,
            metrics_path=metrics_path,
            telemetry_every=telemetry_every,
            dead_every=5 * telemetry_every if self.dead_every is None else self.dead_every,
            rollback_every=min(self.checkpoint_every, 20) if self.rollback_every is None else self.rollback_every,
        )
