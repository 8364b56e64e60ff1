"""fit's loss-spike watch: when the loop verifies its steps, the losses recorded since the last verified state
are judged by the ``train.loss_spike`` rule; a spiking step gets its forensics (``_monitor/spike_forensics``)
from the state just before it (the verified snapshot, replayed up to the spike with the bare step) and its
batch (dumped under ``dump_dir``), and, with ``on_spike="rollback"``/``"skip"``, the loop rolls back and skips
that batch. Host-side, not jit-safe.
"""

from __future__ import annotations

import inspect
from typing import Any

from .._core.finding import Finding
from .._monitor.monitor import MODE_BARE
from .._monitor.precision_checks import spike_steps
from .._monitor.spike_forensics import explain_spike, keep_batch
from .._monitor.train_checks import check_training


class SpikeRollback(Exception):  # noqa: N818 - a control-flow signal inside the loop, never seen by users
    """Raised inside the loop to roll back a spiking step (data position ``position``)."""

    def __init__(self, position: int):
        super().__init__(position)
        self.position = position


def _spike_thresholds(thresholds: dict | None) -> dict[str, Any]:
    """``check_training``'s ``spike_*`` thresholds with their defaults, overridden by ``fit(thresholds=...)``."""
    defaults = {k: p.default for k, p in inspect.signature(check_training).parameters.items() if k.startswith("spike_")}
    given = {k: v for k, v in (thresholds or {}).items() if k in defaults}
    t = {**defaults, **given}
    return {
        "window": t["spike_window"],
        "k": t["spike_k"],
        "rel": t["spike_rel"],
        "min_history": t["spike_min_history"],
    }


class SpikeWatch:
    """The spike rule run on the steps a loop verifies, and the forensics of each spike. Not jit-safe."""

    def __init__(self, policy: str, thresholds: dict | None, dump_dir: str | None):
        self.policy = policy
        self.rolls_back = policy in ("rollback", "skip")
        self.limits = _spike_thresholds(thresholds)
        self.dump_dir = dump_dir
        self.seen: set[int] = set()  # data positions already explained

    def find(self, loop: Any) -> int | None:
        """Judge the steps consumed since the last verified state; add a forensic finding per new spike to the
        loop's diagnosis and return the data position to roll back (None: nothing to undo)."""
        consumed = dict(loop.consumed)
        if not consumed:
            return None
        h = loop.monitor.pull()
        first = min(consumed)
        start = next((k for k, s in enumerate(h.steps) if s >= first), len(h.steps))
        lo = max(0, start - int(self.limits["window"]))
        for k, value, level in spike_steps(h.loss[lo:], **self.limits):
            position = h.steps[lo + k]
            if position not in consumed or position in self.seen:
                continue
            self.seen.add(position)
            loop.diagnosis.add(self.explain(loop, position, consumed[position], value, level))
            if self.rolls_back:
                return position
        return None

    def explain(self, loop: Any, position: int, batch: Any, value: float, level: float) -> Finding:
        """The forensic finding of the spike at ``position`` (the state before it: the snapshot replayed up to
        it with the bare step, else the current state)."""
        state = loop.state
        if loop.snapshot is not None and loop.snapshot.position <= position:
            state = loop.snapshot.restore()
            for index, b in loop.consumed:
                if index >= position:
                    break
                if index >= loop.snapshot.position and index not in loop.skip:
                    state, _ = loop.monitor.step(state, b, MODE_BARE)
        dump = keep_batch(self.dump_dir, position, state, batch)
        history = loop.monitor.history
        return explain_spike(
            loop.adapted, state, batch, step=position, loss=value, level=level, history=history, dump_path=dump
        )

    def drop_repeats(self, findings: list[Finding]) -> list[Finding]:
        """``check_training``'s findings without a generic ``train.loss_spike`` whose every spike was explained."""
        out = []
        for f in findings:
            steps = {s["step"] for s in f.extra.get("spikes", [])} if f.code == "train.loss_spike" else None
            if steps is not None and steps <= self.seen:
                continue
            out.append(f)
        return out
