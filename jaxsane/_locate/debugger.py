"""A post-mortem debugger at the origin of a NaN: a ``pdb`` session stopped in the user's own line.

``jax.debug.breakpoint`` leaks tracers under nested ``jit`` and does not work inside ``nnx.jit``;
``jax_debug_nans`` stops deep inside jax. Here :func:`locate` has already replayed the step on the real
values and found the equation that made the first NaN/Inf; :func:`post_mortem` opens ``pdb`` there,
after the fact. pdb can only stop in a frame that exists, so one real Python frame is built per user
frame of the origin's call chain (the user frames of the equation's traceback, inside the step; jax's
own frames are left out): each is a tiny function compiled with the user's file name whose statement
sits on the user's line (and whose ``def`` sits on the user function's first line), the outermost
calling the next. The innermost raises, and pdb runs post mortem on that traceback, so ``l``/``ll``
show the user's source (linecache reads the real file), ``where`` lists the user's call chain and
``up``/``down`` walk it.

The innermost frame's locals are the failing equation's operands and result as numpy arrays
(``operands``, ``in0``, ``in1``, ..., ``result``; an operand is also named after the user's variable
when the source line spells it as a plain name in a call or operator matching the primitive, e.g.
``x`` for ``jnp.log(x)``), ``primitive``, ``params``, ``phase``, ``origin``, ``iteration`` (the
``scan``/``while`` iteration, else None), for a backward origin the forward equation's
``primal_operands``/``primal_result`` (and the user's names for them), and ``inputs``: the step's input
leaves by path (``inputs["batch['x']"]``). The frame of the step function itself holds its arguments by
their parameter names. Every frame sees ``origin``, ``report``, ``phase``, ``primitive``, ``iteration``,
``inputs`` and ``np``.

Nothing is traced or compiled inside the debugger. Not jit-safe: host-side only, after a failure.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import keyword
import pdb
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .._core.errors import NonFiniteError
from .._core.frames import display_location
from .._core.validate import fail, require_int
from .._experiment.purify import unwrap
from .locate import locate
from .result import LocateReport, Origin, OriginContext

# call name in the user's source -> the primitives it makes (default: the same name)
_CALLS = {
    "divide": ("div",),
    "true_divide": ("div",),
    "multiply": ("mul",),
    "subtract": ("sub",),
    "add": ("add",),
    "power": ("pow", "integer_pow"),
    "float_power": ("pow",),
    "negative": ("neg",),
    "arcsin": ("asin",),
    "arccos": ("acos",),
    "arctan": ("atan",),
    "arctanh": ("atanh",),
    "arcsinh": ("asinh",),
    "arccosh": ("acosh",),
    "arctan2": ("atan2",),
    "maximum": ("max",),
    "minimum": ("min",),
    "sigmoid": ("logistic",),
    "reciprocal": ("div", "integer_pow"),
    "square": ("square", "integer_pow"),
    "log": ("log",),
    "mod": ("rem",),
    "remainder": ("rem",),
}
_OPS = {
    ast.Div: ("div",),
    ast.Mult: ("mul",),
    ast.Add: ("add",),
    ast.Sub: ("sub",),
    ast.Mod: ("rem",),
    ast.Pow: ("pow", "integer_pow"),
    ast.MatMult: ("dot_general",),
}
_HELPERS = ("__jaxsane_next__", "__jaxsane_args__", "__jaxsane_stop__")


class _Stop(Exception):
    """Raised in the innermost synthetic frame; its traceback is what pdb debugs."""


# ----------------------------------------------------------------------------- naming the operands


def _parse(text: str) -> ast.AST | None:
    text = text.strip()
    for candidate in (text, text.rstrip(",\\"), f"({text.rstrip(',')})"):
        try:
            return ast.parse(candidate)
        except SyntaxError:
            continue
    return None


def _call_name(func: ast.AST) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def source_names(source: str, primitive: str, n_operands: int) -> dict[str, int]:
    """``{user variable: operand index}`` read off one source line: the plain names passed to the one call
    (``jnp.log(x)``) or operator (``a / b``) on the line that makes ``primitive`` with ``n_operands``
    operands; empty when the line has none or several such spots (no guessing). Not jit-safe."""
    tree = _parse(source) if source else None
    if tree is None:
        return {}
    spots: list[list[ast.AST]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and not node.keywords:
            name = _call_name(node.func)
            if primitive in _CALLS.get(name, (name,)) and len(node.args) == n_operands:
                spots.append(list(node.args))
        elif isinstance(node, ast.BinOp) and primitive in _OPS.get(type(node.op), ()):
            if primitive == "integer_pow" and n_operands == 1 and isinstance(node.right, ast.Constant):
                spots.append([node.left])
            elif n_operands == 2:
                spots.append([node.left, node.right])
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and primitive == "neg" and n_operands == 1:
            spots.append([node.operand])
    if len(spots) != 1:
        return {}
    names = {}
    for i, arg in enumerate(spots[0]):
        if isinstance(arg, ast.Name) and arg.id not in names:
            names[arg.id] = i
    return names


# ----------------------------------------------------------------------------- the frames' variables


def _host(x: Any) -> Any:
    """A value as a numpy array (pytrees of arrays leaf by leaf); anything else as it is."""
    try:
        if isinstance(x, (jax.Array, np.ndarray, np.generic)):
            return np.asarray(x)
        if isinstance(x, (dict, list, tuple)):
            return jax.tree_util.tree_map(lambda a: np.asarray(a) if isinstance(a, jax.Array) else a, x)
    except Exception:  # noqa: BLE001 - a value that does not come to the host (not addressable): keep it
        pass
    return x


def _ok(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name) and not name.startswith("__jaxsane")


def _origin_vars(origin: Origin, ctx: OriginContext) -> dict[str, Any]:
    """The innermost frame's locals: the failing equation's values, named."""
    operands = [_host(x) for x in ctx.operands]
    results = [_host(x) for x in ctx.results]
    bad = [r for r in results if isinstance(r, np.ndarray) and r.dtype.kind in "fc" and not np.isfinite(r).all()]
    out: dict[str, Any] = {}
    if ctx.primal is not None:  # backward: the user's names belong to the forward equation's operands
        prim, p_ops, p_res = ctx.primal
        primal_operands = [_host(x) for x in p_ops]
        out.update({k: primal_operands[i] for k, i in source_names(origin.source, prim, len(p_ops)).items()})
        out.update(
            primal_primitive=prim,
            primal_operands=primal_operands,
            primal_result=_host(p_res[0]) if len(p_res) == 1 else [_host(x) for x in p_res],
        )
    elif origin.phase != "backward":
        out.update({k: operands[i] for k, i in source_names(origin.source, ctx.primitive, len(operands)).items()})
    out.update({f"in{i}": v for i, v in enumerate(operands)})
    out.update(
        operands=operands,
        result=bad[0] if bad else (results[0] if results else None),
        primitive=ctx.primitive,
        params=dict(ctx.params),
        phase=origin.phase,
        origin=origin,
        iteration=ctx.iterations[-1][1] if ctx.iterations else None,
        inputs={k: _host(v) for k, v in ctx.inputs.items()},
    )
    if len(results) > 1:
        out["results"] = results
    if len(ctx.iterations) > 1:
        out["iterations"] = [i for _, i in ctx.iterations]
    return {k: v for k, v in out.items() if _ok(k)}


def _step_vars(ctx: OriginContext, frame: tuple) -> dict[str, Any]:
    """The arguments of the traced function, by parameter name, when ``frame`` is that function's frame."""
    if ctx.call is None:
        return {}
    fn, args, kwargs = ctx.call
    inner = unwrap(fn)
    code = getattr(inner, "__code__", None)
    if code is None or code.co_filename != frame[0] or code.co_firstlineno != frame[3]:
        return {}
    try:
        bound = inspect.signature(inner).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return {}
    return {k: _host(v) for k, v in bound.arguments.items() if _ok(k)}


