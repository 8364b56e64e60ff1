"""doctor's options: one frozen dataclass per stage, flat option names, declared types.

Each stage of the pipeline (``_doctor/pipeline.py``) reads one options dataclass below. The
field names are the flat names users pass (``doctor(exp, run_steps=50)``, ``jaxsane doctor -o
run_steps=50``), so every name is unique across stages. :func:`resolve` checks names, types
and ranges before any work and raises :class:`DoctorOptionError` naming the valid options;
:func:`parse_text` reads a command-line value per the declared type (``1e-3,1e-2`` for a tuple
of floats). This module does not import jax, so the CLI validates its arguments in
milliseconds. Nothing here is jit-related.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import numbers
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Protocol

from .._core.errors import DoctorOptionError

_UNSET = object()


def _opt(
    default: Any = _UNSET,
    doc: str = "",
    *,
    factory: Any = None,
    minimum: float | None = None,
    choices: tuple | None = None,
) -> Any:
    """A documented option field: its help text, and an optional lower bound or set of choices."""
    meta = {"doc": doc, "minimum": minimum, "choices": choices}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class DataOptions:
    """Options of the ``data`` stage (:func:`jaxsane.check_data`)."""

    stage: ClassVar[str] = "data"
    description: ClassVar[str] = "data: shapes, labels, leakage, duplicates, padding, scale"
    data_max_batches: int | None = _opt(
        None,
        "batches read from an iterable split (default: no count limit; data_max_seconds bounds the reading)",
        minimum=1,
    )
    data_max_seconds: float | None = _opt(
        None,
        "seconds spent reading each iterable split: a stream is read until it ends, starts over (one epoch) "
        "or this runs out, so rare corrupt rows far into an endless stream are seen (default: 5 s, less on a "
        "program whose own cold run is short: a tenth of it as doctor timed it, at least 1 s)",
        minimum=0,
    )


@dataclasses.dataclass(frozen=True)
class InitOptions:
    """Options of the ``init`` stage (loss at init, activation statistics)."""

    stage: ClassVar[str] = "init"
    description: ClassVar[str] = (
        "init: loss at init against ln C or the best constant, activation scale, symmetric units"
    )
    init_loss_rtol: float = _opt(0.5, "relative distance from ln C that init.loss tolerates", minimum=0)
    init_loss_factor: float = _opt(
        30.0,
        "for a loss that is not a C-way cross-entropy: how many times the best "
        "constant prediction's loss init.loss tolerates",
        minimum=1,
    )
    init_scale_ratio: float = _opt(
        10.0, "growth/shrink of activation scale through depth that init.scale tolerates", minimum=0
    )
    init_per_layer_factor: float = _opt(2.0, "scale change per layer that init.scale tolerates", minimum=0)
    init_max_saturated: float = _opt(0.5, "fraction of saturated units tolerated", minimum=0)
    init_symmetric_tol: float = _opt(1e-6, "tolerance under which two units count as identical", minimum=0)


@dataclasses.dataclass(frozen=True)
class GradsOptions:
    """Options of the ``grads`` stage (:func:`jaxsane.check_grads` of ``Experiment.loss``)."""

    stage: ClassVar[str] = "grads"
    description: ClassVar[str] = "gradients: autodiff vs finite differences, per leaf"
    grads_order: int = _opt(1, "derivative order checked", choices=(1, 2))
    grads_modes: tuple[str, ...] = _opt(("fwd", "rev"), "autodiff modes checked", choices=("fwd", "rev"))
    grads_batch_size: int = _opt(32, "examples of the first batch used", minimum=1)
    grads_max_leaves: int = _opt(128, "float leaves checked, drawn at random beyond it (0: every leaf)", minimum=0)
    grads_float64: bool = _opt(
        True,
        "check in float64; False: in float32, and a leaf that fails there is checked again in float64 before it is "
        "reported (cheaper on a large model; an error below float32's resolution can go unseen)",
    )
    grads_trust_autodiff: bool = _opt(
        False,
        "compare with finite differences only the leaves where autodiff can be wrong: all of them when the loss uses "
        "a derivative rule that is not JAX's own (custom_jvp/custom_vjp), else those behind a stop_gradient the user "
        "wrote and those with a zero or non-finite gradient (doctor sets it on a large step)",
    )
    grads_replay_examples: int = _opt(
        0,
        "examples the equation-by-equation replay of the gradient (nonfinite.latent) runs on (0: the check's)",
        minimum=0,
    )


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Options of the ``step`` stage (:func:`jaxsane.check_step`)."""

    stage: ClassVar[str] = "step"
    description: ClassVar[str] = "the step: updates, optimizer state, randomness, compiles once"
    step_calls: int = _opt(3, "calls of the step on the first batch", minimum=2)


