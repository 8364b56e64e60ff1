"""jaxsane: catch the classic JAX/Flax training failures cheaply, and say where and why."""

__version__ = "0.1.0"

from ._dump import Dump as Dump, load_dump as load_dump, save_dump as save_dump
from ._errors import (
    CheckpointError as CheckpointError,
    DataError as DataError,
    ExperimentError as ExperimentError,
    FitArgumentError as FitArgumentError,
    GradCheckError as GradCheckError,
    JaxsaneError as JaxsaneError,
    NonFiniteError as NonFiniteError,
)
from ._data import check_data as check_data
from ._dist import ReplicaDivergenceError as ReplicaDivergenceError, check_replicas as check_replicas
from ._doctor import doctor as doctor
from ._experiment import Experiment as Experiment
from ._findings import CODES as CODES, Diagnosis as Diagnosis, Finding as Finding
from ._fit import FitResult as FitResult, fit as fit
from ._guard import Guarded as Guarded, JaxsaneWarning as JaxsaneWarning, guard as guard
from ._locate import LocateReport as LocateReport, Origin as Origin, locate as locate
from ._monitor import History as History, Monitor as Monitor, check_training as check_training
from ._init_sweep import InitScaleSweep as InitScaleSweep, init_scale_sweep as init_scale_sweep
from ._overfit import OverfitConfig as OverfitConfig, OverfitResult as OverfitResult, overfit as overfit
from ._report import write_html as write_html
from ._grads import check_grads as check_grads
from ._init import LayerStats as LayerStats, activation_stats as activation_stats, check_init as check_init
from ._step_checks import check_step as check_step, count_compilations as count_compilations
from ._batch import check_batch_independence as check_batch_independence

__all__ = [
    "CODES", "DataError", "Diagnosis", "Dump", "Experiment", "ExperimentError", "Finding", "GradCheckError",
    "Guarded", "JaxsaneError", "JaxsaneWarning", "NonFiniteError", "ReplicaDivergenceError", "check_data",
    "check_replicas", "doctor", "guard", "load_dump", "save_dump",
    "InitScaleSweep", "OverfitConfig", "OverfitResult", "init_scale_sweep", "overfit",
    "CheckpointError", "FitArgumentError", "FitResult", "History", "Monitor", "check_training", "fit", "write_html",
    "LocateReport", "Origin", "locate",
    "LayerStats", "activation_stats", "check_batch_independence", "check_grads", "check_init", "check_step",
    "count_compilations",
]
