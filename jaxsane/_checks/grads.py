"""Gradient checks: autodiff against finite differences, one parameter leaf at a time (``grad.*``).

Each float leaf of the differentiated arguments is checked on its own along one random
direction ``d``: ``g(t) = f(params with leaf + t * d)`` is a function of one scalar, and
:func:`jax.test_util.check_grads` compares its JVP/VJP with central finite differences. A leaf
costs a few evaluations of ``f`` whatever its size, so a 2M-parameter MLP is checked in seconds.
The check runs in float64 with x64 switched on only inside the check (``jax.enable_x64``);
parameters and float inputs are cast to float64 there, so float16/bfloat16/float32 models are
upcast. When the function still computes in a lower precision on the path from the parameters
(an explicit ``astype`` or ``dtype=jnp.bfloat16`` in a layer), the tolerances of that dtype are used.

This module holds the public entry and its plan; the precision is in ``grads_precision.py``, one leaf's
comparison in ``grads_leaf.py``, the kink test in ``grads_kink.py``. Not jit-safe (it runs ``f`` on the host).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.errors import ArgumentError, JaxsaneError
from .._core.finding import Finding
from .._core.tree import leaves_with_paths, shown_path
from .._core.validate import require_bool, require_callable, require_float, require_int
from .._jaxpr.compile_level import quick_jit
from .grads_findings import nonfinite_loss_finding, sampled_finding
from .grads_leaf import LeafJudge, Tally
from .grads_precision import GRAD_DEFAULTS as GRAD_DEFAULTS, Tolerance, is_real_float
from .grads_stops import stop_gradient_crossings, unstopped_directional, user_stop_gradients
from .grads_trust import foreign_rules, needs_differences


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
    gradient: Callable | None = None,
    trust_autodiff: bool = False,
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
        in one ``grad.kink`` (info), never an error (the kink test is described in ``_checks/grads_kink.py``).
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
      gradient: an already compiled ``(*args) -> gradient of f's output with respect to args[0]`` (the same tree
        as ``args[0]``, called on the arguments cast to ``dtype``). A reverse-mode-only check of order 1 on
        ``argnums=0`` with one scalar output takes its autodiff gradients from it instead of compiling ``f``'s
        backward pass itself (doctor shares the program of its run's gradient telemetry). None: compiled here.
      trust_autodiff: compare with finite differences only the leaves where autodiff can be wrong or differ from
        the function's slope: every leaf when the function uses a derivative rule that is not JAX's own (a
        ``jax.custom_jvp``/``custom_vjp`` of the user's or a library's, Equinox's and Flax's wrappers of them),
        else the leaves whose value reaches a ``stop_gradient`` the user wrote and those whose gradient is zero
        or not finite; the others' autodiff gradients are JAX's exact rules (``_checks/grads_trust.py``). When
        none is left, ``f`` is not evaluated at all, so a non-finite value with finite gradients goes unreported
        here (doctor's init stage reports the loss at init). doctor sets it on a large step. Default False: every
        checked leaf.

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
    options = dict(order=order, eps=eps, atol=atol, rtol=rtol, dtype=dtype, has_aux=has_aux, seed=seed)
    options.update(kinks=kinks, kink_rtol=kink_rtol, max_leaves=max_leaves, gradient=gradient)
    options.update(trust_autodiff=trust_autodiff)
    return _run(GradCheckPlan.build(f, args, argnums=argnums, modes=modes, root=root, **options))


@dataclasses.dataclass(frozen=True)
class GradCheckPlan:
    """What :func:`jaxsane.check_grads` was asked, validated: the function, its arguments, which of them to
    check under which names, and every option (the tolerances left ``None`` take the compute dtype's
    ``GRAD_DEFAULTS``). Host-side only."""

    f: Callable
    args: tuple
    argnums: tuple[int, ...]
    names: tuple[str, ...]
    order: int
    modes: tuple[str, ...]
    eps: float | None
    atol: float | None
    rtol: float | None
    dtype: Any
    has_aux: bool
    seed: int
    kinks: bool
    kink_rtol: float | None
    max_leaves: int | None
    gradient: Callable | None = None
    trust_autodiff: bool = False

    @classmethod
    def build(
        cls,
        f: Callable,
        args: tuple,
        *,
        argnums: int | Sequence[int],
        modes: Sequence[str],
        root: str | Sequence[str] | None,
        **options: Any,
    ) -> GradCheckPlan:
        """The plan of ``check_grads(f, *args, ...)``; raises the error of a bad option."""
        require_callable("check_grads", "f", f, signature="(*args) -> output")
        require_int("check_grads", "order", options["order"])
        for _name in ("eps", "atol", "rtol"):
            require_float("check_grads", _name, options[_name], positive=True, optional=True)
        require_bool("check_grads", "has_aux", options["has_aux"])
        require_int("check_grads", "seed", options["seed"])
        require_bool("check_grads", "kinks", options["kinks"])
        require_bool("check_grads", "trust_autodiff", options["trust_autodiff"])
        require_float("check_grads", "kink_rtol", options["kink_rtol"], positive=True, optional=True)
        require_int("check_grads", "max_leaves", options["max_leaves"], min=0, optional=True)
        if options["gradient"] is not None:
            require_callable("check_grads", "gradient", options["gradient"], signature="(*args) -> gradient of args[0]")
        if int(options["order"]) < 1:
            raise ArgumentError(f"check_grads: order must be >= 1, got {options['order']}. Fix: pass order=1 or 2.")
        modes = tuple(modes)
        if not modes or any(m not in ("fwd", "rev") for m in modes):
            raise ArgumentError(
                f"check_grads: modes must be a non-empty subset of ('fwd', 'rev'), got {modes}. "
                "Fix: pass modes=('fwd', 'rev') or one of them."
            )
        argnums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        if not args:
            raise ArgumentError(
                "check_grads(f, *args) got no arguments. Fix: pass the arguments to differentiate, e.g. "
                "check_grads(loss, params, batch)."
            )
        if any(not isinstance(i, int) or not 0 <= i < len(args) for i in argnums):
            raise ArgumentError(
                f"check_grads: argnums {argnums} out of range for {len(args)} argument(s). "
                f"Fix: pass argnums among 0..{len(args) - 1}."
            )
        if isinstance(root, str):
            root = (root,)
        names = list(root) if root is not None else ["params" if i == 0 else f"args[{i}]" for i in argnums]
        if len(names) != len(argnums):
            raise ArgumentError(
                f"check_grads: root has {len(names)} name(s) for {len(argnums)} argnums. "
                "Fix: pass one root name per argnum."
            )
        options["order"] = int(options["order"])
        return cls(f, tuple(args), argnums, tuple(names), modes=modes, **options)


def _run(plan: GradCheckPlan) -> list[Finding]:
    """The check in float64 (x64 on inside it) when the plan asks so; a function that pins a dtype of its own
    and so does not trace in float64 is checked as written instead, and its findings say so."""
    x64 = plan.dtype is not None and np.dtype(plan.dtype).itemsize >= 8
    scope = jax.enable_x64(True) if x64 else contextlib.nullcontext()
    try:
        with scope:
            return _check(plan)
    except _MixedPrecision as e:
        # the function pins a dtype of its own (a recurrent cell's float32 initial carry from
        # initialize_carry, a float32 constant in a scan's carry): casting only the arguments to float64
        # breaks it. Check it as written instead, with the tolerances of its own dtype (GRAD_DEFAULTS).
        findings = _check(dataclasses.replace(plan, dtype=None))
        note = (
            f" (checked in the arguments' own precision with its tolerances: in {np.dtype(plan.dtype).name} the "
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


def _cast_host(x: Any, dtype: Any, shared: bool = False) -> Any:
    """Float leaves to ``dtype`` through numpy (no device compile per shape), or, ``shared``, as they are when they
    already hold it on one device (an array spread over devices comes to one: the check runs once, not on every
    replica); other host arrays onto the device as they are (the user's functions see jax arrays, as in their own
    jitted step: numpy indexing by a traced index would fail); other leaves unchanged."""
    if dtype is None or not (is_real_float(x) and hasattr(x, "dtype")):
        return jax.device_put(x) if isinstance(x, np.ndarray) else x
    if isinstance(x, jax.core.Tracer):
        raise ArgumentError("check_grads is not jit-safe. Fix: call it on concrete arrays, outside jax.jit.")
    if shared and isinstance(x, jax.Array) and x.dtype == np.dtype(dtype) and len(x.sharding.device_set) == 1:
        return x  # already in the check's precision, on one device: no copy (a large model's float32 check)
    return jax.device_put(np.asarray(x).astype(np.dtype(dtype)))


RUNNING_STATISTICS = ("['batch_stats']",)
"""Path parts of the leaves no gradient trains: Flax's BatchNorm running means and variances (a variables dict
``{"params": ..., "batch_stats": ...}`` passed as the parameters), which the step updates by their own rule."""


def running_statistic(path: str) -> bool:
    """Whether the leaf at ``path`` is a running statistic (:data:`RUNNING_STATISTICS`), not a trained weight."""
    return any(part in path for part in RUNNING_STATISTICS)


@dataclasses.dataclass(frozen=True)
class _Leaves:
    """The float leaves under check: the (cast) arguments flattened, each leaf's path, which leaves are
    checked (``(argument, leaf)`` pairs, sampled down to ``max_leaves``) and how to put them back."""

    plan: GradCheckPlan
    args: list
    flat: list[list]
    defs: list
    paths: list[list[str]]
    checked: list[tuple[int, int]]
    sampled: list[Finding]

    @classmethod
    def select(cls, plan: GradCheckPlan, args: list) -> _Leaves:
        flat, defs, paths = [], [], []
        for i, name in zip(plan.argnums, plan.names):
            leaves, treedef = jax.tree_util.tree_flatten(args[i])
            flat.append(leaves)
            defs.append(treedef)
            paths.append([p for p, _ in leaves_with_paths(args[i], name)])
        checked = [
            (a, k)
            for a, leaves in enumerate(flat)
            for k, leaf in enumerate(leaves)
            if is_real_float(leaf) and hasattr(leaf, "shape") and not running_statistic(paths[a][k])
        ]
        sampled = []
        max_leaves, seed = plan.max_leaves, plan.seed
        if checked and max_leaves and len(checked) > max_leaves:
            keep = np.sort(np.random.default_rng(seed).choice(len(checked), size=int(max_leaves), replace=False))
            sampled = [sampled_finding(int(max_leaves), len(checked), seed)]
            checked = [checked[i] for i in keep]
        return cls(plan, args, flat, defs, paths, checked, sampled)

    def operands(self) -> list:
        """The arrays of every argument, in flattening order: the compiled programs take them as arguments.
        Closed over, they would be constants of the program, and with the leaves sampled on a large model
        XLA spends its compile constant-folding the products of the unchecked weights with the batch."""
        return [x for x in jax.tree_util.tree_leaves(self.args) if isinstance(x, (jax.Array, np.ndarray))]

    def call(self, vals: Sequence[Any], operands: Sequence[Any] | None = None) -> Any:
        """``f``'s output (without aux) with the checked leaves replaced by ``vals`` (and every argument's arrays
        by ``operands``, from :meth:`operands`, when given)."""
        args, flat = self.args, self.flat
        if operands is not None:
            given, treedef = iter(operands), jax.tree_util.tree_structure(self.args)
            args = jax.tree_util.tree_unflatten(
                treedef,
                [
                    next(given) if isinstance(x, (jax.Array, np.ndarray)) else x
                    for x in jax.tree_util.tree_leaves(self.args)
                ],
            )
            flat = [jax.tree_util.tree_leaves(args[i]) for i in self.plan.argnums]
        full = list(args)
        new = [list(leaves) for leaves in flat]
        for (a, k), v in zip(self.checked, vals):
            new[a][k] = v
        for i, treedef, leaves in zip(self.plan.argnums, self.defs, new):
            full[i] = jax.tree_util.tree_unflatten(treedef, leaves)
        out = self.plan.f(*full)
        return out[0] if self.plan.has_aux else out

    def trace(self, values: list) -> tuple[Any, list]:
        """``(closed jaxpr, output leaves' shapes)`` of :meth:`call` at ``values``."""
        dtype = self.plan.dtype
        try:
            jaxpr, out_shape = jax.make_jaxpr(self.call, return_shape=True)(values)
        except JaxsaneError:
            raise
        except Exception as e:
            if dtype is not None and np.dtype(dtype).itemsize >= 8 and isinstance(e, TypeError):
                raise _MixedPrecision(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}") from e
            raise JaxsaneError(f"check_grads: calling f on the given arguments failed: {type(e).__name__}: {e}") from e
        out_leaves = jax.tree_util.tree_leaves(out_shape)
        if not any(is_real_float(o) for o in out_leaves):
            raise JaxsaneError(
                "check_grads: f returns no float output to differentiate; return the loss (or pass "
                "has_aux=True when f returns (loss, aux))."
            )
        return jaxpr, out_leaves


def _programs(leaves: _Leaves, cots: list, n: int, tdtype: np.dtype) -> tuple[Any, Any]:
    """``(value_at, derivatives)``, compiled once for all leaves: ``value_at(vals, directions, t)`` is the
    projected output with leaf ``j`` moved by ``t[j]`` along ``directions[j]``; ``derivatives`` gives the
    reverse-mode gradients and the forward-mode JVPs (see ``autodiff``)."""

    operands = leaves.operands()
    scalar = _projected(leaves, cots)

    def perturbed(vals, directions, t, ops):
        return scalar([v + t[j].astype(v.dtype) * d for j, (v, d) in enumerate(zip(vals, directions))], ops)

    def autodiff(vals, directions, fwd, ops):
        """Reverse-mode gradient of every leaf and, in forward mode, the JVP along all the leaves'
        directions at once (``fwd="sum"``: one JVP) or along each leaf's own (``"each"``: n JVPs)."""
        grads = jax.grad(scalar)(vals, ops)
        if fwd is None:
            return grads, None
        zero = jnp.zeros((n,), tdtype)

        def jvp(dt):
            return jax.jvp(lambda u: perturbed(vals, directions, u, ops), (zero,), (dt,))[1]

        if fwd == "sum":
            return grads, jvp(jnp.ones((n,), tdtype))
        return grads, jax.vmap(jvp)(jnp.eye(n, dtype=tdtype))

    value_at = quick_jit(perturbed, runs=2 * n + 1)  # the base and 2 points per leaf (more only where a leaf fails)
    shared = _given_gradient(leaves, cots)
    if shared is not None:
        return lambda vals, directions, t: value_at(vals, directions, t, operands), shared
    derivatives = quick_jit(autodiff, runs=1, static_argnums=2)
    return (
        lambda vals, directions, t: value_at(vals, directions, t, operands),
        lambda vals, directions, fwd: derivatives(vals, directions, fwd, operands),
    )


def _given_gradient(leaves: _Leaves, cots: list) -> Any:
    """``derivatives`` (reverse mode only) from the caller's compiled ``gradient`` of ``f`` with respect to its
    first argument, where that is the check's whole reverse mode: order 1, ``modes=("rev",)``, ``argnums=0``,
    no aux and one scalar output (its cotangent is 1, so the gradient is the projected one); else None."""
    plan = leaves.plan
    scalar = len(cots) == 1 and cots[0] is not None and np.ndim(cots[0]) == 0 and float(cots[0]) == 1.0
    if plan.gradient is None or plan.order != 1 or plan.modes != ("rev",) or plan.argnums != (0,):
        return None
    if plan.has_aux or not scalar:
        return None
    gradient = plan.gradient

    def derivatives(vals: list, directions: list, fwd: Any) -> tuple[list, None]:
        assert fwd is None, "a given gradient serves reverse mode only"
        flat = jax.tree_util.tree_leaves(gradient(*leaves.args))  # at the arguments: vals are their leaves
        return [flat[k] for _, k in leaves.checked], None

    return derivatives


def _autodiff(
    derivatives: Any, values: list, dirs: list, modes: tuple[str, ...], tol: Tolerance, tdtype: np.dtype
) -> tuple[list[np.ndarray], list[float], np.ndarray | None, tuple[str, ...]]:
    """``(grads, directional, jvps, modes)``: every leaf's reverse-mode gradient and directional derivative,
    its forward-mode JVP (None without ``"fwd"``), and the modes checked (forward mode is dropped when it
    cannot go through a ``jax.custom_vjp``)."""
    fwd = "fwd" in modes
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
            and abs(total - sum(directional)) <= tol.atol + tol.rtol * sum(abs(x) for x in directional)
        ):
            jvps = np.asarray(directional, tdtype)
        else:
            jvps = np.asarray(derivatives(values, dirs, "each")[1])
    return grads, directional, jvps, modes


