"""Findings: what a check found, with a stable code, a severity, where, and the fix.

Codes are public API (see the README's table): a code never changes meaning once released.
Nothing here runs inside ``jit``; findings are built on the host.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Iterable, Iterator, Sequence

from .errors import FindingError
from .root_cause import RootCause as RootCause, link
from .run_meta import run_metadata

ERROR, WARNING, INFO = "error", "warning", "info"
_SEVERITY_RANK = {ERROR: 0, WARNING: 1, INFO: 2}

# code -> (default severity, what it means, typical causes)
CODES: dict[str, tuple[str, str, str]] = {
    "nonfinite.input": (ERROR, "the batch itself holds NaN/Inf", "corrupt data, bad preprocessing"),
    "nonfinite.forward": (ERROR, "loss/outputs go non-finite in the forward pass",
                          "log(0), log(softmax(x)), exp overflow, 0/0 in a masked mean, fp16 overflow"),
    "nonfinite.backward": (ERROR, "forward is finite, gradients are not",
                           "jnp.where over sqrt/log/arccos (double-where trap), norm or std at 0, "
                           "custom_vjp returning inf"),
    "nonfinite.update": (ERROR, "gradients finite, optimizer update or new state is not",
                         "fp16 Adam eps underflow, learning rate blow-up, division in a hand-written optimizer"),
    "grad.mismatch": (ERROR, "autodiff gradient disagrees with finite differences",
                      "wrong custom_vjp/custom_jvp rule, wrong sign, missing cotangent factor"),
    "grad.missing": (ERROR, "a trainable float leaf gets an identically zero gradient",
                     "lax.stop_gradient, unused parameter, dead branch, non-float leaf"),
    "grad.kink": (INFO, "leaves the gradient check could not judge: the point is a kink along the probed direction",
                  "ReLU/abs/clip/max exactly at 0 or at a tie: zero padding or zero-feature rows through a zero bias"),
    "grad.sampled": (INFO, "the gradient check ran on a random sample of the float leaves (a big model)",
                     "more float leaves than check_grads(max_leaves=128); pass max_leaves=None to check all"),
    "step.no_update": (ERROR, "parameters are bitwise unchanged after a step",
                       "returning the old state, update not applied, learning rate 0"),
    "step.opt_state_frozen": (ERROR, "optimizer state is bitwise unchanged across steps",
                              "returning the initial optimizer state each step"),
    "step.rng_reused": (WARNING, "the step draws the same randomness every call",
                        "dropout key never split or advanced"),
    "step.recompiles": (WARNING, "the step is traced/compiled again on later calls",
                        "Python scalars as static args, changing shapes or dtypes"),
    "init.loss": (WARNING, "initial loss far from chance level (ln C for C classes), or, for a loss that is not a "
                  "C-way cross-entropy, far above the best constant prediction's loss on the batch",
                  "over-confident logits, wrong init scale, outputs at another scale than the targets, wrong loss"),
    "init.scale": (WARNING, "activation scale grows or shrinks sharply through depth at init",
                   "weights too large/small for the activation"),
    "init.symmetric": (ERROR, "units in a layer are identical at init, so they can never differ",
                       "constant or zero initialisation"),
    "overfit.failed": (ERROR, "no tried configuration fits one small batch",
                       "bug in the model, loss, labels or step"),
    "model.ignores_input": (ERROR, "real inputs fit no better than constant inputs",
                            "input not wired in, stale global used as input"),
    "batch.cross_talk": (ERROR, "an example's output depends on another example's input (in eval mode)",
                         "softmax/mean over the batch axis, wrong reshape/transpose"),
    "data.label_range": (ERROR, "labels outside [0, num_classes)", "off-by-one labels, wrong num_classes"),
    "data.shape": (ERROR, "shapes/dtypes inconsistent, or a shape that silently broadcasts",
                   "(B, 1) predictions against (B,) targets"),
    "data.leakage": (ERROR, "evaluation examples also appear in the training split",
                     "split done after duplication, copied test rows"),
    "data.duplicates": (WARNING, "many duplicate examples inside one split",
                        "repeated shards, oversampling by copy"),
    "data.imbalance": (WARNING, "class frequencies extremely skewed", "sampling bug, wrong labels"),
    "data.all_padding": (ERROR, "examples whose mask is all padding", "empty sequences, tokenizer or packing bug"),
    "data.unnormalized": (WARNING, "input scale far from unit", "raw 0..255 pixels, unscaled features"),
    "data.constant": (WARNING, "an input feature or the whole input is constant",
                      "a preprocessing step that zeroes the input, a broken loader"),
    "data.empty": (ERROR, "a split (or a batch of it) has zero examples", "a filter that drops every row, an empty shard"),
    "data.masked_nonfinite": (INFO, "NaN/Inf in the data that the loss masks (the loss at init is finite on it)",
                              "-"),
    "data.partial": (INFO, "only a prefix of an endless or very long stream was checked", "-"),
    "data.outliers": (WARNING, "rows whose scale is orders of magnitude beyond the rest",
                      "unit or scaling errors, sentinel values such as -9999, corrupt records"),
    "data.unshifted_targets": (ERROR, "next-token targets equal the inputs, or the inputs shifted the wrong way",
                               "labels not shifted (targets = tokens), shift applied in the wrong direction"),
    "data.epoch": (INFO, "a stream starts over after k examples: read as one epoch, not as duplicates", "-"),
    "seq.future_leakage": (ERROR, "in a causal model, the output at position t depends on inputs after t",
                           "missing causal mask, mask on the wrong axis (triu for tril, transposed), "
                           "bidirectional layer"),
    "seq.padding_in_loss": (ERROR, "the loss depends on positions the mask marks as padding",
                            "a plain mean over all positions, the mask not applied to the loss, pads as targets"),
    "train.diverging": (ERROR, "loss rising without bound", "learning rate too high, gradient ascent"),
    "train.exploding_grads": (WARNING, "gradient norm grows by orders of magnitude",
                              "bad init, no clipping, lr too high"),
    "train.vanishing_grads": (WARNING, "early layers' gradients vanish relative to late ones",
                              "saturating activations, depth without normalisation"),
    "train.dead_units": (WARNING, "most ReLU units are never active", "large negative bias, lr too high"),
    "train.plateau": (WARNING, "loss flat from the start", "lr too low, frozen parameters"),
    "train.oscillating": (WARNING, "loss oscillates without trend", "lr too high"),
    "train.overfitting": (WARNING, "eval loss rises while train loss falls",
                          "too little data, leakage, mislabeled eval"),
    "train.update_ratio": (WARNING, "update/parameter norm ratio outside a sane band",
                           "learning rate too high or too low"),
    "dist.replica_divergence": (ERROR, "values that should be replicated differ across devices or processes",
                                "per-host seeds, missing gradient all-reduce"),
    "dist.nonfinite_shard": (ERROR, "non-finite values confined to some devices/processes",
                             "one host's data shard, one device's overflow"),
    "dist.hang": (ERROR, "a process stopped entering the step; the others wait for it in a collective",
                  "a data loader that blocks, a host that died, a branch only some processes take"),
    "doctor.user_code_crashed": (ERROR, "the user's own code (init, step, loss, apply, data) raised, so doctor "
                                 "could not check it", "a bug in the raising function, shown with its file:line"),
    "doctor.step_output": (ERROR, "the step returns no usable new state (e.g. only metrics), so it cannot train",
                           "returning only the loss or metrics, returning a differently structured state"),
    # info codes: context for the user, never a failure.
    "overfit.unsettled": (WARNING, "no configuration fits the batch yet, but the loss is still falling or settled "
                          "where it cannot be judged", "too few steps, a dominating regulariser, a too-small model"),
    "overfit.floor": (INFO, "the overfit loss converged to a floor above 0", "-"),
    "overfit.best": (INFO, "the best configuration of the overfit sweep", "-"),
    "overfit.no_lr_sweep": (INFO, "learning rates were not swept (optimizer lacks inject_hyperparams)", "-"),
    "overfit.budget": (INFO, "the sweep ran 1 seed: the model is too large for 2 in its budget", "-"),
    "doctor.skipped": (INFO, "a doctor stage was skipped because a handle it needs is missing", "-"),
    "nonfinite.xla_only": (INFO, "a non-finite value appears only in the compiled (XLA) program", "-"),
}


def severity_of(code: str) -> str:
    """The default severity of a finding code."""
    try:
        return CODES[code][0]
    except KeyError:
        raise KeyError(f"[jaxsane] unknown finding code {code!r}; known codes are in jaxsane.CODES") from None


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
        if self.severity not in _SEVERITY_RANK:
            raise ValueError(f"[jaxsane] severity must be one of {list(_SEVERITY_RANK)}, got {self.severity!r}")
        if isinstance(self.caused_by, dict):  # read back from JSON
            object.__setattr__(self, "caused_by", RootCause(**self.caused_by))
        if self.caused_by is not None and not isinstance(self.caused_by, RootCause):
            raise FindingError(f"Finding.caused_by must be a RootCause(code, where) or None, got "
                               f"{type(self.caused_by).__name__}; build it as RootCause(root.code, root.where)")
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
        d["extra"] = _jsonable(self.extra)
        return d

    def headline(self) -> str:
        """``code (where) xN: message`` on one line, without the severity and the fix."""
        where = f" ({self.where})" if self.where else ""
        times = f" x{self.count}" if self.count > 1 else ""
        return f"{self.code}{where}{times}: {self.message}"

    def __repr__(self) -> str:
        from .._render.reprs import finding_repr
        return finding_repr(self)

    def _repr_html_(self) -> str:
        from .._render.reprs import finding_html
        return finding_html(self)

    def __str__(self) -> str:
        text = f"[{self.severity}] {self.headline()}"
        if self.hint:
            text += f"\n    fix: {self.hint}"
        return text


def _jsonable(value: Any) -> Any:
    """Convert numpy/jax scalars and arrays, tuples and sets into JSON-able values."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "tolist"):
        return _jsonable(value.tolist())
    return repr(value)


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
    return dataclasses.replace(first, count=a.count + b.count, step=min(steps) if steps else None,
                               last_step=max(steps) if len(set(steps)) > 1 else None)


