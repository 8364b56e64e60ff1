"""Latent NaNs: gradients that are non-finite when the program is evaluated operation by operation (eager
mode, ``jax.debug_nans``, :func:`jaxsane.locate`'s replay) while XLA's compiled program happens to be finite.

The ``jnp.where(x > 0, jnp.log(x), 0.0)`` trap is the typical one: the untaken branch's derivative is
infinite and meets the ``where``'s zero cotangent, ``0 * inf = NaN``. Whether a compiled gradient shows
it depends on the backend and on how XLA fuses and rewrites the backward pass, so a finite compiled
gradient on one machine is no proof: the NaN is a bug waiting for another backend, another fusion or
eager mode. Here: which reports can be latent and how they are marked (``nonfinite.latent``, a warning).
NaNs of an untaken ``where`` branch in the FORWARD pass are not latent bugs: the replay masks them
away itself, and only a backward origin whose NaN the compiled program does not have is marked.

Host-side only, not jit-safe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .replay import flags
from .result import LocateReport, Origin

LATENT = "nonfinite.latent"
_LATENT_CAUSE = (
    "latent: the compiled gradient is finite on these inputs, but evaluated operation by operation (eager "
    "mode, jax.debug_nans, another backend or another XLA fusion) it is not; "
)


def latent_candidate(origins: Sequence[Origin]) -> bool:
    """Whether a replay's origins can be latent: there are some, and every one is born in the backward pass."""
    return bool(origins) and all(o.code == "nonfinite.backward" for o in origins)


def as_latent(report: LocateReport, replay_bad: Sequence[bool], compiled: Sequence[Any]) -> LocateReport:
    """``report`` marked latent when the compiled outputs are finite wherever the replay's are not (each origin
    becomes ``nonfinite.latent``, its cause says so, its line and fix stay); else ``report`` unchanged.

    Args:
      report: the replay's report (:func:`latent_candidate` origins).
      replay_bad: per output of the program, whether the replay made it non-finite.
      compiled: the compiled program's outputs, in the same order.
    """
    if any(bad and any(flags(out)) for bad, out in zip(replay_bad, compiled)):
        return report  # the compiled program has the NaN too: a real failure, not a latent one
    origins = [dataclasses.replace(o, code=LATENT, cause=_LATENT_CAUSE + o.cause) for o in report.origins]
    return dataclasses.replace(report, origins=origins, latent=True)
