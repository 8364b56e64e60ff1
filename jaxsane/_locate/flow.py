"""locate's data-flow analysis after the replay: backward reachability from the non-finite outputs
over the replay graph (:class:`Analysis`), so only NaN/Inf values that flow into non-finite outputs
count, with lazy descent into the ``scan``/``while``/``cond``/``shard_map`` bodies that hand one on.
Its ``births`` are the candidate origins (see ``origins.py``); and the NaN/Inf
counts of a value (:func:`nonfinite_counts`).

Nothing here is jit-safe: it runs on the host, after a failure.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .._core.tree import can_be_nonfinite
from .replay import EXPANDABLE, Node, Replay, Val, raw

OUT = "output"


class Analysis:
    """Backward reachability from the bad outputs over the replay graph, with lazy descent."""

    def __init__(self, replay: Replay, outs: list[Val], out_paths: list[str]):
        self.replay = replay
        self.consumers: dict[int, list] = {}
        self.vals: dict[int, Val] = {}
        self.out_of: dict[int, list[str]] = {}
        self.out_order = {p: i for i, p in enumerate(out_paths)}
        self.births: list[Node] = []
        self.sources: list[Val] = []
        self.xla: list[tuple[Node, int]] = []
        self.retrace: Callable[[], list] | None = None
        self._records: list | None = None
        self.reached: set[int] = set()
        self.unopened: dict[int, str] = {}  # id(node) -> why its body could not be replayed
        work: list[Val] = []
        for v, path in zip(outs, out_paths):
            if v.bad:
                self.out_of.setdefault(id(v), []).append(path)
                self._use(v, OUT)
                work.append(v)
        self._walk(work)

    def vjp_records(self) -> list:
        if self._records is None:
            try:
                self._records = self.retrace() if self.retrace is not None else []
            except Exception:  # noqa: BLE001 - best effort
                self._records = []
        return self._records

    def _use(self, v: Val, consumer) -> None:
        self.vals[id(v)] = v
        lst = self.consumers.setdefault(id(v), [])
        if consumer not in lst:
            lst.append(consumer)

    def _walk(self, work: list[Val]) -> None:
        seen_vals: set[int] = set()
        while work:
            v = work.pop()
            if id(v) in seen_vals:
                continue
            seen_vals.add(id(v))
            node = v.producer
            if node is None:
                self.sources.append(v)
                continue
            if not node.link and node.prim in EXPANDABLE and node.inner is None:
                try:
                    self.replay.expand(node)
                except Exception as e:  # pragma: no cover - descent is best effort; the node stays opaque
                    node.inner = None
                    self.unopened[id(node)] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if not node.link and node.inner is not None:
                k = node.outs.index(v)
                inner = [x for x in node.inner[k] if x.bad]
                if not inner:
                    self.xla.append((node, k))
                    continue
                link = Node(None, inner, node.ctx, node.order, link=True)
                link.outs = [v]
                for x in inner:
                    self._use(x, link)
                    work.append(x)
                continue
            if id(node) in self.reached:
                continue
            self.reached.add(id(node))
            bad_in = [x for x in node.ins if x.bad]
            for x in bad_in:
                self._use(x, node)
                work.append(x)
            if node.link:
                continue
            out_nan = any(o.nan for o in node.outs)
            if not bad_in or (out_nan and not any(x.nan for x in bad_in) and not self._from_birth(node)):
                self.births.append(node)

    def _from_birth(self, node: Node, depth: int = 0) -> bool:
        """True when some bad input of ``node`` descends from an inf born from finite values (not a source)."""
        stack, seen = [(x, 0) for x in node.ins if x.bad], set()
        while stack:
            v, d = stack.pop()
            if id(v) in seen or d > 400:
                continue
            seen.add(id(v))
            p = v.producer
            if p is None:
                continue
            if not p.link and p.inner is not None:
                k = p.outs.index(v) if v in p.outs else -1
                nxt = [x for x in p.inner[k] if x.bad] if k >= 0 else []
                stack += [(x, d + 1) for x in nxt]
                continue
            bad = [x for x in p.ins if x.bad]
            if not bad and not p.link:
                return True
            stack += [(x, d + 1) for x in bad]
        return False

    # -- forward questions about a birth
    def downstream(self, node: Node, limit: int = 64) -> list:
        """Nodes reached from ``node``'s bad outputs (breadth first), ``OUT`` included."""
        seen: set = set()
        order: list = []
        frontier = [o for o in node.outs if o.bad]
        while frontier and len(order) < limit:
            nxt = []
            for v in frontier:
                for c in self.consumers.get(id(v), []):
                    if id(c) in seen:
                        continue
                    seen.add(id(c))
                    order.append(c)
                    if c is not OUT:
                        nxt += [o for o in c.outs if o.bad]
            frontier = nxt
        return order

    def reaches(self, node: Node | Val) -> list[str]:
        seen, paths = set(), []
        frontier = [o for o in node.outs if o.bad] if isinstance(node, Node) else [node]
        while frontier:
            nxt = []
            for v in frontier:
                if id(v) in seen:
                    continue
                seen.add(id(v))
                paths += [p for p in self.out_of.get(id(v), []) if p not in paths]
                for c in self.consumers.get(id(v), []):
                    if c is not OUT:
                        nxt += [o for o in c.outs if o.bad]
            frontier = nxt
        return sorted(paths, key=lambda p: self.out_order.get(p, len(self.out_order)))

    def only_backward(self, node: Node) -> bool:
        """True when ``node``'s bad outputs are consumed only by backward-pass computations."""
        memo: dict[int, bool] = {}

        def rec(n, depth) -> bool:
            if id(n) in memo:
                return memo[id(n)]
            if depth > 200:
                return False
            memo[id(n)] = False
            users = [c for o in n.outs if o.bad for c in self.consumers.get(id(o), [])]
            ok = bool(users)
            for c in users:
                if c is OUT:
                    ok = False
                elif c.link:
                    ok = ok and rec(c, depth + 1)
                elif "transpose(" in c.stack:
                    continue
                elif "jvp(" in c.stack:
                    ok = ok and rec(c, depth + 1)
                else:
                    ok = False
                if not ok:
                    break
            memo[id(n)] = ok
            return ok

        return rec(node, 0)


def nonfinite_counts(x) -> tuple[int, int]:
    """``(NaN count, Inf count)`` of a value (0, 0 for integers). Not jit-safe."""
    x = raw(x)
    if not can_be_nonfinite(x):  # (integers, bools and typed PRNG keys, which numpy cannot hold)
        return 0, 0
    a = np.asarray(x)
    return int(np.isnan(a).sum()), int(np.isinf(a).sum())
