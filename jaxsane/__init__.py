"""jaxsane: catch the classic JAX/Flax training failures cheaply, and say where and why.

The public names below are imported from their private modules on first use (PEP 562), so
``import jaxsane`` and the command line's argument checks do not import jax; ``from jaxsane
import guard`` and ``jaxsane.guard`` work as usual.
"""

__version__ = "0.1.0"

import importlib as _importlib

# private module -> the public names it defines, grouped by module
_EXPORTS: dict[str, tuple[str, ...]] = {
    "_dump.dump": ("Dump", "load_dump", "save_dump"),
    "_core.errors": ("ArgumentError", "CheckpointError", "DataError", "DistHangError", "DoctorOptionError", "DumpError",
                "ExperimentError", "FitArgumentError", "GradCheckError", "GuardConfigError", "JaxsaneError", "NonFiniteError"),
    "_data.check": ("check_data",),
    "_dist.replicas": ("ReplicaDivergenceError", "check_replicas"),
    "_doctor.doctor": ("doctor",),
    "_experiment.contract": ("Experiment", "PureExperiment"),
    "_core.finding": ("CODES", "Diagnosis", "Finding"),
    "_fit.fit": ("FitResult", "fit"),
    "_guard.guard": ("Guarded", "JaxsaneWarning", "guard"),
    "_locate.locate": ("LocateReport", "Origin", "locate"),
    "_locate.debugger": ("debug_origin", "post_mortem"),
    "_monitor.monitor": ("History", "Monitor", "check_training"),
    "_checks.init_sweep": ("InitScaleSweep", "init_scale_sweep"),
    "_overfit.overfit": ("OverfitConfig", "OverfitResult", "overfit"),
    "_render.html": ("write_html",),
    "_checks.grads": ("check_grads",),
    "_checks.init": ("LayerStats", "activation_stats", "check_init"),
    "_checks.step": ("check_step", "count_compilations"),
    "_checks.batch": ("check_batch_independence",),
    "_checks.sequence": ("check_causal", "check_padding_in_loss"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


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
    "ArgumentError", "CODES", "CheckpointError", "FitArgumentError", "GuardConfigError", "DataError", "Diagnosis",
    "DistHangError",
    "DoctorOptionError", "Dump", "DumpError", "Experiment", "ExperimentError", "Finding",
    "GradCheckError", "Guarded", "JaxsaneError", "JaxsaneWarning", "NonFiniteError", "PureExperiment",
    "ReplicaDivergenceError",
    "check_data", "check_replicas", "doctor", "guard", "load_dump", "save_dump",
    "InitScaleSweep", "OverfitConfig", "OverfitResult", "init_scale_sweep", "overfit",
    "FitResult", "History", "Monitor", "check_training", "fit", "write_html",
    "LocateReport", "Origin", "locate", "debug_origin", "post_mortem",
    "LayerStats", "activation_stats", "check_batch_independence", "check_grads", "check_init", "check_step",
    "count_compilations", "check_causal", "check_padding_in_loss",
]
