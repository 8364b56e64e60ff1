"""jaxsane's one jaxpr interpreter: a jaxpr evaluated equation by equation, with hooks.

:class:`Interpreter` walks a jaxpr and, for each equation, calls its hooks (methods a subclass
overrides): :meth:`~Interpreter.at` (the equation's context), :meth:`~Interpreter.before` (take
the equation over), :meth:`~Interpreter.after` (see or replace its outputs),
:meth:`~Interpreter.enters` (recurse into a sub-jaxpr or not) and :meth:`~Interpreter.child` (the
context of a sub-jaxpr). How to recurse is read from ONE table, :data:`RULES`, one rule per
primitive:

* calls (``pjit``/``jit``, ``closed_call``, ``core_call``, ``custom_jvp_call``,
  ``custom_vjp_call``/``custom_vjp_call_jaxpr``, ``remat``/``checkpoint``): the body, inline;
* ``scan``: the body once per time step, slicing ``xs``, threading carries and stacking ``ys``
  (``reverse``, ``length``, ``num_consts``, ``num_carry``, ``unroll`` as ``lax.scan``; a
  ``fori_loop`` with static bounds is a ``scan`` too);
* ``while``: the body while the condition holds; ``cond``: the branch its index selects;
* anything else (``shard_map`` included): :meth:`~Interpreter.bind`, i.e.
  ``eqn.primitive.bind(*invals, **eqn.params)``.

On concrete values the loops iterate in Python. On tracers (inside ``jit``/``vmap``/``grad``) a
``scan`` is re-expressed as ``lax.scan`` over a Python function that interprets its body, a
``while`` as ``lax.while_loop`` and a ``cond`` as ``lax.switch``, so the interpreter is jit-safe.

Hooks record values with :meth:`~Interpreter.emit`; a record is keyed by its *site* (the equation
and the calls around it). A value recorded inside a ``scan`` body comes out stacked over the
iterations, ``[length, ...]`` (in both modes; inside a concrete ``while`` over the iterations run);
values recorded inside a traced ``while`` body or a traced ``cond`` branch are dropped (their
number of iterations / branch is not known when tracing). Hooks must not keep values any other
way, or tracers of a loop body would leak.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

# call-like primitives: the parameter holding the body, whose invars are the equation's last invars
CALLS = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat2": "jaxpr",
    "remat": "jaxpr",
    "checkpoint": "jaxpr",
}
LOOPS = ("scan", "while", "cond")


def closed(j: Any) -> tuple[Any, list]:
    """``(open jaxpr, consts)`` of a ``Jaxpr`` or ``ClosedJaxpr``."""
    if isinstance(j, jcore.ClosedJaxpr):
        return j.jaxpr, list(j.consts)
    return j, []


def call_body(eqn) -> tuple[Any, list] | None:
    """``(jaxpr, consts)`` of a call-like equation whose body takes its last invars, else None."""
    key = CALLS.get(eqn.primitive.name)
    sub = eqn.params.get(key) if key is not None else None
    if sub is None or not hasattr(closed(sub)[0], "eqns"):
        return None
    jaxpr, consts = closed(sub)
    if len(jaxpr.invars) > len(eqn.invars) or len(jaxpr.outvars) != len(eqn.outvars):
        return None
    return jaxpr, consts


def bodies(eqn) -> list[tuple[Any, list[int]]]:
    """Static view of the sub-jaxprs of ``eqn``: ``(jaxpr, outer invar index per body invar)``.

    Covers the calls of :data:`CALLS`, ``scan`` (one body), ``while`` (its body; the condition
    reads the same carries) and ``cond`` (every branch). For static walks (first use of a
    parameter, dtypes computed from an input); nothing is evaluated.
    """
    name, p, n = eqn.primitive.name, eqn.params, len(eqn.invars)
    sub = call_body(eqn)
    if sub is not None:
        k = len(sub[0].invars)
        return [(sub[0], list(range(n - k, n)))]
    if name == "scan":
        return [(closed(p["jaxpr"])[0], list(range(n)))]
    if name == "while":
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        body = [(closed(p["body_jaxpr"])[0], list(range(nc, n)))]
        cond = [(closed(p["cond_jaxpr"])[0], list(range(nc)) + list(range(nc + nb, n)))]
        return body + cond
    if name == "cond":
        return [(closed(b)[0], list(range(1, n))) for b in p["branches"]]
    return []


def all_eqns(jaxpr) -> Iterator[Any]:
    """Every equation of ``jaxpr`` and of the jaxprs nested in it (any parameter holding one), depth first."""
    for eqn in closed(jaxpr)[0].eqns:
        yield eqn
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(item, (jcore.Jaxpr, jcore.ClosedJaxpr)):
                    yield from all_eqns(item)


def bind_eqn(eqn, invals: Sequence[Any]) -> list[Any]:
    """Apply one equation to values (concrete or traced); always a list of outputs. Jit-safe."""
    bp = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = bp if isinstance(bp, tuple) else ((), bp)  # older jax: a pair; newer: "subfuns" in params
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


class Interpreter:
    """Evaluates jaxprs equation by equation; subclasses override the hooks. Jit-safe by default.

    ``run(jaxpr, consts, args, ctx, tags)`` returns ``(outputs, output tags)``. Tags are
    arbitrary per-value annotations (default None) that hooks may set and that flow through
    calls and loop bodies (a loop's outputs take the tags its body gives them).
    """

    def __init__(self) -> None:
        self.path: list[Any] = []  # the call/loop equations being evaluated, outermost first
        self.records: dict[tuple, Any] = {}  # site -> recorded value (see emit)
        self.sites: dict[tuple, tuple] = {}  # site -> (eqn, enclosing equations), kept across collectors

    # ------------------------------------------------------------------ hooks
    def at(self, eqn, invals: list, ctx: Any, index: int, jaxpr) -> Any:
        """The context of ``eqn`` (passed to every other hook); default: the enclosing one."""
        return ctx

    def before(self, eqn, invals: list, tags: list, ectx: Any) -> tuple[list, list] | None:
        """Return ``(outs, out_tags)`` to take ``eqn`` over, or None for the rule / bind."""
        return None

    def after(self, eqn, invals: list, outs: list, tags: list, out_tags: list, ectx: Any) -> tuple[list, list]:
        """See (or replace) the outputs of ``eqn`` that the rule or bind produced."""
        return outs, out_tags

    def enters(self, eqn, ectx: Any) -> bool:
        """Whether to recurse into ``eqn``'s sub-jaxpr (when :data:`RULES` has a rule); default yes."""
        return True

    def child(self, eqn, ectx: Any, label: str | None = None, order: tuple = ()) -> Any:
        """The context of a sub-jaxpr of ``eqn`` (``label``: ``"scan iteration 3"``, ``"branch 1"``...)."""
        return ectx

    def bind(self, eqn, invals: list, ectx: Any) -> list:
        """Evaluate a primitive equation; default ``bind``."""
        return bind_eqn(eqn, [self.value(v) for v in invals])

    def literal(self, lit) -> Any:
        return lit.val

    def const(self, c: Any) -> Any:
        return c

    def value(self, v: Any) -> Any:
        """The array behind an interpreter value (subclasses that wrap values unwrap here)."""
        return v

    def index(self, x: Any, t: int, eqn, ectx: Any) -> Any:
        """``x[t]``: one time step of a scanned input."""
        return x[t]

    def select(self, going: np.ndarray, new: Any, old: Any, eqn, ectx: Any) -> Any:
        """A batched while's carry: ``new`` in the lanes (leading axis) where ``going`` is True, else ``old``."""
        a = self.value(new)
        return jnp.where(going.reshape(going.shape + (1,) * (np.ndim(a) - going.ndim)), a, self.value(old))

    def stack(self, parts: list, eqn, ectx: Any, aval: Any = None) -> Any:
        """Stack one scan output over its time steps (in time order)."""
        return jnp.stack(parts) if parts else jnp.zeros(aval.shape, aval.dtype)

    # ------------------------------------------------------------------ records
    def site_of(self, eqn, kind: str = "") -> tuple:
        """The key :meth:`emit` gives a value recorded at ``eqn`` now (same across loop iterations)."""
        return (tuple(id(e) for e in self.path), id(eqn), kind)

    def emit(self, eqn, value: Any, kind: str = "") -> tuple:
        """Record ``value`` at the site of ``eqn`` (see the module docstring); returns the site. Jit-safe."""
        site = self.site_of(eqn, kind)
        self.records[site] = value
        self.sites.setdefault(site, (eqn, tuple(self.path)))
        return site

    @contextlib.contextmanager
    def collecting(self) -> Iterator[dict]:
        saved, self.records = self.records, {}
        try:
            yield self.records
        finally:
            self.records = saved

    def traced(self, invals: Sequence[Any]) -> bool:
        return any(_is_tracer(self.value(v)) for v in invals)

    # ------------------------------------------------------------------ the walk
    def run(
        self, jaxpr, consts: Sequence[Any], args: Sequence[Any], ctx: Any = None, tags: Sequence[Any] | None = None
    ) -> tuple[list, list]:
        """Evaluate ``jaxpr`` (open; its consts given) on ``args``; ``(outputs, output tags)``."""
        env: dict = {}
        tag_env: dict = {}
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = self.const(c)
        tags = list(tags) if tags is not None else [None] * len(args)
        for v, a, t in zip(jaxpr.invars, args, tags):
            env[v] = a
            tag_env[v] = t

        def read(a):
            return self.literal(a) if isinstance(a, jcore.Literal) else env[a]

        def tag(a):
            return None if isinstance(a, jcore.Literal) else tag_env.get(a)

        for i, eqn in enumerate(jaxpr.eqns):
            invals = [read(a) for a in eqn.invars]
            in_tags = [tag(a) for a in eqn.invars]
            ectx = self.at(eqn, invals, ctx, i, jaxpr)
            result = self.before(eqn, invals, in_tags, ectx)
            if result is None:
                rule = RULES.get(eqn.primitive.name)
                if rule is not None and self.enters(eqn, ectx):
                    self.path.append(eqn)
                    try:
                        result = rule(self, eqn, invals, in_tags, ectx)
                    finally:
                        self.path.pop()
                if result is None:
                    outs = self.bind(eqn, invals, ectx)
                    result = (outs, [None] * len(outs))
                result = self.after(eqn, invals, result[0], in_tags, result[1], ectx)
            for v, o, t in zip(eqn.outvars, *result):
                if not isinstance(v, jcore.DropVar):
                    env[v] = o
                    tag_env[v] = t
        self.finished(jaxpr, env)
        return [read(a) for a in jaxpr.outvars], [tag(a) for a in jaxpr.outvars]

    def finished(self, jaxpr, env: dict) -> None:
        """Called with the environment of ``jaxpr`` once all its equations ran."""


# ----------------------------------------------------------------------------- the rules

Rule = Callable[[Interpreter, Any, list, list, Any], "tuple[list, list] | None"]


def _call_rule(it: Interpreter, eqn, invals, tags, ectx):
    sub = call_body(eqn)
    if sub is None:
        return None
    k = len(sub[0].invars)
    return it.run(sub[0], sub[1], invals[len(invals) - k :], it.child(eqn, ectx), tags[len(tags) - k :])


def _reemit(it: Interpreter, site_values: dict) -> None:
    """Put records collected in a loop body (already stacked) into the enclosing collector."""
    it.records.update(site_values)


def _scan_rule(it: Interpreter, eqn, invals, tags, ectx):
    p = eqn.params
    body, body_consts = closed(p["jaxpr"])
    nconst, ncarry, length, reverse = p["num_consts"], p["num_carry"], int(p["length"]), bool(p["reverse"])
    consts, carry, xs = invals[:nconst], invals[nconst : nconst + ncarry], invals[nconst + ncarry :]
    body_tags = list(tags)
    if it.traced(invals):
        out_tags: list = [None] * len(eqn.outvars)

        def step(c, x):
            nonlocal out_tags
            with it.collecting() as rec:
                outs, out_tags = it.run(
                    body, body_consts, [*consts, *c, *x], it.child(eqn, ectx, "scan body"), body_tags
                )
            return outs[:ncarry], (outs[ncarry:], dict(rec))

        unroll = p.get("unroll", 1)
        carry, (ys, rec) = jax.lax.scan(
            step,
            list(carry),
            list(xs),
            length=length,
            reverse=reverse,
            unroll=unroll if isinstance(unroll, (bool, int)) else 1,
        )
        _reemit(it, rec)
        return list(carry) + list(ys), out_tags
    ys_parts: list[list] = [[None] * length for _ in range(len(eqn.outvars) - ncarry)]
    per_site: dict[tuple, list] = {}
    out_tags = list(tags[nconst : nconst + ncarry]) + [None] * len(ys_parts)
    for t in range(length - 1, -1, -1) if reverse else range(length):
        x_t = [it.index(x, t, eqn, ectx) for x in xs]
        with it.collecting() as rec:
            outs, out_tags = it.run(
                body, body_consts, [*consts, *carry, *x_t], it.child(eqn, ectx, f"scan iteration {t}", (t,)), body_tags
            )
        carry = outs[:ncarry]
        for k, y in enumerate(outs[ncarry:]):
            ys_parts[k][t] = y
        for site, v in rec.items():
            per_site.setdefault(site, []).append((t, v))
    ys = [it.stack(parts, eqn, ectx, aval=v.aval) for parts, v in zip(ys_parts, eqn.outvars[ncarry:])]
    _reemit(it, {s: jnp.stack([v for _, v in sorted(vs, key=lambda r: r[0])]) for s, vs in per_site.items()})
    return list(carry) + ys, out_tags


def _while_rule(it: Interpreter, eqn, invals, tags, ectx):
    p = eqn.params
    cj, cconsts_extra = closed(p["cond_jaxpr"])
    bj, bconsts_extra = closed(p["body_jaxpr"])
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, carry = invals[:nc], invals[nc : nc + nb], invals[nc + nb :]
    body_tags = list(tags[nc:])
    raw_cconsts = [it.value(c) for c in cconsts]

    def pred(c):
        return jax.core.eval_jaxpr(cj, cconsts_extra, *raw_cconsts, *[it.value(x) for x in c])[0]

    if it.traced(invals):
        out_tags: list = [None] * len(eqn.outvars)

        def body(c):
            nonlocal out_tags
            with it.collecting():  # records of a traced while body are dropped (unknown trip count)
                outs, out_tags = it.run(bj, bconsts_extra, [*bconsts, *c], it.child(eqn, ectx, "while body"), body_tags)
            going = pred(c)
            if jnp.ndim(going):  # a batched predicate (vmap of a while_loop): finished lanes keep their carry
                outs = [it.select(going, a, b, eqn, ectx) for a, b in zip(outs, c)]
            return outs

        def any_going(c):
            return jnp.any(pred(c))

        return list(jax.lax.while_loop(any_going, body, list(carry))), out_tags
    per_site: dict[tuple, list] = {}
    out_tags = list(tags[nc + nb :])
    n = 0
    while (going := np.asarray(pred(carry))).any():
        with it.collecting() as rec:
            new, out_tags = it.run(
                bj, bconsts_extra, [*bconsts, *carry], it.child(eqn, ectx, f"while iteration {n}", (n,)), body_tags
            )
        # a batched predicate (vmap of a while_loop): the lanes whose predicate is False keep their carry
        carry = new if going.ndim == 0 else [it.select(going, a, b, eqn, ectx) for a, b in zip(new, carry)]
        for site, v in rec.items():
            per_site.setdefault(site, []).append(v)
        n += 1
    _reemit(it, {s: jnp.stack(vs) for s, vs in per_site.items()})
    return list(carry), out_tags


def _cond_rule(it: Interpreter, eqn, invals, tags, ectx):
    branches = eqn.params["branches"]
    ops, op_tags = invals[1:], tags[1:]
    if it.traced(invals):
        out_tags: list = [None] * len(eqn.outvars)

        def branch(k):
            def fn(*xs):
                nonlocal out_tags
                sub, consts = closed(branches[k])
                with it.collecting():  # records of a traced branch are dropped (branch unknown)
                    outs, out_tags = it.run(sub, consts, list(xs), it.child(eqn, ectx, f"branch {k}"), op_tags)
                return outs

            return fn

        index = jnp.asarray(it.value(invals[0]))
        return list(jax.lax.switch(index, [branch(k) for k in range(len(branches))], *ops)), out_tags
    taken = min(max(int(np.asarray(it.value(invals[0])).reshape(-1)[0]), 0), len(branches) - 1)
    sub, consts = closed(branches[taken])
    return it.run(sub, consts, list(ops), it.child(eqn, ectx, f"branch {taken}"), op_tags)


RULES: dict[str, Rule] = {
    **{name: _call_rule for name in CALLS},
    "scan": _scan_rule,
    "while": _while_rule,
    "cond": _cond_rule,
}
"""How the interpreter recurses, one rule per primitive; primitives not listed are bound whole."""
