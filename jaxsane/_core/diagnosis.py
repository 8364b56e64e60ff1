"""A :class:`Diagnosis`: the findings of a run, linked into root causes and their consequences.

Host-side only, not jit-safe.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from .codes import ERROR, INFO, SEVERITY_RANK, WARNING
from .errors import FindingError
from .finding import Finding, jsonable
from .root_cause import link
from .run_meta import run_metadata

_STEP_WORD = re.compile(r"\b(step) \d+\b")


def _dedupe_key(f: Finding) -> tuple:
    """Same code, severity, location and message modulo the step number."""
    message = _STEP_WORD.sub(lambda m: m.group(1) + " #", f.message)
    if f.step is not None:
        message = re.sub(rf"(?<![\w.]){int(f.step)}(?![\w.])", "#", message)
    return (f.code, f.severity, f.path, f.file, f.line, message, f.hint)


def _merge(a: Finding, b: Finding) -> Finding:
    """One finding for two identical ones at different steps: the earliest's text, the total count."""
    steps = [s for s in (a.step, a.last_step, b.step, b.last_step) if s is not None]
    first = a if b.step is None or (a.step is not None and a.step <= b.step) else b
    return dataclasses.replace(
        first,
        count=a.count + b.count,
        step=min(steps) if steps else None,
        last_step=max(steps) if len(set(steps)) > 1 else None,
    )


