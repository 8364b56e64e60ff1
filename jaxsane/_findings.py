"""Findings: what a check found, with a stable code, a severity, where, and the fix.

Codes are public API (see the README's table): a code never changes meaning once released.
Nothing here runs inside ``jit``; findings are built on the host.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable, Iterator, Sequence

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
    "step.no_update": (ERROR, "parameters are bitwise unchanged after a step",
                       "returning the old state, update not applied, learning rate 0"),
    "step.opt_state_frozen": (ERROR, "optimizer state is bitwise unchanged across steps",
                              "returning the initial optimizer state each step"),
    "step.rng_reused": (WARNING, "the step draws the same randomness every call",
                        "dropout key never split or advanced"),
    "step.recompiles": (WARNING, "the step is traced/compiled again on later calls",
                        "Python scalars as static args, changing shapes or dtypes"),
    "init.loss": (WARNING, "initial loss far from chance level (ln C for C classes)",
                  "over-confident logits, wrong init scale, wrong loss"),
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

    Not jit-safe: built on the host from concrete values.
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

    def __post_init__(self):
        if not self.severity:
            object.__setattr__(self, "severity", severity_of(self.code))
        if self.severity not in _SEVERITY_RANK:
            raise ValueError(f"[jaxsane] severity must be one of {list(_SEVERITY_RANK)}, got {self.severity!r}")

    @property
    def where(self) -> str:
        """Location as one string: step, pytree path, file:line (whichever are known)."""
        parts = []
        if self.step is not None:
            parts.append(f"step {self.step}")
        if self.path:
            parts.append(self.path)
        if self.file:
            parts.append(f"{self.file}:{self.line}" if self.line is not None else self.file)
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["extra"] = _jsonable(self.extra)
        return d

    def __str__(self) -> str:
        where = f" ({self.where})" if self.where else ""
        text = f"[{self.severity}] {self.code}{where}: {self.message}"
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


class Diagnosis(Sequence[Finding]):
    """An ordered list of :class:`Finding` with filters and renderers.

    ``artifacts`` holds results that reports can draw (overfit sweep, init-scale sweep,
    training history), keyed by stage name.
    """

    def __init__(self, findings: Iterable[Finding] = (), *, name: str = "",
                 artifacts: dict[str, Any] | None = None):
        self._findings: list[Finding] = list(findings)
        self.name = name
        self.artifacts: dict[str, Any] = dict(artifacts or {})

    def __getitem__(self, i):  # type: ignore[override]
        return self._findings[i]

    def __len__(self) -> int:
        return len(self._findings)

    def __iter__(self) -> Iterator[Finding]:
        return iter(self._findings)

    def __repr__(self) -> str:
        return f"Diagnosis(name={self.name!r}, findings={self._findings!r})"

    def add(self, *findings: Finding | Iterable[Finding]) -> "Diagnosis":
        """Append findings (single ones or iterables of them); returns self."""
        for f in findings:
            if isinstance(f, Finding):
                self._findings.append(f)
            else:
                self._findings.extend(f)
        return self

    @property
    def ok(self) -> bool:
        """True when there is no error finding."""
        return not self.errors

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self._findings if f.severity == ERROR]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self._findings if f.severity == WARNING]

    @property
    def codes(self) -> list[str]:
        """Distinct codes, in order of first appearance."""
        return list(dict.fromkeys(f.code for f in self._findings))

    def by_code(self, code: str) -> list[Finding]:
        """Findings whose code equals ``code`` or starts with ``code + '.'`` (``'data'`` matches all data.*)."""
        return [f for f in self._findings if f.code == code or f.code.startswith(code + ".")]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok,
                "counts": {s: sum(f.severity == s for f in self._findings) for s in _SEVERITY_RANK},
                "findings": [f.to_dict() for f in self._findings]}

    def to_json(self, path: str | None = None, **kwargs) -> str:
        """The JSON form; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2, **kwargs)
        if path is not None:
            with open(path, "w") as fh:
                fh.write(text + "\n")
        return text

    def sorted(self) -> list[Finding]:
        return sorted(self._findings, key=lambda f: _SEVERITY_RANK[f.severity])

    def __str__(self) -> str:
        head = f"jaxsane diagnosis{' of ' + self.name if self.name else ''}: "
        counts = self.to_dict()["counts"]
        head += ", ".join(f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts.items())
        return "\n".join([head, *(str(f) for f in self.sorted())])

    def render(self, console: Any = None) -> None:
        """Print to the terminal, with colour when ``rich`` is installed."""
        try:
            from rich.console import Console
            from rich.markup import escape
        except ImportError:  # pragma: no cover - rich is a dependency
            print(self)
            return
        console = console or Console()
        colour = {ERROR: "bold red", WARNING: "yellow", INFO: "cyan"}
        console.print(f"[bold]{escape(str(self).splitlines()[0])}[/bold]")
        for f in self.sorted():
            where = f" ({escape(f.where)})" if f.where else ""
            console.print(f"[{colour[f.severity]}]{f.severity:7}[/] [bold]{f.code}[/bold]{where}: "
                          f"{escape(f.message)}")
            if f.hint:
                console.print(f"         [green]fix:[/green] {escape(f.hint)}")
        if self.ok:
            console.print("[bold green]no errors[/bold green]")
