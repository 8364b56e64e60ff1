"""jaxsane: catch the classic JAX/Flax training failures cheaply, and say where and why.

The public names below are imported from their private modules on first use (PEP 562), so
``import jaxsane`` and the command line's argument checks do not import jax; ``from jaxsane
import guard`` and ``jaxsane.guard`` work as usual. Type checkers and IDEs read the same names from
the ``TYPE_CHECKING`` block.

Where things live (each capability is a private folder; layers point down only):
``_core`` (errors, findings, codes, diagnosis, history, tree, validation, frames), ``_jaxpr`` (the one
interpreter, trace cache, compile level and cache, recompiles), ``_render`` (reprs, plots, progress,
the HTML report), ``_experiment`` (the contract and its adapters), ``_dump``, ``_dist``, ``_locate``,
``_guard``, ``_data``, ``_checks`` (grads, init, step, batch, sequence), ``_monitor``, ``_overfit``,
``_fit`` and ``_doctor`` at the top.
"""

from __future__ import annotations

__version__ = "0.1.0"

import importlib as _importlib
from typing import TYPE_CHECKING

# private module -> the public names it defines, grouped by module
_EXPORTS: dict[str, tuple[str, ...]] = {
    "_core.codes": ("CODES",),
    "_core.diagnosis": ("Diagnosis",),
    "_core.errors": (
        "ArgumentError",
        "CheckpointError",
        "DataError",
        "DistHangError",
        "DoctorOptionError",
        "DumpError",
        "DumpShapeError",
        "ExampleAxisError",
        "ExperimentError",
        "FindingError",
        "FitArgumentError",
        "GradCheckError",
        "GuardConfigError",
        "JaxsaneError",
        "JaxsaneWarning",
        "NonFiniteError",
        "Preempted",
        "ReplicaDivergenceError",
    ),
    "_core.finding": ("Finding",),
    "_core.history": ("History",),
    "_checks.batch": ("check_batch_independence",),
    "_checks.grads": ("check_grads",),
    "_checks.init": (
        "LayerStats",
        "activation_stats",
        "check_init",
    ),
    "_checks.init_sweep": (
        "InitScaleSweep",
        "init_scale_sweep",
    ),
    "_checks.causal": ("check_causal",),
    "_checks.sequence": ("check_padding_in_loss",),
    "_checks.step": (
        "check_step",
        "count_compilations",
    ),
    "_data.check": ("check_data",),
    "_dist.replicas": ("check_replicas",),
    "_doctor.doctor": ("doctor",),
    "_dump.dump": (
        "Dump",
        "load_dump",
        "save_dump",
    ),
    "_experiment.contract": (
        "Experiment",
        "PureExperiment",
    ),
    "_fit.fit": ("fit",),
    "_fit.result": ("FitResult",),
    "_guard.guard": (
        "Guarded",
        "guard",
    ),
    "_locate.debugger": (
        "debug_origin",
        "post_mortem",
    ),
    "_locate.locate": ("locate",),
    "_locate.result": (
        "LocateReport",
        "Origin",
    ),
    "_monitor.monitor": ("Monitor",),
    "_monitor.spike_forensics": ("explain_spike",),
    "_monitor.train_checks": ("check_training",),
    "_overfit.overfit": ("overfit",),
    "_precision.compare": ("compare_precision",),
    "_overfit.result": (
        "OverfitConfig",
        "OverfitResult",
    ),
    "_render.html": ("write_html",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:  # the same names, for type checkers and IDEs; at run time they load on first use
    from ._checks.batch import check_batch_independence as check_batch_independence
    from ._checks.causal import check_causal as check_causal
    from ._checks.grads import check_grads as check_grads
    from ._checks.init import LayerStats as LayerStats, activation_stats as activation_stats, check_init as check_init
    from ._checks.init_sweep import InitScaleSweep as InitScaleSweep, init_scale_sweep as init_scale_sweep
    from ._checks.sequence import check_padding_in_loss as check_padding_in_loss
    from ._checks.step import check_step as check_step, count_compilations as count_compilations
    from ._core.codes import CODES as CODES
    from ._core.diagnosis import Diagnosis as Diagnosis
    from ._core.errors import (
        ArgumentError as ArgumentError,
        CheckpointError as CheckpointError,
        DataError as DataError,
        DistHangError as DistHangError,
        DoctorOptionError as DoctorOptionError,
        DumpError as DumpError,
        DumpShapeError as DumpShapeError,
        ExampleAxisError as ExampleAxisError,
        ExperimentError as ExperimentError,
        FindingError as FindingError,
        FitArgumentError as FitArgumentError,
        GradCheckError as GradCheckError,
        GuardConfigError as GuardConfigError,
        JaxsaneError as JaxsaneError,
        JaxsaneWarning as JaxsaneWarning,
        NonFiniteError as NonFiniteError,
        Preempted as Preempted,
        ReplicaDivergenceError as ReplicaDivergenceError,
    )
    from ._core.finding import Finding as Finding
    from ._core.history import History as History
    from ._data.check import check_data as check_data
    from ._dist.replicas import check_replicas as check_replicas
    from ._doctor.doctor import doctor as doctor
    from ._dump.dump import Dump as Dump, load_dump as load_dump, save_dump as save_dump
    from ._experiment.contract import Experiment as Experiment, PureExperiment as PureExperiment
    from ._fit.fit import fit as fit
    from ._fit.result import FitResult as FitResult
    from ._guard.guard import Guarded as Guarded, guard as guard
    from ._locate.debugger import debug_origin as debug_origin, post_mortem as post_mortem
    from ._locate.locate import locate as locate
    from ._locate.result import LocateReport as LocateReport, Origin as Origin
    from ._monitor.monitor import Monitor as Monitor
    from ._monitor.spike_forensics import explain_spike as explain_spike
    from ._monitor.train_checks import check_training as check_training
    from ._overfit.overfit import overfit as overfit
    from ._overfit.result import OverfitConfig as OverfitConfig, OverfitResult as OverfitResult
    from ._precision.compare import compare_precision as compare_precision
    from ._render.html import write_html as write_html


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxsane' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})


__all__ = [
    "CODES",
    "Diagnosis",
    "ArgumentError",
    "CheckpointError",
    "DataError",
    "DistHangError",
    "DoctorOptionError",
    "DumpError",
    "DumpShapeError",
    "ExampleAxisError",
    "ExperimentError",
    "FindingError",
    "FitArgumentError",
    "GradCheckError",
    "GuardConfigError",
    "JaxsaneError",
    "JaxsaneWarning",
    "NonFiniteError",
    "Preempted",
    "ReplicaDivergenceError",
    "Finding",
    "History",
    "check_batch_independence",
    "check_grads",
    "LayerStats",
    "activation_stats",
    "check_init",
    "InitScaleSweep",
    "init_scale_sweep",
    "check_causal",
    "check_padding_in_loss",
    "check_step",
    "count_compilations",
    "check_data",
    "check_replicas",
    "doctor",
    "Dump",
    "load_dump",
    "save_dump",
    "Experiment",
    "PureExperiment",
    "FitResult",
    "fit",
    "Guarded",
    "guard",
    "debug_origin",
    "post_mortem",
    "locate",
    "LocateReport",
    "Origin",
    "Monitor",
    "explain_spike",
    "check_training",
    "compare_precision",
    "overfit",
    "OverfitConfig",
    "OverfitResult",
    "write_html",
]