class Diagnosis(Sequence[Finding]):
    """An ordered list of :class:`Finding` with filters and renderers, root causes first.

    ``add`` folds identical findings at many steps into one (``count``, first ``step``, ``last_step``).
    Reading the diagnosis (iterating, ``ok``, ``to_dict``, rendering) links consequences to their root
    cause (:func:`jaxsane._core.root_cause.link_consequences`): iteration yields every finding, in order, with
    ``caused_by`` set; renderings lead with the root causes and fold the consequences beneath them.

    ``ok`` and so the CLI's exit code are decided by root causes: a diagnosis is not ok when some root
    cause is an error, or has an error among its consequences (a warning root whose consequences are
    errors, e.g. a NaN ``init.loss`` that makes the overfit fail, still fails the gate, once). Counts in
    ``to_dict``/``str`` are of root causes, by that severity; ``to_dict()["consequences"]`` says how many
    findings were folded.

    ``artifacts`` holds results that reports can draw (overfit sweep, init-scale sweep,
    training history), keyed by stage name. Not jit-safe.
    """

    def __init__(self, findings: Iterable[Finding] = (), *, name: str = "",
                 artifacts: dict[str, Any] | None = None):
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

    def __getitem__(self, i):  # type: ignore[override]
        return self.findings[i]

    def __len__(self) -> int:
        return len(self._findings)

    def __iter__(self) -> Iterator[Finding]:
        return iter(self.findings)

    def __repr__(self) -> str:
        from .._render.reprs import diagnosis_repr
        return diagnosis_repr(self)

    def _repr_html_(self) -> str:
        from .._render.reprs import diagnosis_html
        return diagnosis_html(self)

    def add(self, *findings: Finding | Iterable[Finding]) -> "Diagnosis":
        """Append findings (single ones or iterables of them); returns self.

        A finding identical to one already here but for its step (same code, severity, location, hint
        and message modulo the step number) is folded into it: ``count`` grows, ``step`` stays the first.
        """
        for f in findings:
            for one in ([f] if isinstance(f, Finding) else f):
                if not isinstance(one, Finding):
                    raise FindingError(f"Diagnosis.add takes Finding objects (or iterables of them), got "
                                       f"{type(one).__name__}; wrap results as jaxsane.Finding(code, message, hint)")
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
        order.sort(key=lambda i: _SEVERITY_RANK[sev[i]])
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
        raise FindingError(f"{finding.code} is not a finding of this diagnosis; pass one of "
                           "diagnosis.root_causes")

    def _group_severity(self) -> list[str]:
        findings, roots = self._link()
        sev = [f.severity for f in findings]
        for f, r in zip(findings, roots):
            if r is not None and _SEVERITY_RANK[f.severity] < _SEVERITY_RANK[sev[r]]:
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
        return {s: sum(r is None and sev[i] == s for i, r in enumerate(roots)) for s in _SEVERITY_RANK}

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: ``root_causes`` (each with its ``consequences`` nested), the flat ``findings``, and
        the run's ``meta`` (versions, devices, steps, timings: see :mod:`jaxsane._core.run_meta`) when it has one."""
        return {"name": self.name, "ok": self.ok, "counts": self.counts(), "consequences": len(self.consequences),
                "root_causes": [{**r.to_dict(), "severity_with_consequences": self.severity_of(r),
                                 "consequences": [c.to_dict() for c in self.consequences_of(r)]}
                                for r in self.root_causes],
                "findings": [f.to_dict() for f in self.findings],
                **({"meta": _jsonable(run_metadata(self.artifacts))}
                   if "meta" in self.artifacts or "timings" in self.artifacts else {})}

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
