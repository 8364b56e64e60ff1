"""Findings: what a check found, with a stable code, a severity, where, and the fix; and the
:class:`RootCause` a consequence points to.

Nothing here runs inside ``jit``; findings are built on the host.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .codes import SEVERITY_RANK, severity_of
from .errors import FindingError


@dataclasses.dataclass(frozen=True)
class RootCause:
    """The root-cause finding a consequence points to: its ``code`` and its ``where`` string.

    Set by :func:`link_consequences` (a :class:`Diagnosis` links lazily). Not jit-safe.
    """

    code: str
    where: str = ""

    def __str__(self) -> str:
        return f"{self.code} ({self.where})" if self.where else self.code


@dataclasses.dataclass(frozen=True)
class Finding:
    """One diagnosis: a stable ``code``, a severity, a message, where, and a hint (the fix).

    ``caused_by`` names the root-cause finding when this one is a consequence of it (a NaN loss makes
    the gradient check fail). ``count`` is how many identical findings (same code, location and message
    but for the step number) were folded into this one; ``step`` is then the first of their steps and
    ``last_step`` the last. Not jit-safe: built on the host from concrete values.
    """

    code: str
    message: str
    hint: str = ""
    severity: str = ""
    path: str | None = None
    step: int | None = None
    file: str | None = None
    line: int | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    caused_by: RootCause | None = None
    count: int = 1
    last_step: int | None = None

    def __post_init__(self):
        if not self.severity:
            object.__setattr__(self, "severity", severity_of(self.code))
        if self.severity not in SEVERITY_RANK:
            raise FindingError(f"[jaxsane] severity must be one of {list(SEVERITY_RANK)}, got {self.severity!r}")
        if isinstance(self.caused_by, dict):  # read back from JSON
            object.__setattr__(self, "caused_by", RootCause(**self.caused_by))
        if self.caused_by is not None and not isinstance(self.caused_by, RootCause):
            raise FindingError(
                f"Finding.caused_by must be a RootCause(code, where) or None, got "
                f"{type(self.caused_by).__name__}; build it as RootCause(root.code, root.where)"
            )
        if int(self.count) < 1:
            raise FindingError(f"Finding.count must be >= 1, got {self.count}: it counts identical findings")

    @property
    def first_step(self) -> int | None:
        """The first step this finding was seen at (``step``; with ``count`` > 1, the earliest of them)."""
        return self.step

    @property
    def where(self) -> str:
        """Location as one string: step, pytree path, file:line (whichever are known)."""
        parts = []
        if self.step is not None:
            last = self.last_step if self.last_step is not None and self.last_step != self.step else None
            parts.append(f"steps {self.step}..{last}" if last is not None else f"step {self.step}")
        if self.path:
            parts.append(self.path)
        if self.file:
            from .frames import shown_location

            parts.append(shown_location(self.file, self.line))
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["extra"] = jsonable(self.extra)
        return d

    def headline(self) -> str:
        """``code (where) xN: message`` on one line, without the severity and the fix."""
        where = f" ({self.where})" if self.where else ""
        times = f" x{self.count}" if self.count > 1 else ""
        return f"{self.code}{where}{times}: {self.message}"

    def __repr__(self) -> str:
        from .display import finding_repr

        return finding_repr(self)

    def _repr_html_(self) -> str:
        from .display import finding_html

        return finding_html(self)

    def __str__(self) -> str:
        text = f"[{self.severity}] {self.headline()}"
        if self.hint:
            text += f"\n    fix: {self.hint}"
        return text


def ran_beside(finding: Finding) -> Finding:
    """``finding``, when it is a ``doctor.skipped``, marked ``extra["partial"]``: one check of a stage whose other
    checks ran, not a stage that could not apply (doctor lists such a stage as ran). Not jit-safe."""
    if finding.code != "doctor.skipped":
        return finding
    return dataclasses.replace(finding, extra={**(finding.extra or {}), "partial": True})


def jsonable(value: Any) -> Any:
    """Convert numpy/jax scalars and arrays, tuples and sets into JSON-able values."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "tolist"):
        return jsonable(value.tolist())
    return repr(value)
