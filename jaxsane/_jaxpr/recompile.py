"""Why a step compiled again (``step.recompiles``): a cheap host-side *signature* of a call's
arguments, and the diff of two signatures naming the argument that changed.

A signature holds, per argument, its pytree structure and per leaf what ``jax.jit`` keys its cache
on: shape, dtype, weak type and sharding of an array; the type of a Python scalar (an ``int`` and a
``float`` trace differently); the value of a static argument. Leaf paths (``batch['x']``) are only
worked out when two signatures differ, so taking a signature costs one ``tree_flatten`` and a few
attribute reads per leaf. :class:`RecompileTracker` keeps the signature of the last call that
compiled and turns the next compile into a :class:`Recompile` (the changes, the call, the user's
``file:line``); :func:`recompile_finding` makes it a ``step.recompiles`` finding. Used by guard,
``check_step``, ``count_compilations`` and ``jaxsane.testing.assert_compiles_once``.

Everything here runs on the host and is not jit-safe (it reads concrete arrays' metadata).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .._core.finding import Finding
from .._core.tree import path_str

IDENTICAL = "the arguments are identical: the step function itself changed (a new jax.jit or closure per call)"
_MAX_SHOWN = 6  # changes written out in a message (all of them are in the finding's extra)
_PY_SCALARS = (bool, int, float, complex)

_FIXES = {
    "shape": "a shape changed: pad or bucket batches to a few fixed shapes (e.g. drop the last partial batch, "
    "drop_remainder=True)",
    "dtype": "a dtype changed: cast the argument to one dtype before the call (jnp.asarray(x, jnp.float32)), and "
    "return the state with the dtypes it came in with",
    "weak_type": "a weak type changed (a Python scalar became an array, or the reverse): build the state from "
    "jnp arrays with explicit dtypes, not Python numbers",
    "type": "a Python scalar's type changed (an int and a float trace differently): pass jnp.asarray(value, "
    "jnp.float32) instead of the Python number",
    "sharding": "a sharding changed: put the argument on one sharding every call (jax.device_put(x, sharding)), "
    "e.g. the new state on the sharding of the initial one",
    "value": "a static argument's value changed: each new value compiles a new program; pass it as a traced "
    "jnp array argument instead, or keep it constant",
    "added": "the pytree structure changed: pass the same keys every call (fill a missing one with zeros)",
    "removed": "the pytree structure changed: pass the same keys every call (fill a missing one with zeros)",
    "structure": "the pytree structure changed: pass the same container types every call",
    "identical": "jit the step once, outside the loop, and pass values that change as jnp array arguments "
    "(not closed over, not static)",
}


@dataclasses.dataclass(frozen=True)
class Change:
    """One difference between two calls' arguments: ``path`` (``batch['x']``), ``field`` (``shape``,
    ``dtype``, ``weak_type``, ``sharding``, ``type``, ``value``, ``added``, ``removed``, ``structure``)
    and the old and new value as text."""

    path: str
    field: str
    old: str
    new: str

    def __str__(self) -> str:
        if self.field == "added":
            return f"{self.path}: added ({self.new})"
        if self.field == "removed":
            return f"{self.path}: removed (was {self.old})"
        return f"{self.path}: {self.field} {self.old} -> {self.new}"

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Recompile:
    """A call that compiled again: its index (0 = the first call seen), what changed since the call
    that compiled last (empty: the arguments are identical), and the user's ``file:line``."""

    call: int
    changes: tuple[Change, ...]
    site: str | None = None

    def summary(self) -> str:
        """The changes on one line (the first few), or the sentence for identical arguments."""
        if not self.changes:
            return IDENTICAL
        shown = "; ".join(str(c) for c in self.changes[:_MAX_SHOWN])
        more = len(self.changes) - _MAX_SHOWN
        return shown + (f"; and {more} more change(s)" if more > 0 else "")

    def hint(self) -> str:
        fields = list(dict.fromkeys(c.field for c in self.changes)) or ["identical"]
        return "; ".join(dict.fromkeys(_FIXES[f] for f in fields))

    def __str__(self) -> str:
        at = f" ({self.site})" if self.site else ""
        return f"call {self.call}{at}: {self.summary()}"


@dataclasses.dataclass(frozen=True)
class _Arg:
    name: str
    treedef: Any  # None for a static argument
    leaves: tuple  # leaf descriptors (see describe); a static argument: (("static", type, value),)

    def same(self, other: _Arg) -> bool:
        return self.name == other.name and self.treedef == other.treedef and _same_leaves(self.leaves, other.leaves)


