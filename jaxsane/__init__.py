"""jaxsane: catch the classic JAX/Flax training failures cheaply, and say where and why.

The public names below are imported from their private modules on first use (PEP 562), so
``import jaxsane`` and the command line's argument checks do not import jax; ``from jaxsane
import guard`` and ``jaxsane.guard`` work as usual.
"""

__version__ = "0.1.0"

import importlib as _importlib

# private module -> the public names it defines, grouped by module
_EXPORTS: dict[str, tuple[str, ...]] = {
    "_dump": ("Dump", "load_dump", "save_dump"),
    "_errors": ("ArgumentError", "CheckpointError", "DataError", "DistHangError", "DoctorOptionError", "DumpError",
                "ExperimentError", "FitArgumentError", "GradCheckError", "GuardConfigError", "JaxsaneError", "NonFiniteError"),
    "_data": ("check_data",),
    "_dist": ("ReplicaDivergenceError", "check_replicas"),
    "_doctor": ("doctor",),
    "_experiment": ("Experiment", "PureExperiment"),
    "_findings": ("CODES", "Diagnosis", "Finding"),
    "_fit": ("FitResult", "fit"),
    "_guard": ("Guarded", "JaxsaneWarning", "guard"),
    "_locate": ("LocateReport", "Origin", "locate"),
    "_debugger": ("debug_origin", "post_mortem"),
    "_monitor": ("History", "Monitor", "check_training"),
    "_init_sweep": ("InitScaleSweep", "init_scale_sweep"),
    "_overfit": ("OverfitConfig", "OverfitResult", "overfit"),
    "_report": ("write_html",),
    "_grads": ("check_grads",),
    "_init": ("LayerStats", "activation_stats", "check_init"),
    "_step_checks": ("check_step", "count_compilations"),
    "_batch": ("check_batch_independence",),
    "_sequence": ("check_causal", "check_padding_in_loss"),
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