@dataclasses.dataclass(frozen=True)
class BatchOptions:
    """Options of the ``batch`` stage (:func:`jaxsane.check_batch_independence`)."""

    stage: ClassVar[str] = "batch"
    description: ClassVar[str] = "batch independence: VJP of one example's output"
    batch_probes: int = _opt(2, "examples whose output is probed", minimum=1)


@dataclasses.dataclass(frozen=True)
class OverfitOptions:
    """Options of the ``overfit`` stage (:func:`jaxsane.overfit`, then :func:`jaxsane.init_scale_sweep`)."""

    stage: ClassVar[str] = "overfit"
    description: ClassVar[str] = "overfit one small batch (vmapped sweep)"
    overfit_seeds: int | tuple[int, ...] | None = _opt(
        None,
        "number of seeds, or the seeds themselves (default: 2, or 1 for a model too large for 2 in the sweep's budget)",
    )
    overfit_steps: int = _opt(300, "steps per configuration", minimum=1)
    overfit_learning_rates: tuple[float, ...] | None = _opt(
        None, "learning rates swept (default: 0.1, 1 and 10 x the optimizer's own rate)", minimum=0
    )
    overfit_init_scales: tuple[float, ...] | None = _opt(None, "init scale multipliers swept (default: 1)", minimum=0)
    overfit_batch_size: int = _opt(16, "examples of the first batch to overfit", minimum=1)
    overfit_seconds: float | None = _opt(
        None,
        "seconds the compiled sweep may run, its retry with scaled updates included (default: 20 of the user's "
        "steps as the step stage timed them, at least 30 s, on a small step; on a large one 0.4 of the user's own "
        "cold run as doctor measured it: init, the first step, 30 steps; 0: no limit); a sweep stopped before any "
        "configuration reached the target is not judged",
        minimum=0,
    )
    init_scales: tuple[float, ...] | None = _opt(
        (0.5, 1.0, 2.0),
        "scales of the init-scale sweep drawn in the "
        "HTML report (None: no sweep; the CLI passes None unless it writes "
        "--html)",
        minimum=0,
    )


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Options of the ``run`` stage (a short guarded, monitored run)."""

    stage: ClassVar[str] = "run"
    description: ClassVar[str] = "a short guarded run"
    run_steps: int = _opt(30, "steps of the run", minimum=1)
    run_eval_every: int = _opt(5, "steps between eval losses (0: none)", minimum=0)
    run_eval_examples: int = _opt(0, "examples of the first eval batch evaluated (0: all of them)", minimum=0)
    run_telemetry_every: int = _opt(
        1,
        "steps between gradient telemetry samples (gradient and parameter norms: one more forward and backward "
        "pass each); the step's own loss is recorded every step",
        minimum=1,
    )
    run_telemetry_examples: int = _opt(
        0,
        "examples of each sampled batch its gradient telemetry is taken on (0: all of them; a step that reports "
        "no loss always takes all: the run's loss comes from there)",
        minimum=0,
    )
    run_dead_every: int = _opt(5, "steps between dead-ReLU samples (0: none)", minimum=0)
    run_thresholds: dict[str, int | float] = _opt(
        doc="keyword overrides for jaxsane.check_training (e.g. plateau_rel:0.02)", factory=dict
    )


class StageOptions(Protocol):
    """What every options dataclass above is: a frozen dataclass naming its stage and describing it."""

    stage: ClassVar[str]
    description: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, Any]]


# The stages' options, in checklist order (the pipeline checks it runs the same order).
OPTION_CLASSES: tuple[type[StageOptions], ...] = (
    DataOptions,
    InitOptions,
    GradsOptions,
    StepOptions,
    BatchOptions,
    OverfitOptions,
    RunOptions,
)
STAGE_NAMES: tuple[str, ...] = tuple(cls.stage for cls in OPTION_CLASSES)


@dataclasses.dataclass(frozen=True)
class OptionSpec:
    """One option: its flat name, stage, declared type, default and documentation."""

    name: str
    stage: str
    type: Any
    default: Any
    doc: str
    minimum: float | None
    choices: tuple | None

    def __str__(self) -> str:
        return f"{self.name}: {type_name(self.type)} = {self.default!r}"


def _specs() -> dict[str, OptionSpec]:
    out = {}
    for cls in OPTION_CLASSES:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            out[f.name] = OptionSpec(
                f.name,
                cls.stage,
                hints[f.name],
                default,
                f.metadata["doc"],
                f.metadata["minimum"],
                f.metadata["choices"],
            )
    return out


OPTIONS: dict[str, OptionSpec] = _specs()


def type_name(tp: Any) -> str:
    """``int | None``, ``tuple[float, ...]``: the declared type as users read it."""
    if tp is type(None):
        return "None"
    if isinstance(tp, type):
        return tp.__name__
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is tuple:
        return f"tuple[{type_name(args[0])}, ...]"
    if origin is dict:
        return f"dict[{type_name(args[0])}, {type_name(args[1])}]"
    return str(tp)


def describe() -> str:
    """Every option on one line: ``name: type = default``, in stage order."""
    return "; ".join(str(spec) for spec in OPTIONS.values())


class _Mismatch(Exception):
    pass


# a declared scalar type -> (whether a Python value is one, the value as that type)
_SCALARS: dict[Any, tuple[Callable[[Any], bool], Callable[[Any], Any]]] = {
    type(None): (lambda v: v is None, lambda v: None),
    bool: (lambda v: isinstance(v, bool), lambda v: v),
    int: (lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool), int),
    float: (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool), float),
    str: (lambda v: isinstance(v, str), lambda v: v),
}


def _coerce(value: Any, tp: Any) -> Any:
    """``value`` as the declared type ``tp`` (ints accepted for floats, lists for tuples) or _Mismatch."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            try:
                return _coerce(value, arg)
            except _Mismatch:
                pass
        raise _Mismatch
    if tp in _SCALARS:
        accepts, convert = _SCALARS[tp]
        if accepts(value):
            return convert(value)
        raise _Mismatch
    if origin is tuple:
        if isinstance(value, (list, tuple)) and value:
            return tuple(_coerce(v, args[0]) for v in value)
        raise _Mismatch
    if origin is dict:
        if isinstance(value, Mapping):
            return {_coerce(k, args[0]): _coerce(v, args[1]) for k, v in value.items()}
        raise _Mismatch
    raise _Mismatch  # pragma: no cover - every declared type is handled above


