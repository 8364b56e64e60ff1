"""The report of :func:`jaxsane.locate`: :class:`LocateReport`, its :class:`Origin` entries and what the
replay held at each origin (:class:`OriginContext`, read by the debugger, ``debugger.py``).

Host-side records, not jit-safe.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._core.finding import Finding
from .._core.frames import display_location


@dataclasses.dataclass
class OriginContext:
    """The replay's values at an origin, kept (by reference, no copies) for :func:`jaxsane.post_mortem`.

    Attributes:
      primitive, params: the failing equation's primitive name and parameters.
      operands, results: its input and output values (host arrays; under ``shard_map`` the mesh axes lead).
      chain: the user's frames of the call chain that made it, outermost first, as
        ``(file, line, function, function start line)``.
      primal: for a backward origin, ``(primitive, operands, results)`` of the forward equation whose
        derivative blew up (e.g. the ``sqrt`` at 0), when the replay holds it.
      iterations: ``[(loop, index)]`` of the ``scan``/``while`` iterations around it, outermost first.
      inputs: the traced function's input leaves by path (``batch['x']``), set by ``locate``.
      call: ``(fn, args, kwargs)`` as passed to ``locate``.
    """

    primitive: str
    params: dict
    operands: list
    results: list
    chain: list
    primal: tuple | None = None
    iterations: list = dataclasses.field(default_factory=list)
    inputs: dict = dataclasses.field(default_factory=dict)
    call: Any = None

    def __repr__(self) -> str:
        return f"OriginContext({self.primitive}, {len(self.operands)} operands, {len(self.chain)} user frames)"


@dataclasses.dataclass(frozen=True)
class Origin:
    """One place where a non-finite value that reaches the outputs is born.

    Attributes:
      code: ``nonfinite.forward`` / ``.backward`` / ``.update`` / ``.input`` / ``.literal`` (a non-finite
        constant of the program returned as is; its phase says which pass returns it) / ``.latent`` (a backward
        origin the compiled program does not show, see :attr:`LocateReport.latent`).
      primitive: the jaxpr primitive that produced it (``"input"`` for a bad argument, ``"literal"`` for a
        constant).
      phase: ``forward``, ``backward``, ``update`` or ``input``.
      file, line, source: the user's own frame and its source text.
      name_stack: the jaxpr name stack (``jvp()``, ``transpose(jvp())``, ...).
      values: what produced it, e.g. ``sqrt'(0.0) -> inf``.
      cause, fix: the likely cause and what to change.
      reaches: the output leaf paths it flows into.
      where: extra coordinates (scan iteration, shard, batch index under vmap).
      context: the replay's values there (:class:`OriginContext`, for :func:`jaxsane.post_mortem`; None for
        a non-finite input); not compared, not in the repr.
    """

    code: str
    primitive: str
    phase: str
    file: str | None
    line: int | None
    source: str
    name_stack: str
    values: str
    cause: str
    fix: str
    reaches: list[str]
    where: list[str] = dataclasses.field(default_factory=list)
    then: str = ""
    context: OriginContext | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def location(self) -> str:
        """``file:line`` of the origin. Not jit-safe (host-side record)."""
        return display_location(self.file, self.line)

    def summary(self) -> str:
        """One line: code, primitive, phase, file:line and the values. Not jit-safe."""
        where = f" [{', '.join(self.where)}]" if self.where else ""
        return f"{self.code}: {self.primitive} ({self.phase}) at {self.location}{where}: {self.values}"

    def render(self) -> str:
        """The origin as the indented lines of a report (origin, values, cause, fix). Not jit-safe."""
        lines = [
            f"  origin: {self.primitive} ({self.phase}) at {self.location}"
            + (f"   {self.source}" if self.source else "")
        ]
        if self.where:
            lines.append(f"    where: {', '.join(self.where)}")
        if self.name_stack:
            lines.append(f"    name stack: {self.name_stack}")
        lines.append(f"    values: {self.values}")
        if self.then:
            lines.append(f"    then: {self.then}")
        if self.reaches:
            more = f" and {len(self.reaches) - 6} more" if len(self.reaches) > 6 else ""
            shown = ", ".join(self.reaches[:6]) + more
            lines.append(f"    reaches: {shown}")
        lines.append(f"    cause: {self.cause}")
        lines.append(f"    fix: {self.fix}")
        return "\n".join(lines)

    def to_finding(self) -> Finding:
        """The origin as a :class:`jaxsane.Finding`. Not jit-safe."""
        return Finding(
            self.code,
            f"{self.primitive} ({self.phase}) at {self.location} produced a non-finite value: "
            f"{self.values}; {self.cause}",
            self.fix,
            path=self.reaches[0] if self.reaches else None,
            file=self.file,
            line=self.line,
            extra={
                "primitive": self.primitive,
                "phase": self.phase,
                "reaches": list(self.reaches),
                "name_stack": self.name_stack,
                "where": list(self.where),
                "source": self.source,
            },
        )


_NO_ORIGIN = (
    "the equation-by-equation replay is non-finite too, but no equation, constant or input could be named as "
    "the origin (a primitive the replay runs whole)"
)


_LATENT_TEXT = (
    "the compiled program's outputs are finite on these inputs, but replayed operation by operation (as eager "
    "mode, jax.debug_nans and other backends or fusions compute them) they are not: a bug waiting to fire"
)


@dataclasses.dataclass(frozen=True)
class LocateReport:
    """What :func:`locate` found. ``origins[0]`` is the root cause; ``str(report)`` renders it all.

    Attributes:
      origins: every origin found, earliest first.
      bad_outputs: ``[(path, n_nan, n_inf)]`` for each non-finite output leaf.
      xla_only: True when the de-optimized replay is finite but the compiled program is not.
      latent: True for the converse in the backward pass: the compiled outputs are finite, the replay's
        gradients are not (eager mode and other backends or fusions give NaN); origins are ``nonfinite.latent``.
      prefix: for ``xla_only``, the smallest compiled prefix (number of equations) that reproduces it.
      prefix_at: the primitive and file:line of that prefix's last equation.
      equations: how many equations the replay executed.
    """

    origins: list[Origin]
    bad_outputs: list[tuple[str, int, int]]
    xla_only: bool = False
    latent: bool = False
    prefix: int | None = None
    prefix_total: int | None = None
    prefix_at: str = ""
    equations: int = 0

    def findings(self) -> list[Finding]:
        """One :class:`jaxsane.Finding` per origin (or one naming the non-finite outputs). Not jit-safe."""
        if self.origins:
            return [o.to_finding() for o in self.origins]
        paths = [p for p, _, _ in self.bad_outputs]
        return [
            Finding(
                "nonfinite.forward",
                f"non-finite outputs {', '.join(paths[:4])}: {self._xla_text() if self.xla_only else _NO_ORIGIN}",
                "run the step without jit (jax.disable_jit()) or with XLA_FLAGS=--xla_cpu_enable_fast_math="
                "false / --xla_gpu_enable_fast_min_max=false to confirm; check the reported prefix",
                path=paths[0] if paths else None,
                extra={"xla_only": self.xla_only, "prefix": self.prefix},
            )
        ]

    def _xla_text(self) -> str:
        text = "not reproduced outside XLA: the equation-by-equation replay is finite but the compiled program is not"
        if self.prefix is not None:
            text += (
                f"; the smallest compiled prefix that produces it has {self.prefix} of {self.prefix_total} "
                f"equations, ending with {self.prefix_at}"
            )
        elif self.xla_only:
            text += "; no compiled prefix reproduced it (XLA optimises the prefixes differently)"
        return text

    def summary(self) -> str:
        """One line: the first origin's summary (or why there is none). Not jit-safe."""
        if self.origins:
            return self.origins[0].summary()
        return self._xla_text() if self.xla_only else _NO_ORIGIN

    def __str__(self) -> str:
        outs = ", ".join(f"{p} ({n} NaN, {i} Inf)" for p, n, i in self.bad_outputs[:6])
        more = f" and {len(self.bad_outputs) - 6} more" if len(self.bad_outputs) > 6 else ""
        lines = [f"[jaxsane] locate: non-finite outputs {outs}{more}"]
        if self.latent:
            lines[0] = f"[jaxsane] locate: latent non-finite outputs {outs}{more}"
            lines.append("  " + _LATENT_TEXT)
        if self.xla_only:
            lines.append("  " + self._xla_text())
        elif not self.origins:
            lines.append("  " + _NO_ORIGIN)
        for k, o in enumerate(self.origins):
            if k == 1:
                lines.append(f"  {len(self.origins) - 1} further origin(s):")
            lines.append(o.render())
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"LocateReport({self.summary()!r})"

    def _repr_html_(self) -> str:
        from .._render.reprs import locate_html

        return locate_html(self)
