"""The metric files of :func:`jaxsane.fit`: an append-only ``metrics.jsonl`` (fsync per batch of records,
replaced atomically at resume), optional TensorBoard scalars and a clu-style ``writer``. Nothing here is jit-safe."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from typing import Any

from .._core.errors import JaxsaneWarning
from .._core.frames import user_stacklevel
from .._core.history import History
from .._monitor.writers import write_scalars
from . import checkpoint as _ckpt


class MetricsLog:
    """Appends the History's new entries to a JSONL file (and TensorBoard), one record per line.

    Records: ``{"kind": "train", "step", "loss", ...}``, ``{"kind": "telemetry", "step", "param_norm",
    "update_norm"}``, ``{"kind": "grad", ...}``, ``{"kind": "dead", ...}``, ``{"kind": "eval", "step",
    "loss", ...}``. :func:`read_history` rebuilds a History from them.
    """

    _SERIES = (
        ("steps", "train"),
        ("tele_steps", "telemetry"),
        ("grad_steps", "grad"),
        ("dead_steps", "dead"),
        ("eval_steps", "eval"),
    )

    def __init__(
        self,
        path: str | None,
        tensorboard_dir: str | None,
        history: History,
        ckpt_dir: str | None = None,
        complete: Any = None,
        writer: Any = None,
    ):
        self.path, self.ckpt_dir, self.complete, self.writer = path, ckpt_dir, complete, writer
        self.written = {name: len(getattr(history, name)) for name, _ in self._SERIES}
        self.tb = _tensorboard_writer(tensorboard_dir) if tensorboard_dir else None

    def sync(self, h: History) -> None:
        """Append the records ``h`` gained since the last sync (flush + fsync); a failed write is a
        CheckpointError."""
        records = self.new_records(h)
        if self.path and records:
            try:
                _ckpt.append_lines(self.path, [_ckpt.dumps(rec) for rec in records])
            except OSError as e:
                raise _ckpt.disk_error(
                    e, f"metrics file {self.path}", self.ckpt_dir, self.complete() if self.complete else None
                ) from e
        if self.tb is not None:
            self._tensorboard(h, records)
        if self.writer is not None:  # a clu-style writer (fit(writer=...))
            write_scalars(self.writer, records, h.leaf_paths)

    def new_records(self, h: History) -> list[dict]:
        """The JSONL records of what ``h`` gained since the last call (and marks them written)."""
        records = []
        for i in range(self.written["steps"], len(h.steps)):
            rec = {"kind": "train", "step": h.steps[i], "loss": h.loss[i]}
            rec.update({k: v[i] for k, v in h.train_metrics.items() if i < len(v)})
            records.append(rec)
        for i in range(self.written["tele_steps"], len(h.tele_steps)):
            records.append(
                {
                    "kind": "telemetry",
                    "step": h.tele_steps[i],
                    "param_norm": h.param_norm[i],
                    "update_norm": h.update_norm[i],
                }
            )
        for i in range(self.written["grad_steps"], len(h.grad_steps)):
            records.append({"kind": "grad", "step": h.grad_steps[i], "grad_norm": h.grad_norm[i]})
        for i in range(self.written["dead_steps"], len(h.dead_steps)):
            records.append({"kind": "dead", "step": h.dead_steps[i], "dead_fraction": h.dead_fraction[i]})
        for i in range(self.written["eval_steps"], len(h.eval_steps)):
            rec = {"kind": "eval", "step": h.eval_steps[i], "loss": h.eval_loss[i]}
            rec.update({k: v[i] for k, v in h.eval_metrics.items() if i < len(v)})
            records.append(rec)
        self.written = {name: len(getattr(h, name)) for name, _ in self._SERIES}
        return records

    def _tensorboard(self, h: History, records: list[dict]) -> None:
        tb = self.tb
        if tb is None:
            return
        for rec in records:
            if rec["kind"] in ("train", "eval"):
                for k, v in rec.items():
                    if k not in ("kind", "step") and isinstance(v, (int, float)):
                        tb(f"{rec['kind']}/{k}", v, rec["step"])
            elif rec["kind"] == "grad":
                for j, v in enumerate(rec["grad_norm"]):
                    path = h.leaf_paths[j] if j < len(h.leaf_paths) else str(j)
                    tb(f"grad_norm/{path}", v, rec["step"])


def _tensorboard_writer(logdir: str) -> Callable[[str, Any, int], None] | None:
    """``(tag, value, step) -> None`` through tensorboardX / torch / tf when installed; else None and a warning."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            SummaryWriter = None
    if SummaryWriter is not None:
        writer = SummaryWriter(logdir)
        return lambda tag, value, step: writer.add_scalar(tag, value, step)
    try:
        import tensorflow as tf
    except ImportError:
        warnings.warn(
            "[jaxsane] fit(tensorboard_dir=...) needs tensorboardX, torch or tensorflow installed; "
            "writing JSONL metrics only.",
            JaxsaneWarning,
            stacklevel=user_stacklevel(),
        )
        return None
    writer = tf.summary.create_file_writer(logdir)

    def write(tag, value, step):
        with writer.as_default():
            tf.summary.scalar(tag, value, step=step)

    return write


def read_history(path: str, before: int | None = None) -> History:
    """Rebuild a :class:`History` from a ``metrics.jsonl`` written by :func:`fit`; keep steps ``< before``."""
    h = History()
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a crash
                continue
            kind, step = rec.pop("kind", None), rec.pop("step", None)
            if step is None or (before is not None and (step > before if kind == "eval" else step >= before)):
                continue
            nan = lambda v: float("nan") if v is None else v
            if kind == "train":
                h.steps.append(step)
                h.loss.append(nan(rec.pop("loss", None)))
                for k, v in rec.items():
                    h.train_metrics.setdefault(k, []).append(nan(v))
            elif kind == "telemetry":
                h.tele_steps.append(step)
                h.param_norm.append([nan(v) for v in rec["param_norm"]])
                h.update_norm.append([nan(v) for v in rec["update_norm"]])
            elif kind == "grad":
                h.grad_steps.append(step)
                h.grad_norm.append([nan(v) for v in rec["grad_norm"]])
            elif kind == "dead":
                h.dead_steps.append(step)
                h.dead_fraction.append([nan(v) for v in rec["dead_fraction"]])
            elif kind == "eval":
                h.eval_steps.append(step)
                h.eval_loss.append(nan(rec.pop("loss", None)))
                for k, v in rec.items():
                    h.eval_metrics.setdefault(k, []).append(nan(v))
    return h


def rewrite(path: str, h: History) -> None:
    """Replace ``path`` atomically by exactly ``h`` (drops what a crashed run logged past its checkpoint,
    restores what a deleted or truncated file lost); a kill leaves the old file or the new one."""
    records = MetricsLog(None, None, History()).new_records(h)
    _ckpt.replace_lines(path, [_ckpt.dumps(rec) for rec in records])
