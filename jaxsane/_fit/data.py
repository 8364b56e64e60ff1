"""fit's data side: the resumable train stream, the evaluator over fixed eval batches, the progress (a bar on a
terminal, plain lines in CI logs).

Host-side only (not jit-safe); the evaluator's loss and accuracy are jitted once each.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.errors import DataError
from .._core.tree import PyTree
from .._data.check import check_data
from .._experiment.batches import get_inputs, get_labels, is_batch, iter_batches
from .._experiment.contract import Experiment, PureExperiment

# ----------------------------------------------------------------------------- data and eval


def train_stream(data: Any, skip: int, repeat: bool) -> Iterator[tuple[int, Any]]:
    """``(data index, batch)`` pairs after the first ``skip`` (a deterministic iterator resumes exactly).
    With ``repeat`` the data is read again from its start each time it runs out (needs re-iterable data:
    a one-shot iterator ends the stream when its second pass yields nothing)."""
    index, passes = 0, 0
    while True:
        count, passes = 0, passes + 1
        try:
            for batch in iter_batches(data, None):
                count += 1
                if index >= skip:
                    yield index, batch
                index += 1
        except DataError:
            if passes == 1 or count:  # empty on a second pass: a one-shot iterator, ends the stream
                raise
        if not repeat or count == 0:
            return


def check_first_labels(experiment: Experiment, batch: Any, index: int) -> None:
    """Raise :class:`DataError` when the first train batch's labels are out of range (``data.label_range``:
    negative or ``>= num_classes`` integer ids that the Experiment's mask does not cover, float class
    labels, soft labels outside [0, 1]), before any step trains on them. Batches the data check cannot
    read as rows (graph batches, no labels) pass: the doctor's data stage says why. Not jit-safe."""
    try:
        found = check_data(
            batch,
            num_classes=experiment.num_classes,
            inputs=experiment.inputs,
            labels=experiment.labels,
            mask=experiment.mask,
            max_batches=1,
        )
    except DataError:
        return
    bad = [f for f in found.by_code("data.label_range") if f.severity == "error"]
    if bad:
        raise DataError(
            f"[jaxsane] fit: train batch {index} has labels out of range, so the loss would train on "
            f"wrong targets: {bad[0].message}\n  fix: {bad[0].hint}. An ignore index that the loss "
            "masks is fine once the Experiment declares the mask: Experiment(mask=lambda b: "
            "b['labels'] != -100) (with your batch's key)."
        )


class Evaluator:
    """Mean loss (and accuracy when ``apply`` and integer labels allow) over a fixed list of eval batches."""

    def __init__(self, adapted: PureExperiment, data: Any, max_batches: int):
        self.adapted = adapted
        self.batches = [data] if is_batch(data) else list(iter_batches(data, max_batches, "eval"))
        self.loss = jax.jit(adapted.loss_fn)
        self.acc = None
        apply = adapted.apply_fn
        if apply is not None:
            exp = adapted.experiment

            def accuracy(params, batch):
                logits, labels = apply(params, get_inputs(exp, batch)), get_labels(exp, batch)
                return jnp.mean((jnp.argmax(logits, -1) == labels).astype(jnp.float32))

            try:
                b = self.batches[0]
                labels = get_labels(exp, b)
                out = jax.eval_shape(apply, adapted.params(adapted.example_state), get_inputs(exp, b))
                if jnp.issubdtype(labels.dtype, jnp.integer) and out.ndim == labels.ndim + 1:
                    self.acc = jax.jit(accuracy)
            except Exception:
                self.acc = None

    def __call__(self, params: PyTree) -> dict[str, float]:
        losses = [self.loss(params, b) for b in self.batches]
        out = {"loss": float(np.mean(jax.device_get(losses)))}
        if self.acc is not None:
            out["accuracy"] = float(np.mean(jax.device_get([self.acc(params, b) for b in self.batches])))
        return out


