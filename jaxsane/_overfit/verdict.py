"""The overfit verdict: did each configuration fit the batch as well as the batch allows?

A fixed "loss below 1% of its start" fails healthy models whose loss has a floor above zero: a
VAE's KL term, dropout, label smoothing, weight decay, or a batch whose examples are ambiguous
(the same input, or for a causal model the same prefix, with different targets). So a curve is
judged three ways, all on the host:

- against the batch's own ceiling: the best accuracy any model can reach on it
  (:func:`batch_ceiling`), so 95% is a fit when 5% of the targets contradict each other;
- by its trend: a loss that has fallen by at least half and flattened out has converged to a floor
  (verdict ``"floor"``), a loss that still falls at the end is ``"unsettled"`` (run longer), a loss
  that hardly moved ``"fails"``, one that falls without bound below zero is ``"unbounded"`` (a
  flipped sign);
- with named causes: outputs that are already probabilities (rows in [0, 1] summing to 1) fed to a
  loss that applies its own softmax cap the loss far above 0 even at 100% accuracy.

Everything here is host-side numpy. Not jit-safe.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._core.finding import Finding
from .._core.tree import PyTree, host_leaf
from .._experiment.batches import get_inputs, get_labels, get_mask

FLAT_DROP = 0.1  # a curve that fell by less than this fraction of |initial| "fails" (it hardly moved)
FLOOR_DROP = 0.5  # ... by at least this fraction and flat at the end: converged to a floor
SETTLED = 0.05  # flat at the end: the last window fell by at most this fraction of the total fall
UNBOUNDED = 10.0  # below zero and still falling past this many times |initial|: no lower bound


@dataclasses.dataclass(frozen=True)
class Ceiling:
    """What the batch allows: ``accuracy`` is the best per-target accuracy any model can reach
    (ambiguous targets: the same input, or the same prefix for sequences, with different labels);
    ``loss`` the matching cross-entropy floor in nats (mean entropy of the labels within each
    group of identical inputs); ``ambiguous`` the fraction of targets whose input is shared with
    a different label; ``kind`` ``"rows"`` or ``"prefixes"``."""

    accuracy: float
    loss: float
    ambiguous: float
    kind: str


def _row_keys(x: np.ndarray) -> np.ndarray:
    """One hashable byte string per row of ``x`` (the leading axis)."""
    rows = np.ascontiguousarray(x.reshape(x.shape[0], -1))
    return np.array([r.tobytes() for r in rows], dtype=object)


def _prefix_keys(tokens: np.ndarray) -> np.ndarray:
    """``[B, T]`` int tokens -> ``[B, T]`` uint64 hashes of each prefix ``tokens[b, :t+1]`` (polynomial
    rolling hash, collisions negligible at these sizes)."""
    t = tokens.astype(np.uint64) + np.uint64(1)
    out = np.empty(t.shape, np.uint64)
    h = np.zeros(t.shape[0], np.uint64)
    with np.errstate(over="ignore"):
        for j in range(t.shape[1]):
            h = h * np.uint64(1_000_003) + t[:, j]
            out[:, j] = h
    return out


def _group_stats(keys: list, labels: np.ndarray) -> tuple[float, float, float]:
    """(max-count accuracy, mean within-group label entropy, ambiguous fraction) over groups of keys."""
    groups: dict[Any, dict[int, int]] = {}
    for k, y in zip(keys, labels.tolist()):
        counts = groups.setdefault(k, {})
        counts[y] = counts.get(y, 0) + 1
    n = len(labels)
    best = entropy = ambiguous = 0.0
    for counts in groups.values():
        c = np.asarray(list(counts.values()), float)
        total = c.sum()
        best += c.max()
        p = c / total
        entropy += total * float(-(p * np.log(p)).sum())
        if len(c) > 1:
            ambiguous += total
    return best / n, entropy / n, ambiguous / n


def batch_ceiling(exp: Any, batch: PyTree) -> Ceiling | None:
    """The batch's accuracy ceiling and cross-entropy floor for integer class labels, or None when
    the batch has no integer labels aligned with its inputs. Sequence labels ``[B, T]`` beside integer
    inputs ``[B, T]`` are grouped by prefix (what a causal model sees at position t; for a model that
    sees the whole sequence the true ceiling is only higher, so this never asks too much); padding
    positions (the mask) are left out. Not jit-safe."""
    try:
        inputs = get_inputs(exp, batch)
        labels = get_labels(exp, batch)
    except Exception:
        return None
    x_leaves = jax.tree_util.tree_leaves(inputs)
    if len(x_leaves) != 1 or labels is None or not hasattr(labels, "shape"):
        return None
    x, y = host_leaf(x_leaves[0]), host_leaf(labels)
    if not np.issubdtype(y.dtype, np.integer) or x.ndim < 1 or y.ndim < 1 or x.shape[0] != y.shape[0]:
        return None
    if y.ndim == 1:
        acc, loss, amb = _group_stats(list(_row_keys(x)), y)
        return Ceiling(acc, loss, amb, "rows")
    if y.ndim == 2 and x.shape == y.shape and np.issubdtype(x.dtype, np.integer):
        mask = get_mask(exp, batch)
        keep = np.ones(y.shape, bool) if mask is None else np.asarray(host_leaf(mask)).astype(bool)
        if keep.shape != y.shape or not keep.any():
            return None
        pos = np.broadcast_to(np.arange(y.shape[1]), y.shape)
        keys = list(zip(pos[keep].tolist(), _prefix_keys(x)[keep].tolist()))
        acc, loss, amb = _group_stats(keys, y[keep])
        return Ceiling(acc, loss, amb, "prefixes")
    return None


def targets_follow_inputs(exp: Any, batch: PyTree, constant_batch: PyTree) -> str | None:
    """Why a constant-input baseline cannot judge this program, or None when it can: the baseline keeps
    the labels and replaces the inputs, which says nothing when the targets ARE the inputs (a language
    model's next tokens, an autoencoder's pixels). Not jit-safe."""
    try:
        labels = get_labels(exp, batch)
    except Exception:
        labels = None
    if labels is None:
        return (
            "the batch has no labels apart from its inputs (a language model's or an autoencoder's targets "
            "are its inputs), so constant inputs would also make constant targets"
        )
    try:
        constant_labels = get_labels(exp, constant_batch)
    except Exception:
        return "the labels cannot be read from the constant-input batch"
    same = all(
        np.array_equal(host_leaf(a), host_leaf(b))
        for a, b in zip(jax.tree_util.tree_leaves(labels), jax.tree_util.tree_leaves(constant_labels))
    )
    if not same:
        return (
            "the labels are computed from the inputs (replacing the inputs changes them), so constant inputs "
            "would also make constant targets"
        )
    return None


def normalised_outputs(apply: Callable | None, params: PyTree, inputs: PyTree) -> bool:
    """True when ``apply``'s outputs are already probabilities: every row in [0, 1] and summing to 1
    along the last axis (a softmax at the end of the model). Not jit-safe."""
    if apply is None:
        return False
    try:
        out = np.asarray(apply(params, inputs), np.float64)
    except Exception:
        return False
    if out.ndim < 1 or out.shape[-1] < 2 or not np.all(np.isfinite(out)):
        return False
    return bool(np.all(out >= -1e-6) and np.all(out <= 1 + 1e-6) and np.allclose(out.sum(-1), 1.0, atol=1e-3))


def loss_fit_without_accuracy(result: Any) -> str | None:
    """Why the accuracy cannot judge the sweep's fits, when a real configuration's loss reached the target
    (a mean cross-entropy that low classifies every example) while its accuracy, from apply's outputs, stayed
    below the accuracy target: apply runs in another mode than the loss. None otherwise. Not jit-safe."""
    if result.accuracy is None or result.target_accuracy is None:
        return None
    for i in result.real:
        curve = np.asarray(result.losses[i], np.float64)
        if curve[0] > 0 and np.any(curve <= result.target * curve[0]) and result.accuracy[i] < result.target_accuracy:
            return (
                f"the loss fell to {result.target:g} of its start while apply's outputs classify only "
                f"{result.accuracy[i]:.0%} of the same batch: apply runs in another mode than the loss (BatchNorm "
                "running statistics, dropout) or the loss is not a cross-entropy of its outputs, so the fit is "
                "judged by the loss alone"
            )
    return None


def curve_verdict(losses: np.ndarray, reached: bool) -> str:
    """One configuration's loss curve judged by its trend. Not jit-safe.

    ``"fits"`` (reached the target), ``"floor"`` (fell by at least half and flattened), ``"high_floor"``
    (flattened after falling by less than half), ``"unsettled"`` (still falling at the end), ``"fails"``
    (hardly moved), ``"unbounded"`` (below zero and still falling far past its start) or
    ``"diverged"`` (non-finite)."""
    losses = np.asarray(losses, np.float64)
    if not np.all(np.isfinite(losses)):
        return "diverged"
    if reached:
        return "fits"
    n = len(losses)
    w = max(1, n // 10)
    initial, end = losses[0], float(np.median(losses[-w:]))
    before = float(np.median(losses[-2 * w : -w])) if n >= 2 * w + 1 else initial
    fall, recent = initial - end, before - end
    scale = max(abs(initial), 1e-12)
    settled = recent <= SETTLED * max(fall, 0.0) + 1e-9 * scale
    if end < 0 and not settled and end < min(initial, 0.0) - UNBOUNDED * scale:
        return "unbounded"
    if fall < FLAT_DROP * scale:
        return "fails"
    if settled:
        return "floor" if fall >= FLOOR_DROP * scale else "high_floor"
    return "unsettled"


def judge(
    result: Any,
    *,
    ceiling: Ceiling | None,
    baseline_reason: str | None,
    normalised: Callable[[], bool],
    ignores_input_ratio: float,
    accuracy_mismatch: str | None = None,
) -> tuple[tuple[str, ...], list[Finding]]:
    """Verdicts per configuration and the sweep's findings (``overfit.failed``, ``overfit.unsettled``,
    ``overfit.floor``, ``model.ignores_input``, ``overfit.best``, and ``doctor.skipped`` when the
    constant-input baseline cannot judge the program). ``normalised()`` says whether the model's outputs are
    already probabilities (:func:`normalised_outputs`); it runs (once) only when a verdict depends on it, as
    it runs the model. Not jit-safe."""
    normalised = functools.lru_cache(maxsize=1)(normalised)
    verdicts = tuple(
        "baseline" if c.baseline else curve_verdict(result.losses[i], bool(result.reached[i]))
        for i, c in enumerate(result.configs)
    )
    sweep = _Judged.of(result, verdicts, ceiling, accuracy_mismatch)
    real = result.real
    fitting = [i for i in real if verdicts[i] in ("fits", "floor")]
    out: list[Finding] = []
    if not sweep.fell_by_half() and normalised():
        fitting = []
        out.append(
            sweep.failed(
                f"the model's outputs are already probabilities (every row in [0, 1] and summing to 1), and the loss "
                f"cannot fall: {sweep.curve}",
                "return logits from the model (drop its final softmax/sigmoid) or use a loss that takes probabilities "
                "(e.g. the negative log of the probability of the label), not one that applies softmax again",
            )
        )
    elif not fitting and len(real):
        out.append(sweep.none_fit())
    # outputs that are already probabilities fit no batch, real or constant: the baseline says nothing then
    if result.baseline is not None and not fitting and len(real) and not normalised():
        out += sweep.ignores_input(ignores_input_ratio)
    if baseline_reason is not None:
        out.append(Finding("doctor.skipped", f"model.ignores_input not judged: {baseline_reason}", ""))
    if verdicts[sweep.best] == "floor":
        out.append(sweep.floor())
    out.append(sweep.best_finding(len(fitting)))
    return verdicts, out


STILL_AHEAD = 0.9
"""A best real curve still falling at the end, or flat on a floor, below this fraction of the constant-input
baseline's final loss uses its input: ``model.ignores_input`` is not claimed (a model that ignores its input ends
where the baseline does, 1.0x on the fault zoo's)."""


