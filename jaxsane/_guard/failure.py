"""What guard knows of a failing step: its code, message and fix (:class:`Failure`, built by
:func:`classify`), locate's origin on its inputs (:func:`try_locate`), the NNX names of its dump
(:func:`nnx_records`) and the debugger stop of ``JAXSANE_ON_NONFINITE=breakpoint`` (:func:`stop_at_origin`).

Not jit-safe: this runs on the host, on the failure path only.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._core.errors import JaxsaneWarning
from .._core.finding import Finding
from .._core.frames import user_stacklevel
from .._experiment.chex import chex_asserts_off, locate_target
from .._experiment.purify import nnx_module as _nnx
from .kept import KeptCall

FIX = {
    "nonfinite.input": "the batch already holds NaN/Inf: check the data pipeline (jaxsane.check_data) and "
    "drop or repair bad rows before they reach the step.",
    "nonfinite.forward": "run jaxsane.locate(step, *inputs) on the dumped inputs to find the line; typical "
    "causes are log(0), exp overflow, 0/0 in a masked mean, fp16 overflow.",
    "nonfinite.literal": "the step returns a NaN/Inf constant written in the program (jnp.nan, jnp.inf, float('nan')): "
    "return a finite value, or replace the 'no value' marker before it reaches the outputs.",
    "nonfinite.update": "the loss was finite but the new state is not: run jaxsane.locate on the dumped inputs; "
    "typical causes are a NaN gradient (double-where trap, norm at 0), fp16 Adam eps "
    "underflow, or a learning rate blow-up.",
}


def some_paths(paths: list[str], n: int = 4) -> str:
    """The first ``n`` of ``paths`` for a message, and how many more there are."""
    return ", ".join(paths[:n]) + (f" and {len(paths) - n} more leaves" if len(paths) > n else "")


@dataclasses.dataclass
class Failure:
    """What the host side learns about one failing step, filled in as it looks (failure path only)."""

    step: int
    code: str
    paths: list[str]
    message: str
    hint: str = ""
    file: str | None = None
    line: int | None = None
    located: Any = None  # locate's result on the failing inputs
    host_inputs: tuple | None = None  # (args, kwargs) on the host, for the dump and NonFiniteError.inputs
    shard: Finding | None = None  # dist.nonfinite_shard
    divergence: list[Finding] = dataclasses.field(default_factory=list)  # dist.replica_divergence
    dump_path: str | None = None
    dump_error: str | None = None

    def __post_init__(self) -> None:
        self.hint = self.hint or FIX[self.code]

    def take_origin(self) -> None:
        """Name locate's first origin in the report: its code, file:line and fix replace guard's own."""
        located = self.located
        origin = located.origins[0] if located is not None and getattr(located, "origins", None) else None
        if origin is None:
            return
        self.code = getattr(origin, "code", self.code)
        self.file, self.line = getattr(origin, "file", None), getattr(origin, "line", None)
        self.hint = getattr(origin, "fix", None) or self.hint
        self.message += f"; origin: {origin.summary()}"

    def finding(self, policy: str) -> Finding:
        """The failing step's finding (``policy``: the finding's ``extra["policy"]``)."""
        shard = self.shard
        return Finding(
            self.code,
            self.message,
            self.hint,
            path=self.paths[0] if self.paths else None,
            step=self.step,
            file=self.file,
            line=self.line,
            extra={
                "paths": self.paths,
                "policy": policy,
                **({"dump": self.dump_path} if self.dump_path else {}),
                **({"dump_error": self.dump_error} if self.dump_error else {}),
                **({"nonfinite_shard": {"message": shard.message, **shard.extra}} if shard is not None else {}),
            },
        )

    def text(self) -> str:
        """The report as raised or warned."""
        text = f"[jaxsane] {self.code} at step {self.step}: {self.message}\n  fix: {self.hint}"
        if self.shard is not None:
            text += f"\n  {self.shard.code}: {self.shard.message}"
        text += "".join(f"\n  {d.code}: {d.message}" for d in self.divergence)
        if self.located is not None:
            text += "\n" + str(self.located)
        return text


def classify(step: int, call: KeptCall | None, bad: np.ndarray, names: tuple[list[str], list[str]]) -> Failure:
    """The failure's code (bad inputs, forward or update), the failing leaves' paths and the first message.
    ``names``: (input leaf paths, output leaf paths) of ``call`` (unused without one)."""
    if call is None:
        message = f"step {step} produced NaN/Inf (keep_inputs=False: leaf names and inputs not kept)"
        return Failure(step, "nonfinite.forward", [f"leaf {i}" for i in bad], message)
    in_paths, out_paths = names
    all_paths = in_paths + out_paths
    bad_inputs = [all_paths[i] for i in bad if i < len(in_paths)]
    bad_outputs = [all_paths[i] for i in bad if i >= len(in_paths)]
    if bad_inputs:
        message = f"the inputs of step {step} already hold NaN/Inf at {some_paths(bad_inputs)}"
        return Failure(step, "nonfinite.input", bad_inputs, message)
    in_metrics = any(p.startswith(("metrics", "loss", "out")) for p in bad_outputs)
    code = "nonfinite.forward" if in_metrics else "nonfinite.update"
    return Failure(step, code, bad_outputs, f"step {step} produced NaN/Inf in {some_paths(bad_outputs)}")


def stop_at_origin(text: str, located: Any, code: str) -> None:
    """JAXSANE_ON_NONFINITE=breakpoint: print the failure and open the debugger at its origin (or say why
    there is none: bad inputs, locate=False, a NaN only the compiled program makes). Not jit-safe."""
    from .._locate.debugger import post_mortem

    print(text, flush=True)
    if located is None:
        why = (
            "the step's inputs already hold NaN/Inf: nothing the step computed made it"
            if code == "nonfinite.input"
            else "the failing step was not located (locate=False, keep_inputs=False, or locate failed)"
        )
        print(
            f"[jaxsane] JAXSANE_ON_NONFINITE=breakpoint: no debugger opened: {why}; raising NonFiniteError.", flush=True
        )
        return
    try:
        opened = post_mortem(located)
    except Exception as e:  # noqa: BLE001 - no terminal (stdin captured, closed): the failure is still raised
        print(
            f"[jaxsane] JAXSANE_ON_NONFINITE=breakpoint: the debugger could not run ({type(e).__name__}: {e}); "
            "raising NonFiniteError.",
            flush=True,
        )
        return
    if opened:
        print("[jaxsane] leaving the debugger: raising NonFiniteError (JAXSANE_ON_NONFINITE=breakpoint).", flush=True)


def try_locate(step: Callable, call: KeptCall):
    """Run jaxsane.locate on the failing step's inputs, off the hot path; None if unavailable or it fails.

    NNX objects are rebuilt from their input state (``nnx.merge``), so locate sees the step exactly
    as it was called, before the in-place update.
    """
    try:  # (the compiled step just failed: no compile again to tell a latent NaN)
        from .._locate.locate import locate_failure
    except ImportError:
        return None
    user_args, kwargs = call.user_args()
    args = list(user_args)
    if call.positions:
        objs = _nnx().merge(call.graphdef, jax.tree_util.tree_unflatten(call.nnx_in[1], call.nnx_in[0]))
        for p, obj in zip(call.positions, objs):
            args[p] = obj
    try:
        with chex_asserts_off():  # a chexified step: replay the step under it, chex's assertions off
            return locate_failure(locate_target(step), *args, **kwargs)
    except Exception as e:  # locate must never hide the original failure
        warnings.warn(
            f"[jaxsane] locate failed on the failing step's inputs: {type(e).__name__}: {e}",
            JaxsaneWarning,
            stacklevel=user_stacklevel(),
        )
        return None


def nnx_records(call: KeptCall) -> dict:
    """``{"nnx": records}`` naming the NNX objects of a failing call (position, class) for its dump, or {}."""
    if not call.positions:
        return {}
    from .._dump.nnx import records_for

    try:
        objs = _nnx().merge(call.graphdef, jax.tree_util.tree_unflatten(call.nnx_in[1], call.nnx_in[0]))
    except Exception:  # the names are for messages only: never let them cost the dump
        return {"nnx": [{"arg": int(p), "class": "an NNX object"} for p in call.positions]}
    return {"nnx": records_for(call.positions, objs)}
