"""locate's origins: from the births of the flow analysis (``flow.py``) to :class:`jaxsane.Origin`
records (the primitive, forward or backward phase, ``file:line`` and source, the named cause and fix
from ``nan_causes.py``, the shard and batch rows), dropping backward births that follow from an
earlier forward one; and the line inside a ``custom_vjp`` backward rule, found by tracing the rule
again (jax keeps only the call site).

Nothing here is jit-safe: it runs on the host, after a failure.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import linecache
import re
import sys

import jax
import numpy as np

from .._core.frames import frames_of, is_library_file, source_text, user_chain, user_frame
from .._core.tree import is_inexact
from .._jaxpr.interpret import all_eqns
from .flow import OUT, Analysis, nonfinite_counts
from .nan_causes import Cause, explain
from .nan_values import primal_eqn
from .replay import Node, Val, host_array, raw
from .result import Origin, OriginContext


@contextlib.contextmanager
def recording_custom_vjp(records: list):
    """Record every custom_vjp call made while tracing: (user call site, the custom_vjp, arg shapes)."""
    from jax._src.custom_derivatives import custom_vjp as cls

    original = cls.__call__

    def call(self, *args, **kwargs):
        f = sys._getframe(1)
        while f is not None and is_library_file(f.f_code.co_filename):
            f = f.f_back
        try:
            specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), (args, kwargs))
        except Exception:  # noqa: BLE001 - non-array arguments: no re-trace later
            specs = None
        records.append(((f.f_code.co_filename, f.f_lineno) if f is not None else None, self, specs))
        return original(self, *args, **kwargs)

    cls.__call__ = call  # type: ignore[method-assign]  # (jax's class, patched for the duration of one trace)
    try:
        yield records
    finally:
        cls.__call__ = original  # type: ignore[method-assign]


def _custom_vjp_bwd_frame(node, records: list) -> tuple[str, int] | None:
    """The line inside a custom_vjp's backward rule that made ``node`` (jax keeps only the call site)."""
    if node.eqn is None or not any("custom_vjp" in fr.function_name for fr in frames_of(node.eqn)):
        return None
    shapes = [tuple(np.shape(raw(x.value))) for x in node.ins]
    for site, obj, specs in records:
        if specs is None or getattr(obj, "nondiff_argnums", None):
            continue
        if node.frame is not None and site != node.frame:  # (a custom_vjp passed straight to jax.grad: no site)
            continue
        try:
            out, res = jax.eval_shape(obj.fwd, *specs[0], **specs[1])
            bwd = jax.make_jaxpr(obj.bwd)(res, out)
        except Exception:  # noqa: BLE001 - a rule we cannot re-trace: keep the call site
            continue
        best = None
        for e in all_eqns(bwd.jaxpr):
            frame = user_frame(e)
            if e.primitive.name != node.prim or frame is None:
                continue
            if [tuple(getattr(v.aval, "shape", ())) for v in e.invars] == shapes:
                return frame
            best = best or frame
        if best is not None:
            return best
    return None