def _projected(leaves: _Leaves, cots: list) -> Callable:
    """``(vals, ops) -> scalar``: the function's outputs projected on the cotangents ``cots``. Jit-safe."""

    def scalar(vals, ops):
        outs = jax.tree_util.tree_leaves(leaves.call(vals, ops))
        return sum(jnp.sum(c * o) for c, o in zip(cots, outs) if c is not None)

    return scalar


def _nearby_gradient(leaves: _Leaves, cots: list, values: list, rng: np.random.Generator) -> list | None:
    """The checked leaves' gradient at a point near this one (every float array of the arguments moved at random by
    a thousandth of its scale): a leaf whose gradient vanishes here only because a later weight is zero (a
    zero-initialised head) gets one there; a leaf multiplied by a constant zero (an RNN carry reset to zeros) does
    not. None when it cannot be taken. One more compile, only when a leaf's gradient is identically zero and the
    caller gave no compiled gradient (``check_grads(gradient=...)``: doctor's, the run's telemetry)."""

    def nudged(x: Any) -> Any:
        if not (isinstance(x, (jax.Array, np.ndarray)) and is_real_float(x)):
            return x
        a = np.asarray(x)
        return jax.device_put((a + 1e-3 * (np.abs(a).mean() + 1e-3) * rng.standard_normal(a.shape)).astype(a.dtype))

    try:
        gradient = leaves.plan.gradient
        if gradient is not None and _given_gradient(leaves, cots) is not None:  # the caller's compiled one: no compile
            flat = jax.tree_util.tree_leaves(gradient(*jax.tree_util.tree_map(nudged, leaves.args)))
            return [np.asarray(flat[k]) for _, k in leaves.checked]
        grad = quick_jit(jax.grad(_projected(leaves, cots)), runs=1)
        return [np.asarray(g) for g in grad([nudged(v) for v in values], [nudged(o) for o in leaves.operands()])]
    except Exception:  # noqa: BLE001 - a function that refuses moved arguments (shardings, dtypes): cannot tell
        return None