class Diagnosis(Sequence[Finding]):
    """An ordered list of :class:`Finding` with filters and renderers, root causes first.

    ``add`` folds identical findings at many steps into one (``count``, first ``step``, ``last_step``).
    Reading the diagnosis (iterating, ``ok``, ``to_dict``, rendering) links consequences to their root
    cause (``link_consequences`` in ``_core/root_cause.py``): iteration yields every finding, in order, with
    ``caused_by`` set; renderings lead with the root causes and fold the consequences beneath them.

    ``ok`` and so the CLI's exit code are decided by root causes: a diagnosis is not ok when some root
    cause is an error, or has an error among its consequences (a warning root whose consequences are
    errors, e.g. a NaN ``init.loss`` that makes the overfit fail, still fails the gate, once). Counts in
    ``to_dict``/``str`` are of root causes, by that severity; ``to_dict()["consequences"]`` says how many
    findings were folded.

    ``artifacts`` holds results that reports can draw (overfit sweep, init-scale sweep,
    training history), keyed by stage name. Not jit-safe.
    """

    def __init__(self, findings: Iterable[Finding] = (), *, name: str = "", artifacts: dict[str, Any] | None = None):
        self._findings: list[Finding] = []
        self._keys: dict[tuple, int] = {}
        self._linked: tuple[list[Finding], list[int | None]] | None = None
        self.name = name
        self.artifacts: dict[str, Any] = dict(artifacts or {})
        self.add(findings)

    def _link(self) -> tuple[list[Finding], list[int | None]]:
        if self._linked is None:
            self._linked = link(self._findings)
        return self._linked

    @property
    def findings(self) -> list[Finding]:
        """Every finding in order of addition, consequences with ``caused_by`` set."""
        return self._link()[0]

    def __getitem__(self, i):
        return self.findings[i]

    def __len__(self) -> int:
        return len(self._findings)

    def __iter__(self) -> Iterator[Finding]:
        return iter(self.findings)

    def __repr__(self) -> str:
        from .display import diagnosis_repr

        return diagnosis_repr(self)

    def _repr_html_(self) -> str:
        from .display import diagnosis_html

        return diagnosis_html(self)

    def add(self, *findings: Finding | Iterable[Finding]) -> Diagnosis:
        """Append findings (single ones or iterables of them); returns self.

        A finding identical to one already here but for its step (same code, severity, location, hint
        and message modulo the step number) is folded into it: ``count`` grows, ``step`` stays the first.
        """
        for f in findings:
            for one in [f] if isinstance(f, Finding) else f:
                if not isinstance(one, Finding):
                    raise FindingError(
                        f"Diagnosis.add takes Finding objects (or iterables of them), got "
                        f"{type(one).__name__}; wrap results as jaxsane.Finding(code, message, hint)"
                    )
                key = _dedupe_key(one)
                at = self._keys.get(key)
                if at is None:
                    self._keys[key] = len(self._findings)
                    self._findings.append(one)
                else:
                    self._findings[at] = _merge(self._findings[at], one)
        self._linked = None
        return self

    # ------------------------------------------------------------------ root causes

    @property
    def root_causes(self) -> list[Finding]:
        """Findings that are no other finding's consequence, most severe first (by :meth:`severity_of`)."""
        findings, roots = self._link()
        order = [i for i, r in enumerate(roots) if r is None]
        sev = self._group_severity()
        order.sort(key=lambda i: SEVERITY_RANK[sev[i]])
        return [findings[i] for i in order]

    def consequences_of(self, root: Finding) -> list[Finding]:
        """The findings folded under ``root`` (a member of :attr:`root_causes`), in order of addition."""
        findings, roots = self._link()
        idx = self._index_of(root)
        return [f for f, r in zip(findings, roots) if r is not None and r == idx]

    @property
    def consequences(self) -> list[Finding]:
        """Every finding that is a consequence of another (``caused_by`` set)."""
        findings, roots = self._link()
        return [f for f, r in zip(findings, roots) if r is not None]

    def severity_of(self, root: Finding) -> str:
        """A root cause's severity with its consequences: the most severe of the root and what it caused."""
        return self._group_severity()[self._index_of(root)]

    def _index_of(self, finding: Finding) -> int:
        findings = self._link()[0]
        for i, f in enumerate(findings):
            if f is finding:
                return i
        for i, f in enumerate(findings):
            if f == finding:
                return i
        raise FindingError(f"{finding.code} is not a finding of this diagnosis; pass one of diagnosis.root_causes")

    def _group_severity(self) -> list[str]:
        findings, roots = self._link()
        sev = [f.severity for f in findings]
        for f, r in zip(findings, roots):
            if r is not None and SEVERITY_RANK[f.severity] < SEVERITY_RANK[sev[r]]:
                sev[r] = f.severity
        return sev

    # ------------------------------------------------------------------ filters

    @property
    def ok(self) -> bool:
        """True when no root cause is an error, counting each root's consequences with it."""
        findings, roots = self._link()
        sev = self._group_severity()
        return not any(r is None and sev[i] == ERROR for i, r in enumerate(roots))

    @property
    def errors(self) -> list[Finding]:
        """Every error finding, root causes and consequences alike."""
        return [f for f in self.findings if f.severity == ERROR]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == WARNING]

    @property
    def codes(self) -> list[str]:
        """Distinct codes, in order of first appearance."""
        return list(dict.fromkeys(f.code for f in self._findings))

    def by_code(self, code: str) -> list[Finding]:
        """Findings whose code equals ``code`` or starts with ``code + '.'`` (``'data'`` matches all data.*)."""
        return [f for f in self.findings if f.code == code or f.code.startswith(code + ".")]

    # ------------------------------------------------------------------ renderings

    def counts(self) -> dict[str, int]:
        """Root causes by severity (each counted with its consequences' worst severity)."""
        sev = self._group_severity()
        roots = self._link()[1]
        return {s: sum(r is None and sev[i] == s for i, r in enumerate(roots)) for s in SEVERITY_RANK}

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: ``root_causes`` (each with its ``consequences`` nested), the flat ``findings``, and
        the run's ``meta`` (versions, devices, steps, timings: see ``_core/run_meta.py``) when it has one."""
        return {
            "name": self.name,
            "ok": self.ok,
            "counts": self.counts(),
            "consequences": len(self.consequences),
            "root_causes": [
                {
                    **r.to_dict(),
                    "severity_with_consequences": self.severity_of(r),
                    "consequences": [c.to_dict() for c in self.consequences_of(r)],
                }
                for r in self.root_causes
            ],
            "findings": [f.to_dict() for f in self.findings],
            **(
                {"meta": jsonable(run_metadata(self.artifacts))}
                if "meta" in self.artifacts or "timings" in self.artifacts
                else {}
            ),
        }

    def to_json(self, path: str | None = None, **kwargs) -> str:
        """The JSON form; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2, **kwargs)
        if path is not None:
            with open(path, "w") as fh:
                fh.write(text + "\n")
        return text

    def sorted(self) -> list[Finding]:
        """Root causes most severe first, each followed by its consequences."""
        return [g for r in self.root_causes for g in (r, *self.consequences_of(r))]

    def headline(self) -> str:
        head = f"jaxsane diagnosis{' of ' + self.name if self.name else ''}: "
        head += ", ".join(f"{n} {s}{'s' if n != 1 else ''}" for s, n in self.counts().items())
        folded = len(self.consequences)
        if folded:
            head += f" (root causes; {folded} consequence{'s' if folded != 1 else ''} folded beneath them)"
        return head

    def __str__(self) -> str:
        lines = [self.headline()]
        for r in self.root_causes:
            lines.append(str(r))
            cons = self.consequences_of(r)
            if cons:
                lines.append(f"    consequences ({len(cons)}), fixed by fixing the cause above:")
                lines.extend(f"      - [{c.severity}] {c.headline()}" for c in cons)
        return "\n".join(lines)

    def render(self, console: Any = None) -> None:
        """Print to the terminal, root causes first with their consequences folded beneath, in colour."""
        try:
            from rich.console import Console
            from rich.markup import escape
        except ImportError:  # pragma: no cover - rich is a dependency
            print(self)
            return
        console = console or Console()
        colour = {ERROR: "bold red", WARNING: "yellow", INFO: "cyan"}
        console.print(f"[bold]{escape(self.headline())}[/bold]")
        for r in self.root_causes:
            sev = self.severity_of(r)
            where = f" ({escape(r.where)})" if r.where else ""
            times = f" x{r.count}" if r.count > 1 else ""
            console.print(f"[{colour[sev]}]{sev:7}[/] [bold]{r.code}[/bold]{where}{times}: {escape(r.message)}")
            if r.hint:
                console.print(f"         [green]fix:[/green] {escape(r.hint)}")
            cons = self.consequences_of(r)
            if cons:
                console.print(f"         [dim]consequences ({len(cons)}), fixed by fixing the cause above:[/dim]")
                for c in cons:
                    console.print(f"         [dim]- {c.severity} {escape(c.headline())}[/dim]")
        if self.ok:
            console.print("[bold green]no errors[/bold green]")