def find_origins(analysis: Analysis) -> list[Origin]:
    """The origins of the analysis's births in replay order, without repeats (a backward birth at the
    inputs of an earlier forward one follows from it and is dropped); when there are none, where an
    infinite constant enters on its way to the outputs (``nonfinite.literal``, or ``nonfinite.forward`` for
    a mask's fill); non-finite constants returned as is (``nonfinite.literal``); and the non-finite inputs,
    first, when they hold NaN, when nothing else was found, or when a birth only turned their inf into NaN
    (that operation becomes the input's ``then``). Not jit-safe."""
    found: list[tuple[tuple, Origin]] = []
    keys: dict[tuple, int] = {}
    forward: list[Node] = []  # forward births so far: a later backward birth at their inputs follows from them
    then: dict[int, str] = {}  # id(input) -> what the first operation did with its inf
    for node in sorted(analysis.births, key=lambda n: n.order):
        srcs = _input_sources(node)
        if srcs:  # a NaN made from an argument's inf by its first operation: the argument is the origin
            o = _origin_of(analysis, node)
            for v in srcs:
                then.setdefault(id(v), f"{o.values} in {o.phase} at {o.location}")
                if v.entry is not None and ("arg", id(v)) not in keys:  # a constant passed to the user's function
                    keys[("arg", id(v))] = len(found)
                    found.append((v.entry.order, _literal_origin(analysis, v, then[id(v)])))
            continue
        o = _origin_of(analysis, node)
        if o.phase != "forward" and any(_at_inputs_of(node, f) for f in forward):
            continue
        if o.phase == "forward":
            forward.append(node)
        key = (o.primitive, o.file, o.line, o.code, node.eqn is not None and id(node.eqn))
        if key in keys:
            continue
        keys[key] = len(found)
        found.append((node.order, o))
    if not found:  # an infinite constant (a -inf mask) that reaches the outputs: name where it enters
        _add_constants(analysis, found, keys)
    _add_literals(analysis, found, keys)
    # a non-finite input is a root cause only when nothing computed is born from it
    for v in analysis.sources:
        if v.kind == "input" and (v.nan or not found or id(v) in then):
            o = _input_origin(analysis, v, then.get(id(v), ""))
            found.append(((-1,), o))
    found.sort(key=lambda t: t[0])
    return [o for _, o in found]


def _at_inputs_of(node: Node, origin: Node) -> bool:
    """True when ``node`` (a backward/update birth) computes on a value at which the forward ``origin``
    already went non-finite: it shares one of the origin's input values (the same replay value, or an
    equal array of the same shape), e.g. log's derivative ``ct / x`` at the ``x = 0`` of a forward
    ``log(0)``. Such a birth is a consequence of the origin, not an independent further origin."""
    mine = [x for x in node.ins if x.kind not in ("literal", "const")]
    theirs = [x for x in origin.ins if x.kind not in ("literal", "const")]
    if any(a is b for a in mine for b in theirs):
        return True
    for a in mine:
        va = host_array(a.value)
        if va.size < 2:
            continue
        for b in theirs:
            vb = host_array(b.value)
            if va.shape == vb.shape and va.dtype == vb.dtype and np.array_equal(va, vb):
                return True
    return False


def _first_real(analysis: Analysis, c) -> Node | None:
    """The first equation (not a link, not the output) reached through ``c``."""
    seen = 0
    while c is not OUT and getattr(c, "link", False) and seen < 50:
        users = [u for o in c.outs for u in analysis.consumers.get(id(o), [])]
        c = users[0] if users else OUT
        seen += 1
    return None if c is OUT or getattr(c, "link", True) else c


def _add_constants(analysis: Analysis, found: list, keys: dict) -> None:
    """Add where an infinite constant that reaches the outputs enters a computation (nothing was born)."""
    for v in analysis.sources:
        if v.kind not in ("literal", "const"):
            continue
        for c in analysis.consumers.get(id(v), []):
            c = _first_real(analysis, c)
            if c is None or any(o is c for o in analysis.births):
                continue
            analysis.births.append(c)
            o = _origin_of(analysis, c)
            if not _fills_a_mask(analysis, c):  # y * jnp.inf: the constant itself makes the value non-finite
                o = dataclasses.replace(o, code="nonfinite.literal", cause=_LITERAL_CAUSE)
            key = (o.primitive, o.file, o.line, o.code, id(c.eqn))
            if key not in keys:
                keys[key] = len(found)
                found.append((c.order, o))


def _add_literals(analysis: Analysis, found: list, keys: dict) -> None:
    """Add the non-finite constants returned as is (a cond branch's jnp.nan, a jitted function's return, a
    backward rule's NaN constant) to ``found``."""
    for v in analysis.sources:
        if v.kind == "literal" and v.site is not None and _returned_as_is(analysis, v):
            o = _literal_origin(analysis, v)
            key = (o.primitive, o.file, o.line, o.code, None)
            if key not in keys:
                keys[key] = len(found)
                found.append((tuple(v.site[1].order) if v.site[1] is not None else (), o))


_LITERAL_CAUSE = (
    "a non-finite constant written in the program (jnp.inf, jnp.nan, float('inf')) makes the value non-finite"
)
_MOVES = frozenset(
    {"broadcast_in_dim", "reshape", "convert_element_type", "squeeze", "expand_dims", "transpose", "copy"}
)


