"""Step wiring: does the user's step update the parameters, thread the optimizer state and the
randomness, and compile once? (``step.no_update``, ``step.opt_state_frozen``, ``step.rng_reused``,
``step.recompiles``.)

Everything is read from a few real calls of the user's own step through :class:`PureExperiment`, called
as the user calls it (not re-wrapped in ``jax.jit``, so that Python-side recompilation is seen).
Randomness is found by evaluating the step's jaxpr with a hook on jaxsane's one interpreter
(``_jaxpr/interpret.py``) that records the output of every ``random_bits`` equation (dropout
masks, noise; inside ``scan`` bodies once per time step) on two consecutive states.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._core.errors import ArgumentError, DataError
from .._core.finding import Finding
from .._core.frames import user_call_site, user_location
from .._core.tree import PyTree, accumulates_gradients, copy_arrays, is_key, leaves_with_paths, shown_path
from .._core.validate import is_prng_key, require_batch, require_bool, require_int
from .._experiment.batch_match import batch_mismatch, cause_text
from .._experiment.batches import first_batch
from .._experiment.contract import Experiment, PureExperiment, require_experiment
from .._experiment.purify import Kept, positional_names
from .._jaxpr.compile_level import quick_jit
from .._jaxpr.interpret import Interpreter, all_eqns
from .._jaxpr.recompile import Recompile, RecompileTracker, recompile_finding, signature
from .._locate.replay import HOST_PRIMITIVES, evaluate_on_host
from .step_dropped import dropped_state_findings
from .step_snapshot import bitwise_equal, snapshot, state_from_snapshot

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# a program loaded from the persistent compilation cache is a compilation too (the step was not reused)
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_retrieval_time_sec"
_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
_RANDOM_PRIMS = ("random_bits", "threefry2x32", "random_wrap")


class CompileCounter:
    """Counts XLA compilations and jaxpr traces while active (a ``jax.monitoring`` listener).

    Use as ``with count_compilations() as c: ...; c.compiles``. Calls made through
    :meth:`watch` are also explained: ``c.reasons`` holds a ``Recompile`` (``_jaxpr/recompile.py``) per compile
    after the first (the argument paths that changed, old and new side by side, the caller's
    ``file:line``) and ``c.explain()`` writes them out. Not jit-safe; counts every compilation in the
    process while active (or, with ``thread``, only those made by that thread: jax compiles on the
    calling thread, so compiles running in other threads at the same time are not counted).
    """

    def __init__(self, thread: int | None = None):
        self.thread = thread
        self.compiles = 0
        self.traces = 0
        self.active = False
        self._hit = threading.local()  # per compiling thread: a cache hit whose compile event is still to come
        self._tracker = RecompileTracker()

    @property
    def reasons(self) -> list[Recompile]:
        """One ``Recompile`` (``_jaxpr/recompile.py``) per compile of a watched call after the first."""
        return self._tracker.reasons

    def explain(self) -> str:
        """What changed at each recompilation of the watched calls, one line each. Not jit-safe."""
        return self._tracker.explain()

    def watch(self, fn: Callable, names: Sequence[str] | None = None) -> Callable:
        """``fn`` with each call's argument signature recorded, so a compile during a call is explained
        against the call that compiled before it. ``names``: the positional arguments' names in paths
        (default: ``fn``'s parameter names, else ``args[i]``); ``jax.jit``'s static arguments are compared by
        value. Not jit-safe.

        Example:
          >>> f = jax.jit(lambda x: x + 1)
          >>> with count_compilations() as c:
          ...     g = c.watch(f, names=["x"])
          ...     _ = g(jnp.ones(2)); _ = g(jnp.ones(3))
          >>> print(c.reasons[0].summary())
          x: shape (2,) -> (3,)
        """
        names = list(positional_names(fn)) if names is None else list(names)
        info = getattr(fn, "_jit_info", None)
        static = (tuple(getattr(info, "static_argnums", ()) or ()), tuple(getattr(info, "static_argnames", ()) or ()))

        @functools.wraps(fn)
        def watched(*args, **kwargs):
            sig = signature(args, kwargs, names=names, static_argnums=static[0], static_argnames=static[1])
            before = self.compiles
            out = fn(*args, **kwargs)
            compiled = self.compiles > before
            self._tracker.seen(sig, compiled, user_call_site() if compiled else None)
            return out

        return watched

    def _listener(self, event: str, duration_secs: float, **kwargs: Any) -> None:
        if not self.active or (self.thread is not None and threading.get_ident() != self.thread):
            return
        # a cache hit is recorded inside the compile; jax may or may not then record the backend-compile
        # event of the same program right after it (nothing in between): count the pair once either way
        pending, self._hit.pending = getattr(self._hit, "pending", False), event == _CACHE_HIT_EVENT
        if event == _CACHE_HIT_EVENT or (event == _COMPILE_EVENT and not pending):
            self.compiles += 1
        elif event == _TRACE_EVENT:
            self.traces += 1


@contextlib.contextmanager
def count_compilations(*, this_thread: bool = False) -> Iterator[CompileCounter]:
    """Context manager counting XLA compilations (and traces) inside it. Not jit-safe.

    With ``this_thread=True`` only the compilations and traces made by the calling thread count, so work
    compiling in other threads at the same time (a background precompile) is not mistaken for its own.

    Example:
      >>> f = jax.jit(lambda x: x + 1)
      >>> with count_compilations() as c:
      ...     _ = f(1.0); _ = f(2.0)
      >>> c.compiles
      1
    """
    counter = CompileCounter(threading.get_ident() if this_thread else None)
    jax.monitoring.register_event_duration_secs_listener(counter._listener)
    counter.active = True
    try:
        yield counter
    finally:
        counter.active = False
        jax.monitoring.unregister_event_duration_listener(counter._listener)


def _is_float(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None or is_key(x):
        return False
    try:
        return bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:
        return False


def _raw_key_path(path: str, leaf: Any) -> bool:
    lowered = path.lower()
    return (
        getattr(leaf, "dtype", None) == np.uint32
        and getattr(leaf, "shape", ())[-1:] == (2,)
        and ("key" in lowered or "rng" in lowered)
    )


def _matching(adapted: PureExperiment, state: PyTree, batch: PyTree) -> PyTree:
    """``batch`` (given to check_step), checked against the first train batch before the step runs: a
    :class:`DataError` naming both when a leaf differs in rank or dtype kind, or when the step cannot be traced on
    it (another structure or feature size). Train data that cannot be read is not compared. Not jit-safe."""
    data = adapted.experiment.train
    if isinstance(data, Iterator):  # a one-shot iterator: reading its first batch would take it from the user
        return batch
    try:
        train = first_batch(data, "train")
    except (DataError, StopIteration):
        return batch
    problem, cause = batch_mismatch(train, batch, "first train", lambda b: jax.eval_shape(adapted.step, state, b))
    if problem:
        raise DataError(
            f"[jaxsane] check_step(batch=...) does not match the Experiment's train data: {problem}"
            + (f"; the step fails on it{cause_text(cause)}" if cause else "")
            + ". Fix: pass a batch from the same pipeline as Experiment.train (same keys, feature sizes, dtypes), "
            "or leave batch= out to use the first train batch."
        ) from cause
    return batch


def check_step(
    experiment: Experiment | PureExperiment,
    batch: Any = None,
    *,
    key: jax.Array | None = None,
    calls: int = 3,
    check_rng: bool = True,
) -> list[Finding]:
    """Run the user's step ``calls`` times on one batch and check its wiring.

    * ``step.no_update`` — the parameters are bitwise unchanged by every call (stale state returned,
      update not applied, learning rate 0);
    * ``step.opt_state_frozen`` — the parameters change but every float optimizer-state leaf (not a
      parameter, counter or key) is bitwise unchanged across all calls;
    * ``step.rng_reused`` — the step draws random bits (``random_bits`` in its jaxpr) and draws the
      same bits on two consecutive states (a dropout key never split or advanced);
    * ``step.recompiles`` — any XLA compilation during calls 2..``calls``; the message names the state
      leaf that changed since the compiled call (``state[0]['scale']: weak_type True -> False``: dtype or
      weak-type drift of the state) or says the arguments were identical (a Python scalar as a static
      argument or closed over, a new ``jax.jit`` per call).

    Args:
      experiment: the :class:`Experiment` (or its :class:`PureExperiment` view).
      batch: the batch for every call (default: the first train batch).
      key: PRNG key for ``init`` (default ``jax.random.key(0)``).
      calls: how many steps to run (>= 2; default 3; raise it above k for optax.MultiSteps(k)).
      check_rng: also evaluate the step's jaxpr to compare its random draws (one extra compile
        when the step draws randomness).

    Returns:
      A list of findings, empty when the step is wired correctly.

    Not jit-safe: it calls the step on the host.
    """
    return timed_check_step(experiment, batch, key=key, calls=calls, check_rng=check_rng)[0]


class StepTiming(NamedTuple):
    """The seconds of the step's calls in :func:`timed_check_step`: ``first`` (its compile included, when it
    compiled) and ``fastest`` (the fastest call that neither traced nor compiled; None when every call did)."""

    first: float
    fastest: float | None


def time_one_step(adapted: PureExperiment, batch: Any, key: jax.Array) -> float | None:
    """The seconds of one call of the user's step from the state ``init(key)`` (a copy: a donating step deletes
    its inputs) on ``batch``; None when the call traced or compiled (then it timed the compile). Not jit-safe."""
    state = copy_arrays(adapted.init(key))
    start = time.perf_counter()
    with count_compilations(this_thread=True) as counter:
        jax.block_until_ready(jax.tree_util.tree_leaves(adapted.step(state, batch)))
    return None if counter.compiles or counter.traces else time.perf_counter() - start


def timed_check_step(
    experiment: Experiment | PureExperiment,
    batch: Any = None,
    *,
    key: jax.Array | None = None,
    calls: int = 3,
    check_rng: bool = True,
) -> tuple[list[Finding], StepTiming]:
    """:func:`check_step`'s findings and the :class:`StepTiming` of its calls: what the user's step costs on
    this machine, the yardstick of doctor's time guards. Not jit-safe."""
    require_experiment("check_step", experiment)
    require_int("check_step", "calls", calls)
    require_bool("check_step", "check_rng", check_rng)
    if int(calls) < 2:
        raise ArgumentError(
            f"check_step: calls must be >= 2 to compare consecutive steps, got {calls}. Fix: pass calls=2 or more."
        )
    if batch is not None:
        require_batch("check_step", "batch", batch)
    if key is not None and not is_prng_key(key):
        raise ArgumentError(
            f"check_step(key=...): expected a PRNG key (jax.random.key(seed)) or None, got {type(key).__name__} "
            f"{key!r}. Fix: pass key=jax.random.key(0), or leave it out."
        )
    key = jax.random.key(0) if key is None else key
    adapted = experiment if isinstance(experiment, PureExperiment) else PureExperiment(experiment, key=key)
    state = adapted.init(key)
    batch = first_batch(adapted.experiment.train, "train") if batch is None else _matching(adapted, state, batch)
    first_state = state
    param_ids = {id(x) for x in jax.tree_util.tree_leaves(adapted.params(state))}
    kinds = _leaf_kinds(state, param_ids)

    snapshots = [snapshot(state)]
    fields = [_static_fields(state)]
    compiles, traces = [], []
    seconds: list[float] = []
    first = 0.0
    tracker, site = RecompileTracker(), user_call_site()
    for _call in range(int(calls)):
        sig = signature((state, batch), names=("state", "batch"))  # before the call: the step may donate
        start = time.perf_counter()
        with count_compilations(this_thread=True) as counter:  # doctor compiles other stages' programs meanwhile
            state, _ = adapted.step(state, batch)
            jax.block_until_ready(jax.tree_util.tree_leaves(state))
        took = time.perf_counter() - start
        first = took if _call == 0 else first
        if counter.compiles == 0 and counter.traces == 0:  # a call that only ran: the step's own time
            seconds.append(took)
        compiles.append(counter.compiles)
        traces.append(counter.traces)
        tracker.seen(sig, counter.compiles > 0, site)
        snapshots.append(snapshot(state))
        fields.append(_static_fields(state))

    findings: list[Finding] = []
    findings += _update_findings(snapshots, kinds, accumulating=accumulates_gradients(first_state))
    findings += _frozen_state_findings(adapted, first_state, snapshots, batch, kinds, findings)
    findings += _recompile_findings(compiles, traces, tracker.reasons, _changed_fields(fields))
    if check_rng:
        findings += _rng_findings(adapted, first_state, snapshots, batch, kinds)
    return findings, StepTiming(first, min(seconds, default=None))


