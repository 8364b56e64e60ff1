"""Precision, located: a low-precision program against its float32 reference, equation by equation.

:func:`compare_precision` traces ``fn`` to a jaxpr and evaluates it ONCE with jaxsane's one interpreter
(``_jaxpr/interpret.py``) in lockstep: each equation runs as written (bf16/fp16) and, in the tags, in the
reference dtype (float32, or float64 with x64) on the reference values. For every primitive equation that
touches a low-precision value three results exist:

* ``out``: the equation as written, on the values as written;
* ``local``: the SAME equation on the SAME (as-written) inputs, upcast and evaluated in the reference dtype:
  ``|out - local| / |local|`` (normwise) is the error this equation alone adds (its rounding);
* ``ref``: the equation on the reference inputs: ``|out - ref| / |ref|`` is the error propagated so far.

A correctly rounded equation adds at most half an ulp (``eps/2``). An equation is reported when its local
error exceeds ``local_tol`` x eps (an accumulation in low precision: a sum, mean, cumsum or dot over a long
axis), when its propagated error jumps ``jump`` -fold over the largest of its inputs' and above
``local_tol`` x eps (cancellation: ``1 - p`` with ``p`` near 1, ``log(1 + x)`` with small ``x``; large
condition numbers), or when it overflows to inf (or flushes to zero) where the reference is finite
(``precision.overflow``). Each report names file:line, the primitive, the pass (forward; backward for
equations of a transposed ``jvp``; update for optax's) and the classic cause with its fix.

Loops (``scan``/``while``/``cond``) run as written and restart the reference from their outputs (nothing
inside a loop body is compared). Host-side (concrete values); not jit-safe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.finding import Finding
from .._core.frames import frames_of, in_optax, is_library_file, user_frame, user_location
from .._jaxpr.interpret import CALLS, LOOPS, Interpreter, bind_eqn
from .underflow import LOW_PRECISION

REDUCTIONS = ("reduce_sum", "cumsum", "dot_general", "reduce_prod", "cumprod", "conv_general_dilated")
NAMED_FUNCTIONS = {
    "softmax": "softmax",
    "_softmax": "softmax",
    "log_softmax": "log_softmax",
    "logsumexp": "logsumexp",
    "var": "variance",
    "std": "standard deviation",
    "layer_norm": "layer norm",
}
AMPLIFIERS = ("sub", "add", "log", "log1p", "div", "pow", "exp", "rsqrt", "sqrt")  # ill-conditioned near some input
TINY = {jnp.dtype(jnp.float16): 6.103515625e-05, jnp.dtype(jnp.bfloat16): 1.1754943508222875e-38}
MAX = {jnp.dtype(jnp.float16): 65504.0, jnp.dtype(jnp.bfloat16): 3.3895313892515355e38}


@dataclasses.dataclass
class EqnPrecision:
    """One compared equation: its primitive, where, pass, dtype, and local/propagated normwise errors."""

    prim: str
    where: str | None
    file: str | None
    line: int | None
    phase: str
    dtype: str
    local: float
    propagated: float
    inputs: float
    overflow: bool
    underflow: bool
    size: int
    named: str | None
    cause: str = ""
    fix: str = ""
    ref_max: float = 0.0
    ref_min: float = 0.0
    tainted: bool = False  # an input is already inf/NaN as written: a consequence of an earlier overflow


def _is_low(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.dtype(x.dtype) in LOW_PRECISION


def _relerr(out: Any, ref: Any) -> float:
    a, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    ok = np.isfinite(a) & np.isfinite(r)
    if not ok.any():
        return 0.0
    den = float(np.linalg.norm(r[ok]))
    num = float(np.linalg.norm(a[ok] - r[ok]))
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


class _Lockstep(Interpreter):
    """Evaluates a jaxpr as written, with each value's reference (upcast) value as its tag. Not jit-safe."""

    def __init__(self, ref_dtype: Any):
        super().__init__()
        self.ref_dtype = jnp.dtype(ref_dtype)
        self.rows: list[EqnPrecision] = []
        self.producers: dict[Any, Any] = {}

    def up(self, x: Any) -> Any:
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype) != self.ref_dtype:
            return jnp.asarray(x).astype(self.ref_dtype)
        return x

    def ref_bind(self, eqn, invals: list) -> list:
        """``eqn`` evaluated in the reference dtype (its low-precision dtype parameters raised)."""
        params = dict(eqn.params)
        for key in ("new_dtype", "preferred_element_type", "dtype"):
            if key in params and params[key] is not None and jnp.dtype(params[key]) in LOW_PRECISION:
                params[key] = self.ref_dtype
        if eqn.primitive.name == "reduce_precision":
            return [invals[0]]
        return bind_eqn(eqn.replace(params=params), [self.up(x) for x in invals])

    def before(self, eqn, invals, tags, ectx):
        name = eqn.primitive.name
        if name in CALLS:
            return None  # recurse: the tags follow the values into the body
        outs = bind_eqn(eqn, invals)
        if name in LOOPS or any(isinstance(v, jax.core.Tracer) for v in invals):
            return outs, [self.up(o) for o in outs]
        for v in eqn.outvars:
            self.producers[v] = eqn
        touches_low = any(_is_low(x) for x in (*invals, *outs))
        refs_in = [t if t is not None else self.up(x) for x, t in zip(invals, tags)]
        try:
            ref = self.ref_bind(eqn, refs_in)
        except Exception:  # a primitive that insists on its dtypes: restart the reference here
            return outs, [self.up(o) for o in outs]
        if touches_low and outs and hasattr(outs[0], "dtype") and jnp.issubdtype(outs[0].dtype, jnp.floating):
            try:
                local = self.ref_bind(eqn, list(invals))
            except Exception:
                local = ref
            self.record(eqn, invals, tags, outs[0], local[0], ref[0])
        return outs, ref

    def record(self, eqn, invals, tags, out, local, ref) -> None:
        low = [x for x in (*invals, out) if _is_low(x)]
        dtype = jnp.dtype(low[0].dtype) if low else jnp.dtype(out.dtype)
        o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
        lo = np.asarray(local, np.float64)
        overflow = bool(np.any(~np.isfinite(o) & np.isfinite(lo)))
        underflow = bool(_is_low(out) and np.any((o == 0) & (lo != 0) & (np.abs(lo) < TINY.get(dtype, 0) / 2)))
        inputs = max(
            (_relerr(x, t) for x, t in zip(invals, tags) if t is not None and hasattr(x, "dtype")), default=0.0
        )
        stack = " ".join(str(e.source_info.name_stack) for e in (*self.path, eqn))
        enclosing = [e.params.get("name") for e in self.path if e.params.get("name")]
        enclosing += [fr.function_name for fr in reversed(frames_of(eqn)) if is_library_file(fr.file_name)]
        named = next((NAMED_FUNCTIONS[n] for n in reversed(enclosing) if n in NAMED_FUNCTIONS), None)
        frame = user_frame(eqn) or _frame_of(user_location(eqn, self.path))
        phase = "update" if in_optax(eqn) else "backward" if "transpose(" in stack else "forward"
        finite_ref = np.abs(lo[np.isfinite(lo)])
        self.rows.append(
            EqnPrecision(
                prim=eqn.primitive.name,
                where=f"{frame[0]}:{frame[1]}" if frame else None,
                file=frame[0] if frame else None,
                line=frame[1] if frame else None,
                phase=phase,
                dtype=str(dtype),
                local=_relerr(out, local),
                propagated=_relerr(out, r),
                inputs=inputs,
                overflow=overflow,
                underflow=underflow,
                size=int(max((np.size(x) for x in invals), default=1)),
                named=named,
                ref_max=float(finite_ref.max()) if finite_ref.size else 0.0,
                ref_min=float(finite_ref[finite_ref > 0].min()) if (finite_ref > 0).any() else 0.0,
                tainted=any(
                    not np.all(np.isfinite(np.asarray(x, np.float64)))
                    for x in invals
                    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
                ),
            )
        )
        self.rows[-1].cause, self.rows[-1].fix = _classify(eqn, self.rows[-1], self.producers)