def _fills_a_mask(analysis: Analysis, node: Node, depth: int = 8) -> bool:
    """True when the constant that ``node`` takes in is, after shape moves, the fill of a ``select_n``
    (``jnp.where(mask, x, -jnp.inf)``): a mask, whose fault is in what it covers, not in the constant."""
    frontier = [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if n is OUT:
                continue
            if not n.link and n.prim in ("select_n", "clamp"):
                return True
            if n.link or n.prim in _MOVES:
                nxt += [c for o in n.outs for c in analysis.consumers.get(id(o), [])]
        frontier = nxt
    return False


def _returned_as_is(analysis: Analysis, v: Val) -> bool:
    """True when ``v`` reaches the outputs through links only (no equation computes on it)."""
    return any(_first_real(analysis, c) is None for c in analysis.consumers.get(id(v), []))


def _literal_origin(analysis: Analysis, v: Val, then: str = "") -> Origin:
    """The origin of a non-finite constant: ``nonfinite.literal`` at the line that writes it. Returned as is:
    the enclosing cond/switch, a custom_vjp backward rule's return, a jitted function's return; passed
    straight to the user's function (``then``: what its first operation made of it): the call."""
    jaxpr, ctx = v.site if v.site is not None else (None, None)
    stack = ctx.stack if ctx is not None else ""
    phase = "backward" if "transpose(" in stack or (ctx is not None and ctx.phase == "backward") else "forward"
    frame = ctx.frame if ctx is not None else None
    if v.site is None and v.entry is not None:
        frame, phase, stack, ctx = v.entry.frame, v.entry.phase, v.entry.stack, v.entry.ctx
    else:
        bwd = literal_in_custom_vjp_bwd(analysis.vjp_records())  # a backward rule returning the constant
        if bwd is not None:
            frame, phase = bwd, "backward"
    if frame is None and jaxpr is not None:
        frame = return_line(getattr(jaxpr, "debug_info", None))
    file, line = frame if frame else (None, None)
    n_nan, n_inf = nonfinite_counts(v.value)
    a = np.asarray(raw(v.value))
    what = "NaN" if n_nan else ("-Inf" if (a[np.isinf(a)] < 0).all() else "Inf")
    where = list(ctx.tags) if ctx is not None else []
    return Origin(
        "nonfinite.literal",
        "literal",
        phase,
        file,
        line,
        source_text(file, line),
        stack,
        f"a {what} constant written in the program is "
        + ("passed to the function called here" if then else "returned as is")
        + f" ({n_nan} NaN, {n_inf} Inf)",
        "the program itself "
        + ("passes" if then else "returns")
        + " a non-finite constant (jnp.nan, jnp.inf, float('nan')): no computation made it",
        "pass or return a finite value (or compute it); if the constant marks 'no value', replace it before it "
        "reaches the loss or the gradients (jnp.where(..., fallback))",
        analysis.reaches(v),
        where,
        then,
    )


def literal_in_custom_vjp_bwd(records: list) -> tuple[str, int] | None:
    """The line of a recorded custom_vjp's backward rule that writes a non-finite constant, or None."""
    for _, obj, specs in records:
        if specs is None or getattr(obj, "nondiff_argnums", None):
            continue
        try:
            out, res = jax.eval_shape(obj.fwd, *specs[0], **specs[1])
            bwd = jax.make_jaxpr(obj.bwd)(res, out)
        except Exception:  # noqa: BLE001 - a rule we cannot re-trace
            continue
        if any(_nonfinite_literal(a) for a in bwd.jaxpr.outvars):
            return return_line(bwd.jaxpr.debug_info)
        for e in all_eqns(bwd.jaxpr):
            if any(_nonfinite_literal(a) for a in e.invars) and user_frame(e) is not None:
                return user_frame(e)
    return None


def _nonfinite_literal(a) -> bool:
    from jax._src import core as jcore

    if not isinstance(a, jcore.Literal):
        return False
    try:
        return bool(is_inexact(np.asarray(a.val)) and not np.isfinite(np.asarray(a.val)).all())
    except TypeError:  # pragma: no cover - a literal of an extended dtype
        return False


def return_line(debug_info) -> tuple[str, int] | None:
    """``(file, line)`` of the ``return`` of the function a jaxpr was traced from (its ``debug_info``), preferring
    one that writes nan/inf; the lambda's own line for a lambda; None when the source cannot be read."""
    m = re.match(r"^(.*) at (.+):(\d+)$", str(getattr(debug_info, "func_src_info", "") or ""))
    if m is None:
        return None
    name, file, first = m.group(1), m.group(2), int(m.group(3))
    if is_library_file(file):
        return None
    if name == "<lambda>":
        return file, first
    try:
        tree = ast.parse("".join(linecache.getlines(file)))
    except SyntaxError:
        return file, first
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name != name:
            continue
        if first not in [node.lineno] + [d.lineno for d in node.decorator_list]:
            continue
        returns = _returns_of(node)
        if not returns:
            return file, first
        text = [r for r in returns if re.search(r"nan|inf", ast.unparse(r).lower())]
        return file, (text or returns)[-1].lineno
    return file, first


def _returns_of(fn: ast.AST) -> list[ast.Return]:
    """The ``return`` statements of a function, not those of functions nested in it."""
    found: list[ast.Return] = []
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Return):
            found.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))
    return sorted(found, key=lambda r: r.lineno)