# ----------------------------------------------------------------------------- the frames


def _frame_function(
    file: str, line: int, function: str, start: int, params: Sequence[str], statement: str, globs: dict
) -> Callable:
    """A function whose ``def`` is on ``start`` and whose one ``statement`` is on ``line`` of ``file``."""
    line = max(int(line or 1), 1)
    start = int(start) if start and 0 < int(start) <= line else line
    sig = ", ".join(params)
    if start == line:
        src = "\n" * (line - 1) + f"def __jaxsane_frame__({sig}): {statement}\n"
    else:
        src = "\n" * (start - 1) + f"def __jaxsane_frame__({sig}):\n" + "\n" * (line - start - 1) + f"    {statement}\n"
    ns: dict = {}
    exec(compile(src, file, "exec"), globs, ns)  # noqa: S102 - our own two-line source, no user input
    fn = ns["__jaxsane_frame__"]
    qualname = function or "<traced code>"
    short = qualname.rsplit(".", 1)[-1] or qualname
    fn.__code__ = fn.__code__.replace(co_name=short, co_qualname=qualname)
    return fn


def _traceback(chain: list[tuple], frame_vars: list[dict], common: dict):
    """Build and run one frame per ``chain`` entry (outermost first) with ``frame_vars`` as its locals;
    return the traceback of the innermost frame's raise, starting at the outermost frame."""
    globs = [{"__builtins__": builtins, "__name__": "jaxsane.post_mortem", **common} for _ in chain]
    fns: list[Callable] = []
    for k in reversed(range(len(chain))):
        file, line, function, start = chain[k]
        if k == len(chain) - 1:
            globs[k]["__jaxsane_stop__"] = _Stop()
            statement = "raise __jaxsane_stop__"
        else:
            globs[k]["__jaxsane_next__"], globs[k]["__jaxsane_args__"] = fns[0], frame_vars[k + 1]
            statement = "__jaxsane_next__(**__jaxsane_args__)"
        fns.insert(0, _frame_function(file, line, function, start, list(frame_vars[k]), statement, globs[k]))
    tb = None
    try:
        fns[0](**frame_vars[0])
    except _Stop as e:
        tb = e.__traceback__
    finally:
        for g in globs:  # every call is over: the helpers go, so globals() shows only the user's names
            for name in _HELPERS:
                g.pop(name, None)
    while tb is not None and tb.tb_frame.f_code is not fns[0].__code__:
        tb = tb.tb_next
    return tb