def _clock(seconds: float) -> str:
    seconds = int(round(max(0.0, seconds)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """fit's progress on stderr: steps done, steps per second and the time left (both measured from the
    end of the first step, so compiling does not count), and the latest loss.

    On a terminal, a rich bar redrawn at most 10 times a second (fed every step, so it is never more than
    a second old); otherwise (CI logs) plain lines ``[jaxsane] fit NAME: step 40/200 (20%), 85.3 steps/s,
    ETA 0:00:02, loss 0.41``: after the first step, then every ``every_seconds`` or each tenth of the run
    (at most one a second), and a last one at the end. Nothing when disabled. Not jit-safe.
    """

    def __init__(
        self, enabled: bool, total: int, start: int, name: str, stream: Any = None, every_seconds: float = 30.0
    ):
        self.enabled, self.total, self.start, self.name = bool(enabled), int(total), int(start), name
        self.stream = stream if stream is not None else sys.stderr
        self.every = float(every_seconds)
        self.tty = self.enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.started = time.perf_counter()
        self.first: tuple[float, int] | None = None  # (time, steps) at the end of the first step
        self.drawn, self.completed, self.info = -1.0, int(start), ""
        self.bar = None
        self.lines = 0
        if self.tty:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn

            self.bar = Bar(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"),
                TextColumn("{task.fields[info]}"),
                console=Console(file=self.stream),
                transient=False,
                refresh_per_second=10,
            )
            self.task = self.bar.add_task(
                f"[jaxsane] fit {name}", total=total, completed=start, rate="compiling", info=""
            )
            self.bar.start()

    def rate(self, now: float | None = None) -> str:
        """``12.3 steps/s, ETA 0:01:05`` (after two steps; before that what is being waited for)."""
        now = time.perf_counter() if now is None else now
        if self.first is None:
            return "compiling the first step"
        t0, n0 = self.first
        if self.completed <= n0 or now <= t0:
            return f"first step {t0 - self.started:.1f} s"
        per = (self.completed - n0) / (now - t0)
        return f"{per:.3g} steps/s, ETA {_clock((self.total - self.completed) / per)}"

    def update(self, completed: int, info: Any = "") -> None:
        """Steps done so far; ``info`` a string or a callable returning one (called only when drawn)."""
        if not self.enabled:
            return
        now = time.perf_counter()
        previous, self.completed = self.completed, int(completed)
        if self.first is None and self.completed > self.start:
            self.first = (now, self.completed)
        if self.tty:
            if now - self.drawn >= 0.1 or self.completed >= self.total:
                self.drawn = now
                self.bar.update(
                    self.task, completed=self.completed, rate=self.rate(now), info=info() if callable(info) else info
                )
            return
        tenth = max(1, self.total // 10)
        crossed = self.completed // tenth != previous // tenth and now - self.drawn >= 1.0
        if self.drawn < 0 or now - self.drawn >= self.every or crossed:
            self.drawn = now
            self._line(now, info() if callable(info) else info)
        else:
            self.info = info

    def _line(self, now: float, info: str) -> None:
        pct = f" ({self.completed / self.total:.0%})" if self.total else ""
        extra = f", {info}" if info else ""
        self.stream.write(
            f"[jaxsane] fit {self.name}: step {self.completed}/{self.total}{pct}, {self.rate(now)}{extra}\n"
        )
        self.stream.flush()
        self.lines += 1

    def close(self, info: Any = "") -> None:
        if self.bar is not None:
            self.bar.stop()
        elif self.enabled and not self.tty and self.lines:
            info = info() if callable(info) else (info or (self.info() if callable(self.info) else self.info))
            wall = time.perf_counter() - self.started
            self.stream.write(
                f"[jaxsane] fit {self.name}: stopped at step {self.completed}/{self.total} after "
                f"{_clock(wall)}, {self.rate()}{', ' + info if info else ''}\n"
            )
            self.stream.flush()
