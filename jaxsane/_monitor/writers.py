"""Metric writers: where :func:`jaxsane.fit` and :class:`jaxsane.Monitor` send scalars besides JSONL.

A writer is any object with clu's metric-writer protocol: ``write_scalars(step: int, scalars:
dict[str, float])`` and, optionally, ``flush()`` (so ``clu.metric_writers`` writers, a TensorBoard adapter
or a user's own wandb shim plug in). jaxsane depends on neither clu nor tensorflow: it only calls those
two methods. Tags: ``train/<metric>``, ``eval/<metric>``, ``grad_norm/<leaf path>``. Host-side only, not
jit-safe.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .._core.validate import fail


def require_writer(fn: str, writer: Any) -> Any:
    """``writer`` if it is None or has a callable ``write_scalars``, else an ``ArgumentError``."""
    if writer is None or (not isinstance(writer, type) and callable(getattr(writer, "write_scalars", None))):
        return writer
    cause = (
        "a TensorBoard SummaryWriter (add_scalar) rather than a clu-style writer"
        if hasattr(writer, "add_scalar")
        else "a writer class or factory passed instead of an instance"
        if isinstance(writer, type) or callable(writer)
        else "an object without the metric-writer protocol"
    )
    raise fail(
        fn,
        "writer",
        "None or an object with write_scalars(step, scalars) (clu's metric-writer protocol)",
        writer,
        cause=cause,
        fix="pass e.g. clu.metric_writers.create_default_writer(logdir), or wrap your logger in a class with "
        "write_scalars(self, step: int, scalars: dict) (and flush(self)); use tensorboard_dir= for "
        "TensorBoard",
    )


def scalars_of(records: Iterable[dict], leaf_paths: Sequence[str] = ()) -> list[tuple[int, dict[str, float]]]:
    """``[(step, {tag: value})]`` in step order from metric records (``{"kind", "step", ...}``, as in
    ``metrics.jsonl``): train and eval numbers, and per-leaf gradient norms."""
    by_step: dict[int, dict[str, float]] = {}
    for rec in records:
        kind, out = rec["kind"], by_step.setdefault(int(rec["step"]), {})
        if kind in ("train", "eval"):
            out.update(
                {
                    f"{kind}/{k}": float(v)
                    for k, v in rec.items()
                    if k not in ("kind", "step") and isinstance(v, (int, float)) and not isinstance(v, bool)
                }
            )
        elif kind == "grad":
            out.update(
                {
                    f"grad_norm/{leaf_paths[j] if j < len(leaf_paths) else j}": float(v)
                    for j, v in enumerate(rec["grad_norm"])
                }
            )
    return [(step, by_step[step]) for step in sorted(by_step) if by_step[step]]


def write_scalars(writer: Any, records: Iterable[dict], leaf_paths: Sequence[str] = ()) -> None:
    """Send ``records`` to ``writer`` one ``write_scalars`` call per step, then ``flush()`` when it has one."""
    rows = scalars_of(records, leaf_paths)
    for step, scalars in rows:
        writer.write_scalars(step, scalars)
    flush = getattr(writer, "flush", None)
    if rows and callable(flush):
        flush()