def _leaf_kinds(state: PyTree, param_ids: set[int]) -> list[str]:
    """Per leaf of the state: "param", "opt" (float, not a param), "key", or "other"."""
    kinds = []
    for path, leaf in leaves_with_paths(state, "state"):
        if id(leaf) in param_ids:
            kinds.append("param")
        elif is_key(leaf) or _raw_key_path(path, leaf):
            kinds.append("key")
        elif _is_float(leaf):
            kinds.append("opt")
        else:
            kinds.append("other")
    has_opt_state = [
        k == "opt" and "opt_state" in path for k, (path, _) in zip(kinds, leaves_with_paths(state, "state"))
    ]
    if any(has_opt_state):  # prefer the optimizer's own sub-tree when it is named (TrainState, nnx.Optimizer)
        kinds = ["opt" if flag else ("stat" if k == "opt" else k) for k, flag in zip(kinds, has_opt_state)]
    return kinds


def _update_findings(snapshots: list, kinds: list[str], accumulating: bool = False) -> list[Finding]:
    """``step.no_update`` / ``step.opt_state_frozen`` from the state's snapshots; ``accumulating``: the state holds
    a gradient accumulator (``optax.MultiSteps``), whose parameters unchanged for fewer calls than its k are not
    judged (a ``doctor.skipped`` info)."""
    n = len(snapshots) - 1
    params = [i for i, k in enumerate(kinds) if k == "param"]
    opt = [i for i, k in enumerate(kinds) if k == "opt"]
    changed = [
        [not bitwise_equal(snapshots[c][i][1], snapshots[c + 1][i][1]) for i in range(len(kinds))] for c in range(n)
    ]
    params_moved = any(changed[c][i] for c in range(n) for i in params)
    if params and not params_moved and accumulating:
        return [
            Finding(
                "doctor.skipped",
                f"step.no_update not judged: the parameters are bitwise unchanged after {n} calls, and the optimizer "
                "accumulates gradients (optax.MultiSteps: the parameters move once every k calls)",
                f"run the step more than k times to check that its update is applied (jaxsane doctor -o "
                f"step_calls=K+1, check_step(calls=K+1); 2K+1 under a learning rate that warms up from 0, whose "
                f"first update is scaled by 0); {n} calls were made",
                extra={"calls": n},
            )
        ]
    if params and not params_moved:
        opt_note = ""
        if opt and not any(changed[c][i] for c in range(n) for i in opt):
            opt_note = " and neither did the optimizer state"
        return [
            Finding(
                "step.no_update",
                f"the parameters ({len(params)} leaves, e.g. {shown_path(snapshots[0][params[0]][0])}) are bitwise "
                f"unchanged after {n} steps{opt_note}",
                "the step does not apply its update: return the NEW state (e.g. state.apply_gradients(grads=...) or "
                "optax.apply_updates(params, updates)), not the state it was given; for NNX call "
                "optimizer.update(model, grads) inside the step; check the learning rate is not 0. "
                "(Gradient accumulation with optax.MultiSteps(k) only updates every k steps: run with more calls.)",
                path=shown_path(snapshots[0][params[0]][0]),
                extra={"calls": n},
            )
        ]
    if opt and params_moved and not any(changed[c][i] for c in range(n) for i in opt):
        return [
            Finding(
                "step.opt_state_frozen",
                f"the parameters change but the optimizer state ({len(opt)} float leaves, e.g. "
                f"{shown_path(snapshots[0][opt[0]][0])}) is bitwise unchanged across {n} steps",
                "the step returns the initial optimizer state: thread the new one, "
                "`updates, opt_state = tx.update(grads, opt_state, params)` and return that opt_state with the new "
                "params (momentum and Adam moments are lost otherwise)",
                path=shown_path(snapshots[0][opt[0]][0]),
                extra={"calls": n},
            )
        ]
    return []