def _frame_of(where: str | None) -> tuple[str, int] | None:
    if not where or ":" not in where:
        return None
    file, _, line = where.rpartition(":")
    return (file, int(line)) if line.isdigit() else None


def _literal_one(eqn, producers: dict) -> bool:
    """``eqn`` (an add/sub) has an operand equal to 1 (a literal, or a broadcast/convert of one)."""
    for v in eqn.invars:
        val = getattr(v, "val", None)
        if (
            val is None
            and v in producers
            and producers[v].primitive.name in ("broadcast_in_dim", "convert_element_type")
        ):
            val = getattr(producers[v].invars[0], "val", None)
        if val is not None and np.size(val) and np.all(np.asarray(val, np.float64) == 1.0):
            return True
    return False


def _classify(eqn, row: EqnPrecision, producers: dict) -> tuple[str, str]:
    """The classic cause of a precision loss at ``eqn`` and its fix (empty when none applies)."""
    prim, dt = row.prim, row.dtype
    if row.overflow:
        scale = 2.0 ** np.floor(np.log2(MAX.get(jnp.dtype(dt), 6.5e4) / max(row.ref_max, 1e-30)))
        return (
            f"{dt} overflow: |value| reaches {row.ref_max:.3g} (the {dt} maximum is {MAX.get(jnp.dtype(dt), 0):.5g})",
            f"compute this in float32, or scale it down: a loss scale of {scale:g} (2^{int(np.log2(scale))}) "
            "keeps it finite (jmp.DynamicLossScale finds it each step)",
        )
    if row.underflow:
        return (
            f"{dt} underflow: values as small as {row.ref_min:.3g} flush to zero",
            "scale the loss up (jmp.DynamicLossScale / a static loss scale) or compute this in float32",
        )
    if row.named:
        return (
            f"{row.named} computed in {dt}",
            f"compute the {row.named} in float32 (x.astype(jnp.float32)) and cast the result back",
        )
    if prim in REDUCTIONS:
        return (
            f"a {'sum/mean' if prim != 'dot_general' else 'dot product'} over {row.size} elements accumulated in {dt}",
            "accumulate in float32: jnp.sum(x, dtype=jnp.float32) / x.astype(jnp.float32).mean(), "
            "or preferred_element_type=jnp.float32 for a dot",
        )
    if prim == "log" and eqn.invars and eqn.invars[0] in producers:
        src = producers[eqn.invars[0]]
        if src.primitive.name == "add" and _literal_one(src, producers):
            return ("log(1 + x) cancellation: 1 + x rounds away the digits of a small x", "use jnp.log1p(x)")
    if prim in ("sub", "add") and _literal_one(eqn, producers):
        return (
            "1 - p cancellation: p is near 1, so 1 - p keeps only the digits p had left",
            "compute the complement directly (jax.nn.sigmoid(-z) for 1 - sigmoid(z), log1p(-p) or log_sigmoid)"
            " or in float32",
        )
    if prim == "sub":
        return ("cancellation: the difference of two close values", "compute it in float32")
    return (f"precision lost in {prim} ({dt})", "compute this equation in float32")