def _range_problem(spec: OptionSpec, value: Any) -> str | None:
    items = list(value.values()) if isinstance(value, dict) else (list(value) if isinstance(value, tuple) else [value])
    for item in items:
        if isinstance(item, float) and math.isnan(item):
            return "must be a number, got nan"
        if spec.choices is not None and item not in spec.choices:
            return f"must be one of {list(spec.choices)}, got {item!r}"
        if (
            spec.minimum is not None
            and isinstance(item, (int, float))
            and not isinstance(item, bool)
            and item < spec.minimum
        ):
            return f"must be >= {spec.minimum:g}, got {item!r}"
    return None


def _unknown(name: str) -> DoctorOptionError:
    close = difflib.get_close_matches(name, list(OPTIONS), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return DoctorOptionError(f"unknown doctor option {name!r}{hint}. The options are: {describe()}.")


def check_value(name: str, value: Any) -> Any:
    """``value`` checked against option ``name``'s declared type and range; the coerced value.

    Raises:
      DoctorOptionError: unknown name, ill-typed or out-of-range value.
    """
    if name not in OPTIONS:
        raise _unknown(name)
    spec = OPTIONS[name]
    try:
        out = _coerce(value, spec.type)
    except _Mismatch:
        raise DoctorOptionError(
            f"doctor option {name} must be {type_name(spec.type)} (default "
            f"{spec.default!r}: {spec.doc}), got {value!r} ({type(value).__name__})."
        ) from None
    problem = _range_problem(spec, out)
    if problem:
        raise DoctorOptionError(f"doctor option {name} {problem} (default {spec.default!r}: {spec.doc}).")
    return out


def _parse_none(text: str) -> None:
    if text.lower() in ("none", "null"):
        return None
    raise _Mismatch


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("true", "yes", "on", "1"):
        return True
    if low in ("false", "no", "off", "0"):
        return False
    raise _Mismatch


# a declared scalar type -> how command-line text reads as it (ValueError or _Mismatch when it cannot)
_SCALAR_PARSERS: dict[Any, Callable[[str], Any]] = {
    type(None): _parse_none,
    bool: _parse_bool,
    int: int,
    float: float,
    str: lambda text: text,
}


def _parse(text: str, tp: Any) -> Any:
    """Read command-line ``text`` as ``tp``; _Mismatch when it cannot be."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    text = text.strip()
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            try:
                return _parse(text, arg)
            except _Mismatch:
                pass
        raise _Mismatch
    try:
        if tp in _SCALAR_PARSERS:
            return _SCALAR_PARSERS[tp](text)
        if origin is tuple:
            return _parse_tuple(text, args[0])
        if origin is dict:
            return _parse_dict(text, args[1])
    except (ValueError, json.JSONDecodeError, RecursionError):  # RecursionError: JSON nested too deeply
        raise _Mismatch from None
    raise _Mismatch  # pragma: no cover


def _parse_tuple(text: str, item: Any) -> tuple:
    """``1,2`` or ``[1,2]`` or ``(1,2)``: items of type ``item``, none empty."""
    inner = text[1:-1] if text[:1] + text[-1:] in ("[]", "()") else text
    parts = [p for p in inner.split(",")]
    if not inner.strip() or any(not p.strip() for p in parts):
        raise _Mismatch
    return tuple(_parse(p, item) for p in parts)


def _parse_dict(text: str, value: Any) -> dict:
    """A JSON object, or ``key:value,key:value`` with values of type ``value``."""
    if text.startswith("{"):
        loaded = json.loads(text)
        if not isinstance(loaded, dict):
            raise _Mismatch
        return loaded
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, val = item.partition(":")
        if not sep:
            raise _Mismatch
        out[key.strip()] = _parse(val, value)
    return out


def parse_text(name: str, text: str) -> Any:
    """The value of ``-o name=text`` per the option's declared type (``1e-3,1e-2`` -> ``(0.001, 0.01)``).

    Raises:
      DoctorOptionError: unknown name, or text that is not a value of the declared type.
    """
    if name not in OPTIONS:
        raise _unknown(name)
    spec = OPTIONS[name]
    try:
        value = _parse(text, spec.type)
    except _Mismatch:
        example = {int: "3", float: "0.5"}.get(spec.type, None)
        form = (
            f"e.g. {name}={example}"
            if example
            else f"a comma list, e.g. {name}={','.join(map(str, spec.default or (0.001, 0.01)))}"
            if "tuple" in type_name(spec.type)
            else f"e.g. {name}=plateau_rel:0.02,min_steps:5"
            if isinstance(spec.default, dict)
            else ""
        )
        raise DoctorOptionError(
            f"doctor option {name} must be {type_name(spec.type)} (default {spec.default!r}: "
            f"{spec.doc}), got {text!r}{'; ' + form if form else ''}."
        ) from None
    return check_value(name, value)


def resolve(options: Mapping[str, Any]) -> dict[str, Any]:
    """``{stage: its options dataclass}`` from flat ``options``; every name, type and range checked.

    Raises:
      DoctorOptionError: naming the first bad option and the valid ones.
    """
    by_stage: dict[str, dict[str, Any]] = {cls.stage: {} for cls in OPTION_CLASSES}
    for name, value in options.items():
        value = check_value(name, value)
        by_stage[OPTIONS[name].stage][name] = value
    return {cls.stage: cls(**by_stage[cls.stage]) for cls in OPTION_CLASSES}


def select_stages(stages: Iterable[str] | str | None, skip: Iterable[str] | str = ()) -> list[str]:
    """The stage names to run, in checklist order; unknown names raise :class:`DoctorOptionError`."""
    for name, value in (("stages", stages), ("skip", skip)):
        if value is not None and not isinstance(value, str) and not isinstance(value, Iterable):
            raise DoctorOptionError(
                f"doctor({name}=...) must be a stage name or a list of them, got {type(value).__name__} {value!r}. "
                f"Fix: pass {name}=['data', 'init'] (the stages are {list(STAGE_NAMES)})."
            )
    chosen = [stages] if isinstance(stages, str) else (list(STAGE_NAMES) if stages is None else list(stages))
    skipped = [skip] if isinstance(skip, str) else list(skip or ())
    unknown = [s for s in [*chosen, *skipped] if s not in STAGE_NAMES]
    if unknown:
        raise DoctorOptionError(f"unknown doctor stage(s) {unknown}; the stages are {list(STAGE_NAMES)}.")
    selected = [s for s in STAGE_NAMES if s in chosen and s not in skipped]
    if not selected:
        raise DoctorOptionError(
            f"no doctor stage left to run (stages={chosen}, skip={skipped}); a diagnosis that "
            f"checked nothing cannot pass. The stages are {list(STAGE_NAMES)}."
        )
    return selected