def _static_fields(state: PyTree) -> dict[str, Any]:
    """The non-array fields of an Equinox state (its :class:`Kept` nodes: Python ints, flags, functions that
    ``eqx.filter_jit`` treats as static) by path. Not jit-safe."""
    return {
        p: leaf.value
        for p, leaf in leaves_with_paths(state, "state", is_leaf=lambda x: isinstance(x, Kept))
        if isinstance(leaf, Kept)
    }


def _changed_fields(fields: list[dict[str, Any]]) -> list[str]:
    """``"path: old -> new"`` for each non-array field whose value a call of the step changed. Not jit-safe."""
    out: list[str] = []
    for before, after in zip(fields, fields[1:]):
        for path, value in after.items():
            old = before.get(path, value)
            try:
                same = bool(old is value or old == value)
            except Exception:  # an odd __eq__: identity only
                same = old is value
            if not same and not any(line.startswith(path + ":") for line in out):
                out.append(f"{path}: {old!r} -> {value!r}")
    return out


def _frozen_state_findings(
    adapted: PureExperiment, state0: PyTree, snapshots: list, batch: Any, kinds: list[str], found: list[Finding]
) -> list[Finding]:
    """``step.stats_frozen`` (``step_dropped.py``): float state leaves, not parameters, that every call left
    bitwise unchanged although the step computes their new values. Nothing when the whole state is stale
    (``step.no_update``); optimizer leaves only when ``step.opt_state_frozen`` did not already say so."""
    codes = {f.code for f in found}
    if "step.no_update" in codes:
        return []
    n = len(snapshots) - 1
    candidates = [
        i
        for i, k in enumerate(kinds)
        if (k == "stat" or (k == "opt" and "step.opt_state_frozen" not in codes))
        and all(bitwise_equal(snapshots[c][i][1], snapshots[c + 1][i][1]) for c in range(n))
    ]
    if not candidates:
        return []
    state0 = state_from_snapshot(state0, snapshots[0])  # the step may have donated the original buffers
    try:
        closed, out_shape = jax.make_jaxpr(adapted.step, return_shape=True)(state0, batch)
    except Exception:  # noqa: BLE001 - a step that cannot be traced again here: judge nothing
        return []
    n_out = len(jax.tree_util.tree_leaves(out_shape[0]))
    paths = [shown_path(p) for p, _ in snapshots[0]]
    return dropped_state_findings(closed, len(kinds), n_out, candidates, paths)


