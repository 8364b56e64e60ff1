"""The dump format's constants: its version names, the load limits, and which dtypes are stored how.

Shared by ``_dump/save.py`` (writing) and ``_dump/dump.py`` (reading). No jax import.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FORMAT = "jaxsane-dump-v2"
READABLE = (FORMAT, "jaxsane-dump-v1")  # the formats a load accepts
MAX_BYTES = 4 * 2**30  # total uncompressed array bytes a load accepts by default
MAX_DEPTH = 100  # nesting depth of containers
MAX_NODES = 1_000_000  # containers + leaves
MAX_JSON_BYTES = 256 * 2**20
INT64_RANGE = (-(2**63), 2**63 - 1)
NATIVE_KINDS = "biufcUSmM"  # stored as themselves by numpy's .npy format without pickle
# ml_dtypes (bfloat16, float8_*, int4, ...) are stored as raw unsigned bytes of the same width and
# re-viewed on load; only dtypes from this table are ever re-viewed.
RAW_DTYPES = {
    np.dtype(t).name: np.dtype(t) for t in vars(ml_dtypes).values() if isinstance(t, type) and issubclass(t, np.generic)
}
PYTHON_SCALARS = {"bool": bool, "int": int, "float": float, "complex": complex}
