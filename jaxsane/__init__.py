"""jaxsane: catch the classic JAX/Flax training failures cheaply, and say where and why."""

__version__ = "0.1.0"

from ._dump import Dump as Dump, load_dump as load_dump, save_dump as save_dump
from ._errors import (
    DataError as DataError,
    ExperimentError as ExperimentError,
    GradCheckError as GradCheckError,
    JaxsaneError as JaxsaneError,
    NonFiniteError as NonFiniteError,
)
from ._doctor import doctor as doctor
from ._experiment import Experiment as Experiment
from ._findings import CODES as CODES, Diagnosis as Diagnosis, Finding as Finding
from ._guard import Guarded as Guarded, JaxsaneWarning as JaxsaneWarning, guard as guard

__all__ = [
    "CODES", "DataError", "Diagnosis", "Dump", "Experiment", "ExperimentError", "Finding", "GradCheckError",
    "Guarded", "JaxsaneError", "JaxsaneWarning", "NonFiniteError", "doctor", "guard", "load_dump", "save_dump",
]