def compare_precision(
    fn: Callable,
    *args: Any,
    dtype: Any = None,
    reference: Any = jnp.float32,
    local_tol: float = 2.0,
    jump: float = 10.0,
    top: int = 5,
) -> list[Finding]:
    """Run ``fn(*args)`` as written and in a ``reference`` float dtype in lockstep, equation by equation, and
    name the first equations where precision is lost (``precision.lost``/``precision.overflow`` findings with
    file:line, the primitive, the pass and the fix). Not jit-safe (host-side, concrete values).

    Args:
      fn: the function (a loss, a train step, a model's apply).
      args: its arguments, as the program runs them.
      dtype: when given (jnp.bfloat16, jnp.float16), the float32 leaves of ``args`` are first cast to it
        ("run my float32 program in bf16"); None: the program's own dtypes.
      reference: the reference dtype (float32; float64 when x64 is on).
      local_tol: an equation's own error above ``local_tol`` x eps of its dtype is reported.
      jump: ... as is a propagated error that grew this many times over its inputs' (and above
        ``local_tol`` x eps): cancellation or a large condition number.
      top: report at most this many equations, in program order.

    Returns:
      Findings, empty when no equation lost more than rounding (a correct bf16 program).
    """
    if dtype is not None:
        args = jax.tree_util.tree_map(
            lambda x: x.astype(dtype) if hasattr(x, "dtype") and jnp.dtype(x.dtype) == jnp.float32 else x, args
        )
    rows = precision_table(fn, *args, reference=reference)
    return findings_of(rows, local_tol=local_tol, jump=jump, top=top)