def _report_of(target: Any) -> tuple[LocateReport | None, Origin | None]:
    if isinstance(target, NonFiniteError):
        target = target.located
    if isinstance(target, Origin):
        return None, target
    return target, None


def no_origin_reason(report: LocateReport | None) -> str | None:
    """Why :func:`post_mortem` cannot open a debugger on ``report`` (origins[0]), or None when it can."""
    if report is None:
        return "every output is finite on these inputs (no locate report): there is no NaN/Inf origin to stop at"
    if not report.origins:
        return (
            f"{report.summary()}. The equation-by-equation replay is finite, so no equation holds the "
            "NaN/Inf to stop at; run the step without jit or with XLA's fast-math flags off to confirm"
        )
    if report.origins[0].context is None:
        o = report.origins[0]
        return (
            f"the origin is a non-finite input ({o.values}): nothing the step computed made it, so there "
            "is no line to stop at; check the data (jaxsane.check_data) or inspect NonFiniteError.inputs"
        )
    return None


def post_mortem(report: Any, origin: int = 0, *, stdin: Any = None, stdout: Any = None) -> bool:
    """Open a post-mortem ``pdb`` session at a NaN's origin, stopped in the user's own line.

    ``l`` shows the user's file and line, ``where`` the user's call chain inside the step (not jax's
    frames), ``up``/``down`` walk it, ``p x`` prints an operand of the failing equation, ``c`` (or ``q``)
    leaves. The locals are listed when the session opens (see the module docstring: ``operands``,
    ``in0``..., ``result``, the user's names for the operands where the source line spells them,
    ``primitive``, ``phase``, ``origin``, ``iteration``, ``primal_operands`` for a backward origin,
    ``inputs``). Nothing is traced or compiled in the session.

    Not jit-safe: host-side only, after a failure.

    Args:
      report: a :class:`LocateReport` (from :func:`jaxsane.locate` or ``replay_dump``), one of its
        :class:`Origin` entries, or a :class:`NonFiniteError` (its ``located`` report).
      origin: which of ``report.origins`` to stop at (default the root cause, 0).
      stdin, stdout: the session's streams (default the terminal), as for ``pdb.Pdb``.

    Returns:
      True when a session was opened; False (after printing why, a ``[jaxsane]`` line) when there is
      no origin to stop at: finite outputs, a NaN only the compiled program makes, or a non-finite input.

    Raises:
      ArgumentError: ``report`` is none of those, or ``origin`` is not an int >= 0.
    """
    out = stdout if stdout is not None else sys.stdout
    if report is not None and not isinstance(report, (LocateReport, Origin, NonFiniteError)):
        raise fail(
            "jaxsane.post_mortem",
            "report",
            "a LocateReport, an Origin, a NonFiniteError or None",
            report,
            fix="pass what jaxsane.locate returned (or the NonFiniteError a guarded step raised)",
        )
    index = require_int("jaxsane.post_mortem", "origin", origin, min=0)
    assert index is not None  # (not optional)
    origin = index
    report, chosen = _report_of(report)
    if chosen is None:
        reason = no_origin_reason(report)
        if reason is None and origin >= len(report.origins):
            reason = f"origin={origin} is out of range: the report has {len(report.origins)} origin(s)"
        if reason is not None:
            print(f"[jaxsane] post_mortem: no debugger opened: {reason}.", file=out)
            return False
        chosen = report.origins[origin]
    ctx = chosen.context
    if ctx is None:
        print(f"[jaxsane] post_mortem: no debugger opened: {no_origin_reason(LocateReport([chosen], []))}.", file=out)
        return False
    chain = list(ctx.chain) or [
        (chosen.file or "<jaxsane: no user frame>", chosen.line or 1, "<traced code>", chosen.line or 1)
    ]
    innermost = _origin_vars(chosen, ctx)
    frame_vars = [_step_vars(ctx, fr) for fr in chain]
    frame_vars[-1] = {**frame_vars[-1], **innermost}  # the line's own operand names win over stale arguments
    common = {
        "np": np,
        "origin": chosen,
        "report": report,
        "phase": chosen.phase,
        "primitive": ctx.primitive,
        "iteration": innermost["iteration"],
        "inputs": innermost["inputs"],
    }
    tb = _traceback(chain, frame_vars, common)
    where = f" [{', '.join(chosen.where)}]" if chosen.where else ""
    names = ", ".join(k for k in frame_vars[-1] if k not in ("origin", "inputs")) + ", origin, inputs, np"
    print(
        f"[jaxsane] post-mortem at the origin: {chosen.primitive} ({chosen.phase}) at "
        f"{display_location(chosen.file, chosen.line)}{where}: {chosen.values}\n"
        f"  locals: {names}\n"
        f"  'where' lists your call chain, 'up'/'down' walk it, 'l' shows the source, 'c' leaves.",
        file=out,
    )
    debugger = pdb.Pdb(stdin=stdin, stdout=stdout, nosigint=True)
    if stdin is not None:
        debugger.use_rawinput = False  # pdb reads a given stdin only when it does not use input()
    debugger.reset()
    try:
        debugger.interaction(None, tb)
    except pdb.Restart:
        print("[jaxsane] post_mortem: 'restart' is not available in a post-mortem session at an origin.", file=out)
    return True


def debug_origin(fn: Callable, *args, **kwargs) -> LocateReport | None:
    """:func:`jaxsane.locate` ``fn`` on these inputs, print the report and open :func:`post_mortem` at
    ``origins[0]``; every keyword goes to ``fn`` (this function takes none of its own: use
    ``post_mortem(jaxsane.locate(...), stdin=..., ...)`` for options).

    Not jit-safe: it replays ``fn`` on the host, then debugs there.

    Returns:
      The report (None when every output is finite; then no debugger opens and a ``[jaxsane]`` line
      says so).
    """
    report = locate(fn, *args, **kwargs)
    if report is not None:
        print(report)
    post_mortem(report)
    return report


__all__ = ["debug_origin", "no_origin_reason", "post_mortem", "source_names"]
