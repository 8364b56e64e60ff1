"""Run metadata for reports: the versions of jaxsane and the JAX libraries, the backend and its devices
(:func:`environment`), and what a run records about itself in ``Diagnosis.artifacts["meta"]`` (steps,
wall time, per-stage seconds, checkpoint directory, best step), merged by :func:`run_metadata`.
Host-side only (not jit-safe)."""

from __future__ import annotations

import functools
from typing import Any

PACKAGES = ("jaxsane", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "equinox")


@functools.lru_cache(maxsize=1)
def _versions() -> tuple:
    from importlib import metadata

    found = []
    for name in PACKAGES:
        try:
            found.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            if name == "jaxsane":
                from .. import __version__

                found.append((name, __version__))
    return tuple(found)


def environment() -> dict[str, Any]:
    """``{"versions": {package: version}, "backend", "devices": [...], "device_count", "process_count"}``
    (installed packages only; at most 8 devices by name)."""
    import jax

    devices = jax.devices()
    return {
        "versions": dict(_versions()),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in devices[:8]] + ([f"... {len(devices) - 8} more"] if len(devices) > 8 else []),
        "device_count": len(devices),
        "process_count": jax.process_count(),
    }


def run_metadata(artifacts: dict) -> dict[str, Any]:
    """What a report shows as the run's metadata: the run's own ``artifacts["meta"]``, doctor's stage
    seconds (``artifacts["timings"]``) when the run has none of its own, and :func:`environment`."""
    meta = dict(artifacts.get("meta") or {})
    if "timings" not in meta and artifacts.get("timings"):
        meta["timings"] = dict(artifacts["timings"])
    if "timings" in meta:
        meta["timings"] = {k: round(float(v), 3) for k, v in meta["timings"].items()}
    meta.update(environment())
    return meta