@dataclasses.dataclass(frozen=True)
class _Judged:
    """A sweep's curves with their verdicts and best configuration, and the texts its findings share."""

    result: Any
    verdicts: tuple[str, ...]
    ceiling: Ceiling | None
    best: int
    curve: str  # the best configuration's curve, in words
    acc_text: str
    ceiling_text: str

    @classmethod
    def of(
        cls, result: Any, verdicts: tuple[str, ...], ceiling: Ceiling | None, mismatch: str | None = None
    ) -> _Judged:
        losses = result.losses
        best = best_configuration(result, verdicts)
        accuracy = result.accuracy
        acc_text = "" if accuracy is None else f", accuracy {accuracy[best]:.0%}"
        if accuracy is not None and mismatch is not None:  # say which: the fit is the loss's, the accuracy apply's
            acc_text = f" (judged by the loss); apply's accuracy {accuracy[best]:.0%}, not judged: {mismatch}"
        ceiling_text = ""
        if ceiling is not None and ceiling.ambiguous > 0:
            ceiling_text = (
                f"; the batch allows at most {ceiling.accuracy:.0%} accuracy and a cross-entropy of "
                f"{ceiling.loss:.3g} ({ceiling.ambiguous:.0%} of its targets share their input"
                + (" prefix" if ceiling.kind == "prefixes" else "")
                + " with a different label)"
            )
        cfg = result.configs[best]
        curve = f"{cfg.label()} went from loss {losses[best, 0]:.4g} to {losses[best, -1]:.4g}{acc_text}"
        return cls(result, verdicts, ceiling, best, curve, acc_text, ceiling_text)

    @property
    def extra(self) -> dict:
        losses, best = self.result.losses, self.best
        return {"best": best, "initial": float(losses[best, 0]), "final": float(losses[best, -1])}

    def fell_by_half(self) -> bool:
        """Whether a real configuration's loss fell to at most half its (positive) start."""
        losses = self.result.losses
        return any(
            losses[i, 0] > 0 and losses[i, -1] <= (1 - FLOOR_DROP) * losses[i, 0]
            for i in self.result.real
            if np.isfinite(losses[i, -1])
        )

    def failed(self, message: str, hint: str) -> Finding:
        return Finding("overfit.failed", message, hint, extra=self.extra)

    def none_fit(self) -> Finding:
        """Why no real configuration fits: all diverged, a loss without bound, still falling, or failed."""
        result, real, curve = self.result, self.result.real, self.curve
        kinds = {self.verdicts[i] for i in real}
        if kinds == {"diverged"}:
            return self.failed(
                f"every one of {len(real)} configurations diverged (non-finite loss) on one batch "
                f"of {result.batch_size} examples",
                "lower the learning rate, check the loss for log(0) or division by zero; jaxsane.locate names the "
                "operation",
            )
        if "unbounded" in kinds:
            return self.failed(
                f"the loss falls without bound instead of fitting: {curve}",
                "a loss is minimised: check its sign (the negative of a cross-entropy or likelihood is maximised by "
                "descent), or a term that can grow without limit",
            )
        if kinds & {"unsettled"} or (kinds & {"high_floor"} and result.accuracy is None):
            return Finding(
                "overfit.unsettled",
                f"no configuration fits one batch of {result.batch_size} examples yet in {result.steps_run} "
                f"steps, but the loss is still falling or has settled where the sweep cannot judge it: {curve}"
                f"{self.ceiling_text}",
                "run overfit(..., steps=...) longer (or doctor -o overfit_steps=...); a loss that settles far "
                "above 0 points at a regulariser that dominates it, a too-small model, or a loss the outputs "
                "cannot reach",
                extra=self.extra,
            )
        target_text = f"loss <= {result.target:g} x initial" + (
            "" if result.target_accuracy is None else f" or accuracy >= {result.target_accuracy:.0%}"
        )
        return self.failed(
            f"none of {len(real)} configurations fit one batch of {result.batch_size} examples in "
            f"{result.steps_run} steps (target: {target_text}); best: {curve}{self.ceiling_text}",
            "a healthy model memorises a tiny batch: check that the loss uses the batch's own labels (aligned "
            "with the inputs), that the step returns the UPDATED state (or applies the optimizer update), "
            "that gradients reach the parameters, and try other learning rates (optax.inject_hyperparams) "
            "or init scales",
        )

    def ignores_input(self, ratio: float) -> list[Finding]:
        """``model.ignores_input`` when the best real final loss is above ``ratio`` x the baseline's, unless that
        best curve is still falling at the end or flattened on a floor, below ``STILL_AHEAD`` x the baseline's (a
        loss whose floor is far above 0, softmax cross-entropy over multi-hot labels, never gets within ``ratio``)."""
        losses, real, b = self.result.losses, self.result.real, self.result.baseline
        finite = losses[real, -1][np.isfinite(losses[real, -1])]
        real_final = float(finite.min()) if finite.size else float("inf")
        base_final = float(losses[b, -1])
        rel = np.abs(losses[:, -1] - losses[:, 0]) / np.maximum(np.abs(losses[:, 0]), 1e-12)
        rel = rel[~np.isnan(rel)]  # every loss NaN: nothing moved (np.nanmax would warn "All-NaN slice")
        moved = rel.max() if rel.size else np.nan
        if not (np.isfinite(base_final) and real_final > ratio * base_final and moved > 1e-3):
            return []
        best = [int(i) for i in np.arange(len(losses))[real] if losses[i, -1] == real_final]
        if best and self.verdicts[best[0]] in ("unsettled", "high_floor") and real_final < STILL_AHEAD * base_final:
            return []  # clearly ahead of the constant inputs, on a loss that has a floor or still falls: input matters
        return [
            Finding(
                "model.ignores_input",
                f"real inputs fit no better than constant inputs: best real final loss {real_final:.4g} vs "
                f"{base_final:.4g} with every input replaced by the batch mean (threshold: real < "
                f"{ratio:g} x constant)",
                "the model's output does not depend on its input: check that the input is wired into the "
                "forward pass (not a stale global, a zeroed or detached tensor, a wrong batch key), and that "
                "the labels belong to these inputs",
                extra={"real_final": real_final, "constant_final": base_final},
            )
        ]

    def floor(self) -> Finding:
        losses, best = self.result.losses, self.best
        return Finding(
            "overfit.floor",
            f"the loss converged to a floor of {losses[best, -1]:.4g} ({losses[best, -1] / losses[best, 0]:.1%} of "
            f"its start) rather than 0{self.ceiling_text}",
            "expected when the loss has a floor: a KL term, dropout, label smoothing, weight decay in the loss, "
            "or ambiguous examples; otherwise compare with a run without them",
            extra={"floor": float(losses[best, -1])},
        )

    def best_finding(self, fits: int) -> Finding:
        """``overfit.best``: the best configuration and how many of the real ones fit."""
        result, best, ceiling = self.result, self.best, self.ceiling
        cfg = result.configs[best]
        lr_text = "the step's own rate" if cfg.learning_rate is None else f"{cfg.learning_rate:.3g}"
        if getattr(cfg, "update_scale", None) is not None:
            lr_text = f"the step's own rate with its updates scaled by {cfg.update_scale:g}"
        status = {"fits": f"fits at step {result.reached_at[best]}", "floor": "converged to a floor"}.get(
            self.verdicts[best], f"does not fit (loss ratio {_ratio(result.losses[best]):.3g})"
        )
        return Finding(
            "overfit.best",
            f"best configuration: learning rate {lr_text}, init scale {cfg.init_scale:g}, seed {cfg.seed}: {status}"
            f"{self.acc_text}; {fits}/{len(result.real)} configurations fit",
            "",
            extra={
                "learning_rate": cfg.learning_rate,
                "update_scale": getattr(cfg, "update_scale", None),
                "init_scale": cfg.init_scale,
                "seed": cfg.seed,
                "reached_at": int(result.reached_at[best]),
                "fits": fits,
                "ceiling_accuracy": None if ceiling is None else ceiling.accuracy,
            },
        )


def _ratio(losses: np.ndarray) -> float:
    r = losses[-1] / losses[0] if losses[0] != 0 else float("nan")
    return float(r) if np.isfinite(r) else float("inf")


def best_configuration(result: Any, verdicts: tuple[str, ...]) -> int:
    """The best real configuration: earliest to reach the target, else the lowest loss relative to
    its start among the finite ones."""
    real = result.real
    if len(real) == 0:
        return 0
    fits = [i for i in real if result.reached[i]]
    if fits:
        return int(min(fits, key=lambda i: (result.reached_at[i], _ratio(result.losses[i]))))
    rank = {"floor": 0, "high_floor": 1, "unsettled": 1, "fails": 2, "unbounded": 3, "diverged": 4}
    return int(min(real, key=lambda i: (rank.get(verdicts[i], 2), _ratio(result.losses[i]))))
