"""Gradient checks: autodiff against finite differences, one parameter leaf at a time (``grad.*``).

Each float leaf of the differentiated arguments is checked on its own along one random
direction ``d``: ``g(t) = f(params with leaf + t * d)`` is a function of one scalar, and
:func:`jax.test_util.check_grads` compares its JVP/VJP with central finite differences. A leaf
costs a few evaluations of ``f`` whatever its size, so a 2M-parameter MLP is checked in seconds.
The check runs in float64 with x64 switched on only inside the check (``jax.enable_x64``);
parameters and float inputs are cast to float64 there, so float16/bfloat16/float32 models are
upcast. When the function still computes in a lower precision on the path from the parameters
(an explicit ``astype`` or ``dtype=jnp.bfloat16`` in a layer), the tolerances of that dtype are used.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np

from .._core.errors import JaxsaneError
from .._core.finding import Finding
from .._core.tree import leaves_with_paths
from .._core.validate import require_bool, require_callable, require_float, require_int
from .._jaxpr.compile_level import quick_jit
from .._jaxpr.interpret import bodies
from .grads_findings import (
    missing_finding,
    nonfinite_gradient_finding,
    nonfinite_loss_finding,
    nonfinite_nearby_finding,
    sampled_finding,
)
from .grads_kink import kink_at_every_step, kink_finding, probe_sub_directions

# effective compute dtype (by bits) -> (eps, atol, rtol). float64 is tighter than
# jax.test_util's 1e-5 step (eps 1e-6 keeps ReLU kinks out of the finite difference); the others
# follow jax.test_util.check_grads' default gradient tolerances (float32 2e-3, float16 1e-2,
# bfloat16 1e-1), loosened for float32/float16 because a loss of O(1) has finite-difference round-off
# of ~1e-7 / eps in float32.
GRAD_DEFAULTS: dict[str, tuple[float, float, float]] = {
    "float64": (1e-6, 1e-5, 1e-5),
    "float32": (1e-3, 5e-3, 2e-2),
    "float16": (1e-2, 5e-2, 5e-2),
    "bfloat16": (3e-2, 1e-1, 1e-1),
}


def _is_real_float(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return isinstance(x, float)
    try:
        return bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:  # key dtypes
        return False


def _tainted_float_dtypes(jaxpr, mask: Sequence[bool]) -> set:
    """Float dtypes of every value computed from the invars flagged in ``mask`` (recursing into calls)."""
    from jax.extend.core import Literal

    tainted = {v for v, m in zip(jaxpr.invars, mask) if m}
    found: set = set()
    for eqn in jaxpr.eqns:
        flags = [not isinstance(v, Literal) and v in tainted for v in eqn.invars]
        if not any(flags):
            continue
        for sub, index in bodies(eqn):
            found |= _tainted_float_dtypes(sub, [flags[i] for i in index])
        for out in eqn.outvars:
            dtype = getattr(out.aval, "dtype", None)
            if dtype is not None and _is_real_float(out.aval):
                found.add(np.dtype(dtype))
            tainted.add(out)
    return found


def _dtype_name(dtype: Any) -> str:
    name = np.dtype(dtype).name
    return name if name in GRAD_DEFAULTS else ("float64" if np.dtype(dtype).itemsize >= 8 else "float32")


def _lowest(dtypes: Iterable[Any], default: str) -> str:
    order = ["bfloat16", "float16", "float32", "float64"]
    names = [_dtype_name(d) for d in dtypes]
    for name in order:
        if name in names:
            return name
    return default


def _display(path: str) -> str:
    return path[: -len(".value")] if path.endswith(".value") else path


def _directional(h: Callable, t0: np.ndarray, eps: float) -> float:
    return float((h(t0 + eps) - h(t0 - eps)) / (2 * eps))


def check_grads(
    f: Callable,
    *args: Any,
    argnums: int | Sequence[int] = 0,
    order: int = 1,
    modes: Sequence[str] = ("fwd", "rev"),
    eps: float | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    dtype: Any = jnp.float64,
    has_aux: bool = False,
    seed: int = 0,
    root: str | Sequence[str] | None = None,
    kinks: bool = True,
    kink_rtol: float | None = None,
    max_leaves: int | None = 128,
) -> list[Finding]:
    """Compare ``f``'s autodiff gradients with finite differences, leaf by leaf.

    Every real float leaf of the arguments in ``argnums`` is checked on its own with
    :func:`jax.test_util.check_grads` along a random direction, so a failure names the leaf.
    Non-scalar outputs are projected on a fixed random cotangent.

    Args:
      f: the function, e.g. a loss ``(params, batch) -> scalar``. May be jitted.
      *args: its arguments; float leaves of every argument are cast to ``dtype``.
      argnums: which arguments' leaves to check (default the first, the parameters).
      order: derivative order checked (>= 1), as in ``jax.test_util.check_grads``.
      modes: ``"fwd"`` (JVP) and/or ``"rev"`` (VJP).
      eps: finite-difference step; default per compute dtype, see ``GRAD_DEFAULTS`` (float64:
        1e-6). A leaf that fails is re-checked at eps/10, /100, /1000 (float64; eps/3 otherwise)
        and reported only if it fails at every step and the gap does not shrink with the step
        (ReLU kinks inside the step cause gaps that shrink; wrong derivatives do not).
        A leaf that still fails is tested for a kink *at* the point (a ReLU/abs/max exactly at 0 or a
        tie, e.g. zero-filled padding or zero-feature rows through a zero bias), where no step helps:
        the one-sided quotients ``(f(t+h)-f(t))/h`` and ``(f(t)-f(t-h))/h`` along its direction differ by
        more than ``atol + kink_rtol * max(|right|, |left|, |autodiff|)`` at both the largest and the
        smallest step. A wrong derivative on a differentiable path has equal one-sided slopes and stays a
        ``grad.mismatch``. At a kink, the leaf's coordinates are probed in up to 32 random blocks: a block
        off the kink (equal one-sided slopes at both steps) where autodiff disagrees with finite
        differences at both steps is a ``grad.mismatch``; otherwise the leaf is not judged and is named
        in one ``grad.kink`` (info), never an error (see ``jaxsane._checks.grads_kink``).
      atol, rtol: tolerances of the comparison; default per compute dtype (``GRAD_DEFAULTS``,
        float64: 1e-5, jax.test_util.check_grads' float64 gradient tolerance).
      dtype: precision of the check (default float64, x64 enabled only inside this call);
        ``None`` keeps the arguments' dtypes.
      has_aux: ``f`` returns ``(output, aux)``; only ``output`` is checked.
      seed: seed of the random directions and cotangents.
      root: names of the checked arguments in paths (default ``"params"`` for argument 0,
        ``"args[i]"`` otherwise).
      kinks: test failing leaves for a kink at the point (above); ``False`` reports every leaf that fails
        at every step as ``grad.mismatch`` (order 1 only; higher orders are never kink-tested).
      kink_rtol: relative jump of the one-sided slopes that makes a kink (default the compute dtype's
        ``rtol``, float64 1e-5: slopes equal within the comparison's own tolerance are one slope).
      max_leaves: check at most this many float leaves, drawn at random with ``seed`` (finite differences
        evaluate ``f`` twice per leaf); a sampled check says so in a ``grad.sampled`` info. None or 0: every leaf.

    Returns:
      Findings ``grad.mismatch`` (leaf, relative error, tolerance) and ``grad.missing`` (a float
      leaf whose gradient is identically zero on these arguments; ``extra["kink"]`` when the output changes
      with it only across a kink at the point, where autodiff's one-sided derivative is 0), and ``grad.kink``
      (info: leaves not judged, the point is a kink along their direction). Empty when all agree. A non-finite
      value is never a ``grad.mismatch``: a non-finite output at the point skips the comparison and
      gives one ``nonfinite.forward``; non-finite autodiff gradients give one ``nonfinite.backward``
      naming the leaves; an output that goes non-finite within a finite-difference step gives one
      ``nonfinite.forward`` naming the leaves.

    Raises:
      JaxsaneError: ``order`` < 1, unknown modes, or arguments ``f`` cannot be called with.

    Not jit-safe (runs ``f`` several times on the host).

    Example:
      >>> import jax.numpy as jnp
      >>> check_grads(lambda p, x: jnp.sum(jnp.tanh(x @ p["w"])), {"w": jnp.ones((3, 2))}, jnp.ones((4, 3)))
      []
    """
    require_callable("check_grads", "f", f, signature="(*args) -> output")
    require_int("check_grads", "order", order)
    for _name, _tol in (("eps", eps), ("atol", atol), ("rtol", rtol)):
        require_float("check_grads", _name, _tol, positive=True, optional=True)
    require_bool("check_grads", "has_aux", has_aux)
    require_int("check_grads", "seed", seed)
    require_bool("check_grads", "kinks", kinks)
    require_float("check_grads", "kink_rtol", kink_rtol, positive=True, optional=True)
    require_int("check_grads", "max_leaves", max_leaves, min=0, optional=True)
    if int(order) < 1:
        raise JaxsaneError(f"check_grads: order must be >= 1, got {order}.")
    modes = tuple(modes)
    if not modes or any(m not in ("fwd", "rev") for m in modes):
        raise JaxsaneError(f"check_grads: modes must be a non-empty subset of ('fwd', 'rev'), got {modes}.")
    argnums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not args:
        raise JaxsaneError(
            "check_grads(f, *args): pass the arguments to differentiate, e.g. check_grads(loss, params, batch)."
        )
    if any(not isinstance(i, int) or not 0 <= i < len(args) for i in argnums):
        raise JaxsaneError(f"check_grads: argnums {argnums} out of range for {len(args)} argument(s).")
    if isinstance(root, str):
        root = (root,)
    names = list(root) if root is not None else ["params" if i == 0 else f"args[{i}]" for i in argnums]
    if len(names) != len(argnums):
        raise JaxsaneError(f"check_grads: root has {len(names)} name(s) for {len(argnums)} argnums.")
    x64 = dtype is not None and np.dtype(dtype).itemsize >= 8
    scope = jax.enable_x64(True) if x64 else contextlib.nullcontext()
    try:
        with scope:
            return _check(
                f,
                args,
                argnums,
                names,
                int(order),
                modes,
                eps,
                atol,
                rtol,
                dtype,
                has_aux,
                seed,
                kinks,
                kink_rtol,
                max_leaves,
            )
    except _MixedPrecision as e:
        # the function pins a dtype of its own (a recurrent cell's float32 initial carry from
        # initialize_carry, a float32 constant in a scan's carry): casting only the arguments to float64
        # breaks it. Check it as written instead, with the tolerances of its own dtype (GRAD_DEFAULTS).
        findings = _check(
            f,
            args,
            argnums,
            names,
            int(order),
            modes,
            eps,
            atol,
            rtol,
            None,
            has_aux,
            seed,
            kinks,
            kink_rtol,
            max_leaves,
        )
        note = (
            f" (checked in the arguments' own precision with its tolerances: in {np.dtype(dtype).name} the "
            f"function does not trace: {e.reason})"
        )
        return [
            dataclasses.replace(x, message=x.message + note, extra={**x.extra, "precision": "as written"})
            for x in findings
        ]


class _MixedPrecision(JaxsaneError):
    """f traces in its own dtypes but not with its arguments cast to float64 (see check_grads)."""

    def __init__(self, reason: str):
        super().__init__(f"check_grads: f does not trace with float64 arguments: {reason}")
        self.reason = reason


def _cast_host(x: Any, dtype: Any) -> Any:
    """Float leaves to ``dtype`` through numpy (no device compile per shape); other host arrays onto the device
    as they are (the user's functions see jax arrays, as in their own jitted step: numpy indexing by a traced
    index would fail); other leaves unchanged."""
    if dtype is None or not (_is_real_float(x) and hasattr(x, "dtype")):
        return jax.device_put(x) if isinstance(x, np.ndarray) else x
    if isinstance(x, jax.core.Tracer):
        raise JaxsaneError("check_grads is not jit-safe: call it on concrete arrays, outside jax.jit.")
    return jax.device_put(np.asarray(x).astype(np.dtype(dtype)))


def _check(
    f, args, argnums, names, order, modes, eps, atol, rtol, dtype, has_aux, seed, kinks, kink_rtol, max_leaves
) -> list[Finding]:
    args = [jax.tree_util.tree_map(lambda x: _cast_host(x, dtype), a) for a in args]
    rng = np.random.default_rng(seed)

    # the leaves under check, their paths, and how to put them back
    flat, defs, paths = [], [], []
    for i, name in zip(argnums, names):
        leaves, treedef = jax.tree_util.tree_flatten(args[i])
        flat.append(leaves)
        defs.append(treedef)
        paths.append([p for p, _ in leaves_with_paths(args[i], name)])
    checked = [
        (a, k)
        for a, leaves in enumerate(flat)
        for k, leaf in enumerate(leaves)
        if _is_real_float(leaf) and hasattr(leaf, "shape")
    ]
    if not checked:
        return []
    sampled = []
    if max_leaves and len(checked) > max_leaves:
        keep = np.sort(np.random.default_rng(seed).choice(len(checked), size=int(max_leaves), replace=False))
        sampled = [sampled_finding(int(max_leaves), len(checked), seed)]
        checked = [checked[i] for i in keep]
    n = len(checked)
    values = [flat[a][k] for a, k in checked]
    dirs = [jax.device_put(rng.standard_normal(v.shape).astype(v.dtype)) for v in values]

    def call(vals):
        full = list(args)
        new = [list(leaves) for leaves in flat]
        for (a, k), v in zip(checked, vals):
            new[a][k] = v
        for i, treedef, leaves in zip(argnums, defs, new):
            full[i] = jax.tree_util.tree_unflatten(treedef, leaves)
        out = f(*full)
        return out[0] if has_aux else out

    try:
        jaxpr, out_shape = jax.make_jaxpr(call, return_shape=True)(values)
    except JaxsaneError:
        raise
    except Exception as e:
        if dtype is not None and np.dtype(dtype).itemsize >= 8 and isinstance(e, TypeError):
            raise _MixedPrecision(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}") from e
        raise JaxsaneError(f"check_grads: calling f on the given arguments failed: {type(e).__name__}: {e}") from e
    out_leaves = jax.tree_util.tree_leaves(out_shape)
    if not any(_is_real_float(o) for o in out_leaves):
        raise JaxsaneError(
            "check_grads: f returns no float output to differentiate; return the loss (or pass "
            "has_aux=True when f returns (loss, aux))."
        )
    cots = [
        jax.device_put(np.asarray(1.0 if o.shape == () else rng.standard_normal(o.shape)).astype(o.dtype))
        if _is_real_float(o)
        else None
        for o in out_leaves
    ]

    # precision the function really computes in, on the path from the checked leaves to the output
    tdtype = np.dtype(dtype if dtype is not None else np.float32)
    mask = [True] * n + [False] * (len(jaxpr.jaxpr.invars) - n)
    compute = _lowest(_tainted_float_dtypes(jaxpr.jaxpr, mask) or {tdtype}, _dtype_name(tdtype))
    d_eps, d_atol, d_rtol = GRAD_DEFAULTS[compute]
    eps = d_eps if eps is None else float(eps)
    atol = d_atol if atol is None else float(atol)
    rtol = d_rtol if rtol is None else float(rtol)
    kink_rtol = rtol if kink_rtol is None else float(kink_rtol)

    def scalar(vals):
        outs = jax.tree_util.tree_leaves(call(vals))
        return sum(jnp.sum(c * o) for c, o in zip(cots, outs) if c is not None)

    def perturbed(vals, directions, t):
        return scalar([v + t[j].astype(v.dtype) * d for j, (v, d) in enumerate(zip(vals, directions))])

    def autodiff(vals, directions, fwd):
        """Reverse-mode gradient of every leaf and, in forward mode, the JVP along all the leaves'
        directions at once (``fwd="sum"``: one JVP) or along each leaf's own (``"each"``: n JVPs)."""
        grads = jax.grad(scalar)(vals)
        if fwd is None:
            return grads, None
        zero = jnp.zeros((n,), tdtype)

        def jvp(dt):
            return jax.jvp(lambda u: perturbed(vals, directions, u), (zero,), (dt,))[1]

        if fwd == "sum":
            return grads, jvp(jnp.ones((n,), tdtype))
        return grads, jax.vmap(jvp)(jnp.eye(n, dtype=tdtype))

    value_at = quick_jit(perturbed, runs=2 * len(checked) * 4 + 1)  # at most: 2 points x 4 steps per leaf, + base

    def value_along(j, sub, t):  # f with leaf j moved by t along ``sub`` (a sub-direction of its direction)
        vec = np.zeros((n,), tdtype)
        vec[j] = t
        return np.asarray(value_at(values, dirs[:j] + [sub] + dirs[j + 1 :], vec))

    fwd = "fwd" in modes
    derivatives = quick_jit(autodiff, runs=1, static_argnums=2)
    try:
        grads, jvps = derivatives(values, dirs, "sum" if fwd else None)
    except TypeError as e:  # forward mode cannot go through a jax.custom_vjp: check in reverse mode only
        if not fwd or "custom_vjp" not in str(e):
            raise
        modes = tuple(m for m in modes if m != "fwd") or ("rev",)
        grads, jvps = derivatives(values, dirs, None)
    grads = [np.asarray(x) for x in grads]
    directional = [float(np.vdot(g.ravel(), np.asarray(d).ravel())) for g, d in zip(grads, dirs)]
    if jvps is not None:
        # forward mode along every direction at once equals the sum of the leaves' reverse-mode directional
        # derivatives when both modes agree leaf by leaf (errors on several leaves cancel only on a measure-
        # zero set of random directions); then each leaf's JVP is its reverse-mode value, and only a
        # disagreement pays for the n per-leaf JVPs (a program n times the size) that say which leaf
        total = float(np.asarray(jvps))
        if (
            np.isfinite(total)
            and np.all(np.isfinite(directional))
            and abs(total - sum(directional)) <= atol + rtol * sum(abs(x) for x in directional)
        ):
            jvps = np.asarray(directional, tdtype)
        else:
            jvps = np.asarray(derivatives(values, dirs, "each")[1])

    # finite-difference steps tried in turn; a leaf fails only if it fails at every one and the gap
    # does not shrink with the step. ReLU kinks crossed by the step spoil the difference quotient
    # (on a 2M-parameter MLP by ~1e-3 at step 1e-6) in proportion to the step; a real bug
    # (a wrong sign, a missing factor) leaves the same gap at every step.
    ladder = (eps, eps / 10, eps / 100, eps / 1000) if compute == "float64" else (eps, eps / 3)
    findings: list[Finding] = []
    t0 = np.asarray(0.0, tdtype)
    v0 = np.asarray(value_at(values, dirs, np.zeros((n,), tdtype)))
    if not np.all(np.isfinite(v0)):  # nothing to compare: a NaN loss is a forward fact, not n wrong rules
        return [nonfinite_loss_finding(v0, n)]
    backward: list[tuple[str, float]] = []  # autodiff non-finite, loss finite
    nearby: list[tuple[str, float]] = []  # the loss itself goes non-finite within a step of the point
    kinked: list = []  # (path, KinkVerdict): not judged, the point is a kink
    ends = (ladder[0], ladder[-1])  # the steps of the kink test
    for j, (a, k) in enumerate(checked):
        path = _display(paths[a][k])
        ad = directional[j]
        if not (np.all(np.isfinite(grads[j])) and np.isfinite(ad) and (jvps is None or np.isfinite(jvps[j]))):
            backward.append((path, ad))
            continue

        memo: dict[float, np.ndarray] = {0.0: v0}

        def g(t, j=j, memo=memo):  # check_jvp and check_vjp ask for the same points: evaluate once
            key = float(np.asarray(t))
            if key not in memo:
                vec = np.zeros((n,), tdtype)
                vec[j] = key
                memo[key] = np.asarray(value_at(values, dirs, vec))
            return memo[key]

        if not np.any(grads[j]):
            fd = _directional(g, t0, eps)
            if not np.isfinite(fd):
                nearby.append((path, fd))
                continue
            kink = fd != 0.0 and kinks and kink_at_every_step(g, ends, 0.0, atol, kink_rtol)[0]
            findings.append(missing_finding(path, fd, fd != 0.0, values[j], kink))
            continue

        def g_jvp(primals, tangents, j=j):  # jvp is linear in the tangent: scale the compiled one
            return v0, np.asarray(jvps[j] * np.asarray(tangents[0]), v0.dtype)

        def g_vjp(t, ad=ad):  # check_vjp asks at t0 only, where the reverse-mode gradient is known
            return v0, lambda ct: (np.asarray(np.asarray(ct) * ad, tdtype),)

        def g_traceable(t, j=j):  # for order >= 2, differentiated by jax.test_util.check_grads itself
            return value_at(values, dirs, jnp.zeros((n,), tdtype).at[j].set(t))

        checks = (g, g_jvp, g_vjp) if order == 1 else (g_traceable, None, None)
        failure, errors, fds = None, [], []
        for step_size in ladder:  # a kink (ReLU) inside the step is not a bug: it leaves at smaller steps
            failure = _run_check(checks, t0, order, modes, atol, rtol, step_size)
            if failure is None:
                break
            fds.append(_directional(g, t0, step_size))
            errors.append(abs(fds[-1] - ad) / max(abs(ad), abs(fds[-1]), 1e-30))
        if failure is None:
            continue
        if not np.all(np.isfinite(fds)):  # not a wrong rule: the loss is NaN/Inf a step away from the point
            nearby.append((path, next(v for v in fds if not np.isfinite(v))))
            continue
        if min(abs(f - ad) for f in fds) <= atol + rtol * abs(ad) or (len(errors) > 1 and errors[-1] < errors[0] / 10):
            continue  # agrees at some step, or the gap shrinks with the step: kink noise, not a bug
        fd = min(fds, key=lambda v: abs(v - ad))
        where, kink_extra = "", {}
        if kinks and order == 1:
            at_kink, right, left = kink_at_every_step(g, ends, ad, atol, kink_rtol)
            if at_kink:  # no step helps at a kink: judge the sub-directions off it, or not at all
                verdict = probe_sub_directions(
                    lambda sub, t, j=j: value_along(j, sub, t),
                    grads[j],
                    np.asarray(dirs[j]),
                    np.random.default_rng([seed, j]),
                    ends,
                    right,
                    left,
                    atol,
                    rtol,
                    kink_rtol,
                )
                if verdict.wrong is None:
                    kinked.append((path, verdict))
                    continue
                ad, fd, kink_extra = verdict.wrong["autodiff"], verdict.wrong["finite_diff"], verdict.wrong
                where = (
                    f" along a sub-direction off a kink at the point ({verdict.wrong['coordinates']} of its "
                    f"{np.size(values[j])} coordinates; {verdict.summary()})"
                )
        rel = abs(ad - fd) / max(abs(ad), abs(fd), 1e-30)
        fwd_note = ""
        if jvps is not None and not where:
            fwd_note = f", forward mode {float(jvps[j]):.6g}"
        findings.append(
            Finding(
                "grad.mismatch",
                f"{path}: autodiff directional derivative {ad:.6g}{fwd_note} vs finite differences {fd:.6g}{where} "
                f"(relative error {rel:.2e}; tolerance atol={atol:g}, rtol={rtol:g}, eps={eps:g}, computed in "
                f"{compute}, order {order}, modes {'/'.join(modes)})",
                "a hand-written derivative on the path from this leaf to the loss is wrong: check every "
                "jax.custom_vjp/custom_jvp rule it flows through (sign, a missing factor of the cotangent g, the "
                "residuals saved in fwd); leaves that check clean sit downstream of the bug",
                path=path,
                extra={
                    "autodiff": ad,
                    "finite_diff": fd,
                    "relative_error": rel,
                    "atol": atol,
                    "rtol": rtol,
                    "eps": eps,
                    "compute_dtype": compute,
                    "modes": list(modes),
                    "jax_message": failure[:2000],
                    **({"kink": kink_extra} if kink_extra else {}),
                },
            )
        )
    if backward:
        findings.append(nonfinite_gradient_finding(backward, float(v0.sum())))
    if nearby:
        findings.append(nonfinite_nearby_finding(nearby, float(v0.sum()), eps))
    if kinked:
        findings.append(kink_finding(kinked))
    return findings + sampled


def _run_check(fns, t0, order, modes, atol, rtol, eps) -> str | None:
    """None when jax.test_util's checks pass on the one-scalar function at ``t0``, else their message.

    Order 1 uses ``check_jvp``/``check_vjp`` (what ``check_grads`` runs at order 1) with the JVP and
    VJP compiled once for all leaves; higher orders call ``jax.test_util.check_grads`` itself.
    """
    g, g_jvp, g_vjp = fns
    try:
        if g_jvp is None:
            jax.test_util.check_grads(g, (t0,), order, modes=modes, atol=atol, rtol=rtol, eps=eps)
        else:
            if "fwd" in modes:
                jax.test_util.check_jvp(g, g_jvp, (t0,), atol=atol, rtol=rtol, eps=eps, err_msg="JVP")
            if "rev" in modes:
                jax.test_util.check_vjp(g, g_vjp, (t0,), atol=atol, rtol=rtol, eps=eps, err_msg="VJP")
    except AssertionError as e:
        return str(e)
    return None