def _same_leaves(a: tuple, b: tuple) -> bool:
    try:
        return a == b
    except Exception:  # noqa: BLE001 - a static value whose __eq__ fails: compare by identity
        return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def describe(x: Any) -> tuple:
    """What ``jax.jit`` keys its cache on for one dynamic leaf ``x``. Not jit-safe (concrete values).

    ``("array", shape, dtype, weak_type, sharding)`` for jax and numpy arrays, ``("python", type)`` for a
    Python scalar, ``("object", type)`` for anything else.
    """
    aval = getattr(x, "aval", None) if isinstance(x, jax.Array) else None
    if aval is not None:  # the aval's plain attributes: cheaper than the array's own properties
        return ("array", aval.shape, aval.dtype, aval.weak_type, x.sharding)
    if isinstance(x, jax.Array):
        return ("array", x.shape, x.dtype, x.weak_type, x.sharding)
    if isinstance(x, (np.ndarray, np.generic)):
        return ("array", x.shape, x.dtype, False, None)
    if isinstance(x, _PY_SCALARS):
        return ("python", type(x))
    return ("object", type(x))


def signature(
    args: Sequence[Any],
    kwargs: dict | None = None,
    *,
    names: Sequence[str] = (),
    static_argnums: Sequence[int] = (),
    static_argnames: Sequence[str] = (),
) -> tuple[_Arg, ...]:
    """The signature of one call ``fn(*args, **kwargs)``: per argument (named ``names[i]``, else
    ``args[i]``) its treedef and leaf descriptors; static arguments by value. Cheap: one flatten per
    argument, no paths. Not jit-safe."""
    out = []
    static_pos = set(static_argnums)
    for i, a in enumerate(args):
        name = names[i] if i < len(names) else f"args[{i}]"
        out.append(_arg(name, a, i in static_pos))
    for k, v in (kwargs or {}).items():
        out.append(_arg(k, v, k in static_argnames))
    return tuple(out)


def _arg(name: str, value: Any, static: bool) -> _Arg:
    if static:
        return _Arg(name, None, (("static", type(value), value),))
    leaves, treedef = jax.tree_util.tree_flatten(value)
    return _Arg(name, treedef, tuple(describe(x) for x in leaves))


def same_signature(a: tuple[_Arg, ...], b: tuple[_Arg, ...]) -> bool:
    """Whether two signatures are equal (the same program would be reused). Not jit-safe."""
    return len(a) == len(b) and all(x.same(y) for x, y in zip(a, b))


def diff(old: tuple[_Arg, ...], new: tuple[_Arg, ...]) -> list[Change]:
    """The changes from the signature ``old`` to ``new``, by argument path. Not jit-safe."""
    changes: list[Change] = []
    olds = {a.name: a for a in old}
    news = {a.name: a for a in new}
    for name, a in olds.items():
        if name not in news:
            changes.append(Change(name, "removed", _leaf_text(a.leaves[0]) if a.treedef is None else "an argument", ""))
    for name, b in news.items():
        before = olds.get(name)
        if before is None:
            changes.append(Change(name, "added", "", "an argument"))
        elif not before.same(b):
            changes += _arg_diff(before, b)
    return changes


def _arg_diff(a: _Arg, b: _Arg) -> list[Change]:
    if a.treedef is None or b.treedef is None:  # a static argument (or one that became static)
        x, y = a.leaves[0], b.leaves[0]
        typed = x[0] == y[0] == "static" and x[1] is not y[1]  # jit tells 1 from 1.0: say which is which
        return [Change(a.name, "value", _leaf_text(x, typed), _leaf_text(y, typed))]
    if a.treedef == b.treedef:
        paths = _paths(a)
        return [c for i, (x, y) in enumerate(zip(a.leaves, b.leaves)) if x != y for c in _leaf_diff(paths[i], x, y)]
    pa, pb = _paths(a), _paths(b)
    if pa == pb:  # same leaves by name, other containers (tuple -> list, another namedtuple type)
        return [Change(a.name, "structure", _short(str(a.treedef)), _short(str(b.treedef)))]
    old, new = dict(zip(pa, a.leaves)), dict(zip(pb, b.leaves))
    changes = [
        c
        for p in pb
        for c in (
            [Change(p, "added", "", _leaf_text(new[p]))]
            if p not in old
            else _leaf_diff(p, old[p], new[p])
            if old[p] != new[p]
            else []
        )
    ]  # tree order
    changes += [Change(p, "removed", _leaf_text(old[p]), "") for p in pa if p not in new]
    return changes or [Change(a.name, "structure", _short(str(a.treedef)), _short(str(b.treedef)))]