def precision_table(fn: Callable, *args: Any, reference: Any = jnp.float32) -> list[EqnPrecision]:
    """Every compared equation of ``fn(*args)`` in program order (see :func:`compare_precision`). Not jit-safe."""
    flat, treedef = jax.tree_util.tree_flatten(args)

    def flat_fn(*leaves):
        return fn(*jax.tree_util.tree_unflatten(treedef, list(leaves)))

    closed = jax.make_jaxpr(flat_fn)(*flat)
    it = _Lockstep(reference)
    it.run(closed.jaxpr, closed.consts, flat, tags=[it.up(x) for x in flat])
    return it.rows


def _eps(dtype: str) -> float:
    return float(jnp.finfo(jnp.dtype(dtype)).eps)


def findings_of(
    rows: Sequence[EqnPrecision], *, local_tol: float = 2.0, jump: float = 10.0, top: int = 5
) -> list[Finding]:
    """The reportable rows as findings (first ``top`` in program order, one per file:line and cause)."""
    out: list[Finding] = []
    seen: set = set()
    for r in rows:
        eps = _eps(r.dtype)
        lost_here = r.local > local_tol * eps
        jumped = r.propagated > local_tol * eps and r.propagated > jump * max(r.inputs, eps / 2)
        if not (r.overflow or r.underflow or lost_here or jumped) or (r.tainted and not r.overflow):
            continue
        if not (r.overflow or r.underflow or lost_here) and r.prim not in AMPLIFIERS:
            continue  # a jump at a well-conditioned op is the inputs' error, reported where it arose
        key = (r.where, r.overflow)  # one report per line (an overflow and the ops it feeds: the first)
        if key in seen:
            continue
        seen.add(key)
        code = "precision.overflow" if r.overflow else "precision.lost"
        err = "inf" if r.overflow else f"{max(r.local, r.propagated):.3g}"
        out.append(
            Finding(
                code,
                f"{r.cause} at {r.where or 'an unknown line'} ({r.prim}, {r.phase} pass): relative error {err} "
                f"against float32 (this equation alone: {r.local:.3g}; its inputs: {r.inputs:.3g}; {r.dtype} eps "
                f"{eps:.3g})",
                r.fix,
                file=r.file,
                line=r.line,
                path=r.prim,
                extra={
                    "prim": r.prim,
                    "phase": r.phase,
                    "dtype": r.dtype,
                    "local": r.local,
                    "propagated": r.propagated,
                    "inputs": r.inputs,
                    "size": r.size,
                    "cause": r.cause,
                },
            )
        )
        if len(out) >= top:
            break
    return out