def _input_sources(node: Node) -> list[Val]:
    """The function inputs whose infinities alone make ``node``'s NaN (``sin(inf)``, ``inf - inf``): every
    non-finite value on the way descends from an input, none from a constant or from finite values. Empty
    when ``node`` computes on finite values only, or an inf on the way was born in the program."""
    stack, seen, found = [x for x in node.ins if x.bad], set(), []
    if not stack or not any(o.nan for o in node.outs):
        return []
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        p = v.producer
        if p is None:
            if v.kind != "input" and v.entry is None:
                return []  # a constant of the program (a -inf mask written in the code)
            found.append(v)  # an input, or a constant passed straight to the user's function (f(jnp.inf))
            continue
        if not p.link and p.inner is not None:
            k = next((i for i, o in enumerate(p.outs) if o is v), -1)
            nxt = [x for x in p.inner[k] if x.bad] if k >= 0 else []
        else:
            nxt = [x for x in p.ins if x.bad]
        if not nxt:
            return []  # born from finite values inside the program
        stack += nxt
    return found


def _input_origin(analysis: Analysis, v: Val, then: str = "") -> Origin:
    n_nan, n_inf = nonfinite_counts(v.value)
    return Origin(
        "nonfinite.input",
        "input",
        "input",
        None,
        None,
        "",
        "",
        f"{v.name} holds {n_nan} NaN and {n_inf} Inf before any computation",
        "the function's input is already non-finite",
        "check the data pipeline (jaxsane.check_data) or the state passed in; repair or drop bad rows",
        analysis.reaches(v),
        [],
        then,
    )


def _origin_of(analysis: Analysis, node: Node) -> Origin:
    phase = node.phase
    deriv = phase == "forward" and "jvp(" in node.stack and analysis.only_backward(node) and _is_coefficient(node)
    if deriv:
        phase = "backward"
    elif phase == "backward" and node.prim in _COEFF_PRIMS and not any(x.bad for x in node.ins):
        deriv = _primal_of(node) is not None  # e.g. a derivative recomputed by remat in the backward pass
    frame = node.frame
    if phase == "backward":
        frame = _custom_vjp_bwd_frame(node, analysis.vjp_records()) or frame
    file, line = frame if frame else (None, None)
    reaches = analysis.reaches(node)
    if phase == "update" and reaches and all(p.startswith(("metrics", "loss")) for p in reaches):
        phase = "forward"  # computed after the gradients, but only for the reported metrics
    info: Cause = explain(analysis, node, phase=phase, derivative=deriv)
    if id(node) in analysis.unopened:  # an opaque call: say so rather than blame it as the computation
        why = analysis.unopened[id(node)][:160]
        info = dataclasses.replace(info, values=f"{info.values}; its body could not be replayed ({why})")
    where = list(node.ctx.tags)
    shard = _shard_index(node)
    if shard:
        where.append(shard)
    if "vmap(" in node.stack:
        rows = _batch_rows(analysis, node)
        if rows:
            where.append("batch index " + ", ".join(map(str, rows[:8])) + (" ..." if len(rows) > 8 else ""))
    code = {"forward": "nonfinite.forward", "backward": "nonfinite.backward", "update": "nonfinite.update"}[phase]
    return Origin(
        code,
        node.prim,
        phase,
        file,
        line,
        source_text(file, line),
        node.stack,
        info.values,
        info.cause,
        info.fix,
        reaches,
        where,
        info.then,
        context=_context_of(node, phase, frame),
    )