def _recompile_findings(
    compiles: list[int], traces: list[int], reasons: list[Recompile], fields: Sequence[str] = ()
) -> list[Finding]:
    """One ``step.recompiles`` finding for calls 2.. that compiled, naming what changed at the first of them
    (``fields``: the non-array fields the step changed, each ``"path: old -> new"``)."""
    later = compiles[1:]
    if not any(later) or not reasons:
        return []
    finding = recompile_finding(reasons[0])
    every = all(later)
    if fields:
        finding = dataclasses.replace(
            finding,
            message=f"the step changes a non-array field of the state on every call ({'; '.join(fields[:3])}), "
            "and such a field is static to the compiled step, so each new value compiles it again",
            hint="keep a value that changes every step in an array (e.g. `jnp.asarray(step, jnp.int32)`, or an "
            "eqx.nn.StateIndex / optimizer count), never a Python int or float field of the model",
            path=fields[0].split(":", 1)[0],
        )
        hint = finding.hint
    elif every and not reasons[0].changes:
        hint = (
            "it recompiles on every call with identical arguments: a Python value that changes each call is a "
            "static argument or is closed over (pass it as a jnp array argument instead), or jax.jit is applied "
            "anew inside the loop (jit once, outside)"
        )
    else:
        hint = finding.hint
    others = [str(r) for r in reasons[1:]]
    more = f"; and again at {len(others)} later call(s)" if others else ""
    return [
        dataclasses.replace(
            finding,
            message=f"{finding.message} (compilations per call {compiles}{more})",
            hint=hint,
            extra={**finding.extra, "compiles": compiles, "traces": traces, "recompiles": [str(r) for r in reasons]},
        )
    ]