def _leaf_diff(path: str, x: tuple, y: tuple) -> list[Change]:
    if x[0] == y[0] == "array":
        out = []
        for k, field in ((1, "shape"), (2, "dtype"), (3, "weak_type"), (4, "sharding")):
            if x[k] != y[k] and not (field == "sharding" and _equivalent(x[k], y[k], len(y[1]))):
                fmt = _sharding_text if field == "sharding" else (str if field == "dtype" else repr)
                out.append(Change(path, field, fmt(x[k]), fmt(y[k])))
        return out
    return [Change(path, "type", _leaf_text(x), _leaf_text(y))]


def _equivalent(a: Any, b: Any, ndim: int) -> bool:
    """Shardings that lay an array out alike (``P()`` and ``P(None,)``): jit reuses its program for them."""
    try:
        return a is not None and b is not None and bool(a.is_equivalent_to(b, ndim))
    except Exception:  # noqa: BLE001 - shardings of different kinds or meshes
        return False


def _paths(a: _Arg) -> list[str]:
    """The leaf paths of one argument, rebuilt from its treedef (only when a diff needs them)."""
    n = len(a.leaves)
    try:
        tree = jax.tree_util.tree_unflatten(a.treedef, list(range(n)))
        flat, _ = jax.tree_util.tree_flatten_with_path(tree)
        if len(flat) == n:
            return [path_str(p, a.name) for p, _ in flat]
    except Exception:  # noqa: BLE001 - a custom node that cannot be rebuilt from placeholders
        pass
    return [f"{a.name}<leaf {i}>" for i in range(n)]


def _leaf_text(d: tuple, typed: bool = False) -> str:
    if d[0] == "array":
        weak = " (weak)" if d[3] else ""
        return f"{d[2]}{list(d[1])}{weak}"
    if d[0] == "python":
        return f"Python {d[1].__name__}"
    if d[0] == "static":
        value = d[2]
        text = _short(repr(value))
        try:
            if len(text) > 60 or text.endswith(">"):  # a long or default repr: the hash tells them apart
                text = f"{text} (hash {hash(value)})"
        except TypeError:
            pass
        return f"{text} ({d[1].__name__})" if typed else text
    return f"a {d[1].__name__}"


def _sharding_text(s: Any) -> str:
    if s is None:
        return "none (a host numpy array)"
    spec = getattr(s, "spec", None)
    if spec is not None:
        return f"{type(s).__name__}({spec}, mesh {dict(getattr(s.mesh, 'shape', {}))})"
    devices = sorted(d.id for d in getattr(s, "device_set", ()))
    return f"{type(s).__name__}(devices {devices})"


def _short(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


class RecompileTracker:
    """Keeps the signature of the last call that compiled (or the first call seen) and explains the
    next compile against it. ``reasons`` holds one :class:`Recompile` per compile after the first.
    Not jit-safe."""

    def __init__(self) -> None:
        self.last: tuple[_Arg, ...] | None = None
        self.reasons: list[Recompile] = []
        self.calls = 0

    def seen(self, sig: tuple[_Arg, ...], compiled: bool, site: str | None = None) -> Recompile | None:
        """Record one call with signature ``sig``; returns its :class:`Recompile` when it compiled and a
        call before it was seen (the first compile only sets the baseline)."""
        call, self.calls = self.calls, self.calls + 1
        if self.last is None:
            self.last = sig
            return None
        if not compiled:
            return None
        changes = () if same_signature(self.last, sig) else tuple(diff(self.last, sig))
        self.last = sig
        rec = Recompile(call, changes, site)
        self.reasons.append(rec)
        return rec

    def explain(self) -> str:
        """One line per compile after the first: the call, its ``file:line`` and what changed."""
        if not self.reasons:
            return "no recompilation: every call after the first reused its compiled program"
        return "\n".join(f"recompiled at {r}" for r in self.reasons)


def recompile_finding(rec: Recompile, what: str = "the step", step: int | None = None) -> Finding:
    """The ``step.recompiles`` finding of one :class:`Recompile`: the message names the changes, the
    hint says what to change, ``extra["changes"]`` lists them as dicts. Not jit-safe."""
    file, line = _split_site(rec.site)  # shown in the finding's where, beside the path
    when = f"call {rec.call}" if step is None else f"step {step}"
    return Finding(
        "step.recompiles",
        f"{what} compiled again at {when}: {rec.summary()}",
        rec.hint(),
        path=rec.changes[0].path if rec.changes else None,
        step=step,
        file=file,
        line=line,
        extra={"changes": [c.as_dict() for c in rec.changes], **({"call": rec.call} if step is None else {})},
    )


def _split_site(site: str | None) -> tuple[str | None, int | None]:
    if not site or ":" not in site:
        return None, None
    file, _, line = site.rpartition(":")
    return file, int(line) if line.isdigit() else None