def _context_of(node: Node, phase: str, frame) -> OriginContext:
    """What the replay holds at ``node`` for the debugger: values by reference, the user's call chain
    (the innermost frame is the origin's own line, e.g. inside a custom_vjp backward rule), the
    forward equation of a backward origin and the loop iterations around it."""
    chain = user_chain(node.eqn, node.ctx.eqns)
    if frame is not None and (not chain or tuple(chain[-1][:2]) != tuple(frame)):
        chain.append((frame[0], frame[1], "<backward rule>" if phase == "backward" else "<traced code>", frame[1]))
    primal = None
    if phase == "backward":
        p = primal_eqn(node, backward="transpose(" in node.stack)
        if p is not None and p is not node:
            primal = (p.prim, [raw(x.value) for x in p.ins], [raw(o.value) for o in p.outs])
    iterations = []
    for tag in node.ctx.tags:
        kind, _, index = str(tag).partition(" iteration ")
        if index.isdigit():
            iterations.append((kind, int(index)))
    return OriginContext(
        node.prim,
        dict(node.eqn.params) if node.eqn is not None else {},
        [raw(x.value) for x in node.ins],
        [raw(o.value) for o in node.outs],
        chain,
        primal,
        iterations,
    )


_COEFF_PRIMS = ("div", "rsqrt", "pow", "integer_pow", "mul", "sqrt", "log")


def _is_coefficient(node: Node) -> bool:
    """True when ``node`` computes a derivative coefficient (``0.5 / sqrt(x)`` after ``sqrt(0)``, the
    ``x ** -2`` of ``x / y``'s derivative): its primal equation is another one, or it is a custom_vjp
    forward rule's residual. A primal computation that
    the gradient alone reads (``1 / 0`` in a loss whose value ``jax.grad`` drops) stays a forward origin."""
    if node.eqn is not None and any(fr.function_name == "_flatten_fwd" for fr in frames_of(node.eqn)):
        return True  # computed by a custom_vjp forward rule for the backward rule alone: a residual
    p = primal_eqn(node)
    return p is not None and p is not node


def _primal_of(node: Node):
    p = primal_eqn(node, backward=True)
    return p if p is not None and p is not node else None


def _shard_index(node: Node) -> str:
    if node.ctx.mesh is None:
        return ""
    names, sizes = node.ctx.mesh
    for o in node.outs:
        if o.bad:
            a = np.asarray(raw(o.value))
            lead = a.reshape(*sizes, -1)
            bad = ~np.isfinite(lead).all(axis=-1)
            coords = [tuple(int(c) for c in idx) for idx in np.argwhere(bad)]
            flat = [int(np.ravel_multi_index(c, sizes)) for c in coords]
            return "shard " + ", ".join(map(str, flat)) + f" of {int(np.prod(sizes))} (mesh axes {names})"
    return ""


def _batch_rows(analysis: Analysis, node: Node) -> list[int]:
    rows: set[int] = set()
    reached = set(analysis.reaches(node))
    for vid, paths in analysis.out_of.items():
        v = analysis.vals.get(vid)
        if v is None or not set(paths) & reached:
            continue
        a = np.asarray(raw(v.value))
        if a.ndim >= 1:
            rows |= set(int(i) for i in np.flatnonzero(~np.isfinite(a.reshape(a.shape[0], -1)).all(axis=1)))
    return sorted(rows)