def _random_sites(jaxpr) -> list[Any]:
    return [eqn for eqn in all_eqns(jaxpr) if eqn.primitive.name in _RANDOM_PRIMS]


class _Draws(Interpreter):
    """Records (the first 4096 of) the bits of every ``random_bits`` equation. Jit-safe."""

    def after(self, eqn, invals, outs, tags, out_tags, ectx):
        if eqn.primitive.name == "random_bits":
            self.emit(eqn, jnp.ravel(outs[0])[:4096])
        return outs, out_tags


def _rng_findings(
    adapted: PureExperiment, state0: PyTree, snapshots: list, batch: Any, kinds: list[str]
) -> list[Finding]:
    state0 = state_from_snapshot(state0, snapshots[0])  # the step may have donated the original buffers
    closed = jax.make_jaxpr(adapted.step)(state0, batch)
    if not _random_sites(closed.jaxpr):
        return []
    recorded_meta: list[str] = []
    draws = _Draws()

    def record_bits(flat_args):
        with draws.collecting() as records:
            draws.run(closed.jaxpr, closed.consts, flat_args)
        recorded_meta[:] = [user_location(*draws.sites[site]) or "random_bits" for site in records]
        return list(records.values())

    flat0 = jax.tree_util.tree_leaves((state0, batch))
    try:
        runner = _dead_code_eliminated(record_bits, flat0)
        bits0 = runner(flat0)
    except Exception:  # an exotic step the interpreter cannot replay: fall back to key leaves only
        return _key_only_findings(snapshots, kinds)
    if not bits0:  # draws only inside a while body or a cond branch, which the traced interpreter drops
        if any(e.primitive.name == "random_bits" for e in _random_sites(closed.jaxpr)):
            return _key_only_findings(snapshots, kinds)
        return []
    # the state after the first call, rebuilt from its snapshot (the step may donate its inputs)
    state1 = state_from_snapshot(state0, snapshots[1])
    bits1 = runner(jax.tree_util.tree_leaves((state1, batch)))
    repeated = [i for i, (a, b) in enumerate(zip(bits0, bits1)) if bitwise_equal(a, b)]
    if not repeated:
        return []
    frozen_keys = [
        shown_path(snapshots[0][i][0])
        for i, k in enumerate(kinds)
        if k == "key" and bitwise_equal(snapshots[0][i][1], snapshots[1][i][1])
    ]
    where = recorded_meta[repeated[0]] if repeated[0] < len(recorded_meta) else None
    key_note = f"; key leaves unchanged by the step: {', '.join(frozen_keys[:4])}" if frozen_keys else ""
    return [
        Finding(
            "step.rng_reused",
            f"the step draws the same random bits on two consecutive calls at {len(repeated)} of {len(bits0)} random "
            f"draw sites (e.g. identical dropout masks){key_note}",
            "split the PRNG key every step and return the new key in the state (`key, sub = jax.random.split(key)`, "
            "use sub, return key), or fold in the step number (`jax.random.fold_in(key, state.step)`); with NNX pass "
            "nnx.Rngs to the layers and let them advance",
            path=frozen_keys[0] if frozen_keys else None,
            file=_file(where),
            line=_line(where),
            extra={"sites": [recorded_meta[i] for i in repeated if i < len(recorded_meta)], "frozen_keys": frozen_keys},
        )
    ]