def _reaching(jaxpr: Any, cots: list, n: int) -> list[bool] | None:
    """Per checked leaf (the jaxpr's first ``n`` inputs), whether a path of the function's jaxpr leads from it to
    a differentiated output (dead-code elimination keeps it); None when that cannot be told. A leaf that reaches
    the output and still gets an identically zero gradient is zeroed further on at this point (a layer after it
    initialised to zero), not unused. Not jit-safe."""
    try:
        from jax._src.interpreters.partial_eval import dce_jaxpr  # private: no public dead-code elimination

        _, used = dce_jaxpr(jaxpr.jaxpr, [c is not None for c in cots], instantiate=False)
    except Exception:  # noqa: BLE001 - a primitive without a DCE rule, an API that moved: cannot tell
        return None
    return [bool(u) for u in used[:n]]


def _check(plan: GradCheckPlan) -> list[Finding]:
    """The check in the plan's dtype: pick the leaves, draw their directions and the output's cotangents, find
    the compute dtype, take the derivatives once for all leaves, then compare leaf by leaf."""
    # the parameters are read as they are where they can be (a large model's float32 check: no copy of them); the
    # other arguments are copied, as a step that donates its batch could delete them under a check beside it
    cast = [functools.partial(_cast_host, dtype=plan.dtype, shared=i == 0) for i in range(len(plan.args))]
    args = [jax.tree_util.tree_map(c, a) for c, a in zip(cast, plan.args)]
    rng = np.random.default_rng(plan.seed)
    leaves = _Leaves.select(plan, args)
    if not leaves.checked:
        return []
    n = len(leaves.checked)
    values = [leaves.flat[a][k] for a, k in leaves.checked]
    dirs = [jax.device_put(rng.standard_normal(v.shape).astype(v.dtype)) for v in values]
    jaxpr, out_leaves = leaves.trace(values)
    cots = [
        jax.device_put(np.asarray(1.0 if o.shape == () else rng.standard_normal(o.shape)).astype(o.dtype))
        if is_real_float(o)
        else None
        for o in out_leaves
    ]
    # precision the function really computes in, on the path from the checked leaves to the output
    tdtype = np.dtype(plan.dtype if plan.dtype is not None else np.float32)
    tol = Tolerance.of(jaxpr, n, tdtype, eps=plan.eps, atol=plan.atol, rtol=plan.rtol, kink_rtol=plan.kink_rtol)
    value_at, derivatives = _programs(leaves, cots, n, tdtype)
    grads, directional, jvps, modes = _autodiff(derivatives, values, dirs, plan.modes, tol, tdtype)
    reaches = _reaching(jaxpr, cots, n) if not all(np.any(g) for g in grads) else None
    if reaches is not None and any(reaches):  # zeroed further on here, or by a constant zero (then no nearby point)
        nearby = _nearby_gradient(leaves, cots, values, rng)
        reaches = [bool(r and nearby is not None and np.any(nearby[j])) for j, r in enumerate(reaches)]
    stops = stop_gradient_crossings(jaxpr, n)
    compared = [True] * n
    if plan.trust_autodiff:
        compared = needs_differences(grads, user_stop_gradients(jaxpr, n), foreign_rules(jaxpr))
        if not any(compared):  # JAX's own rules on every leaf: nothing for finite differences to find
            return leaves.sampled
    v0 = np.asarray(value_at(values, dirs, np.zeros((n,), tdtype)))
    if not np.all(np.isfinite(v0)):  # nothing to compare: a NaN loss is a forward fact, not n wrong rules
        return [nonfinite_loss_finding(v0, n)]
    judge = LeafJudge(
        order=plan.order,
        kinks=plan.kinks,
        seed=plan.seed,
        tol=tol,
        modes=modes,
        tdtype=tdtype,
        values=values,
        dirs=dirs,
        value_at=value_at,
        v0=v0,
        grads=grads,
        directional=directional,
        jvps=jvps,
        reaches=reaches,
        stops=stops,
        unstopped=unstopped_directional(_projected(leaves, cots), values, leaves.operands(), dirs),
    )
    tally = Tally()
    zero = [j for j in range(n) if compared[j] and np.all(np.isfinite(grads[j])) and not np.any(grads[j])]
    unmoved = len(zero) > 1 and judge.unmoved_together(zero)  # two evaluations for them all, when f ignores them
    for j, (a, k) in enumerate(leaves.checked):
        if compared[j]:
            judge.judge(j, shown_path(leaves.paths[a][k]), tally, unmoved=unmoved and j in zero)
    return tally.findings_at(v0, tol.eps) + leaves.sampled