def _dead_code_eliminated(fn, flat_args):
    """``jax.jit(fn)`` compiled without the equations its outputs do not need (only the key
    arithmetic and ``random_bits`` of a train step remain, so the compile is small); evaluated with numpy
    instead, no compile, when every remaining equation is one the replay runs on the host (a threefry key's
    ``fold_in`` and bits, reshapes and slices: NNX's dropout)."""
    try:
        from jax._src.core import eval_jaxpr
        from jax._src.interpreters.partial_eval import dce_jaxpr
    except ImportError:  # pragma: no cover - private API moved: compile everything
        return quick_jit(fn, runs=2)
    closed = jax.make_jaxpr(fn)(flat_args)
    jaxpr, used = dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    consts = closed.consts
    if all(eqn.primitive.name in HOST_PRIMITIVES for eqn in jaxpr.eqns):  # key arithmetic, bits, reshapes: numpy

        def on_host(args):
            return evaluate_on_host(jaxpr, consts, [a for a, u in zip(args, used) if u])

        return on_host

    # only the leaves the draws read are passed: the others may be fingerprints of the state (step_snapshot.py)
    program = quick_jit(lambda needed: eval_jaxpr(jaxpr, consts, *needed), runs=2)
    return lambda args: program([a for a, u in zip(args, used) if u])


def _key_only_findings(snapshots: list, kinds: list[str]) -> list[Finding]:
    frozen = [
        shown_path(snapshots[0][i][0])
        for i, k in enumerate(kinds)
        if k == "key"
        and all(bitwise_equal(snapshots[c][i][1], snapshots[c + 1][i][1]) for c in range(len(snapshots) - 1))
    ]
    if not frozen:
        return []
    return [
        Finding(
            "step.rng_reused",
            f"the step draws randomness but the key(s) {', '.join(frozen[:4])} never change between steps",
            "split the key every step and return the new key in the state, or fold in the step number",
            path=frozen[0],
            extra={"frozen_keys": frozen},
        )
    ]


def _file(where: str | None) -> str | None:
    if not where or ":" not in where:
        return None
    return where.rsplit(":", 1)[0]


def _line(where: str | None) -> int | None:
    if not where or ":" not in where:
        return None
    tail = where.rsplit(":", 1)[1]
    return int(tail) if tail.isdigit() else None
