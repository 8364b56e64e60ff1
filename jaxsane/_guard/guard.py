"""guard: a transform that catches NaN/Inf in a train step's outputs where it happens.

``guarded = jaxsane.guard(train_step)`` has the same call signature and outputs. Inside one
compiled program it reduces every output leaf (and every input leaf, to tell bad data from a
bad step) to a finite flag: a handful of fused reductions. Healthy steps cost no blocking
device-to-host transfer: the small flag vector is read once it is ready, at a later call
(at most ``max_lag`` calls later) or at :meth:`Guarded.flush`.

Here: the transform, its compiled body and the call. The traced flags and the skip selection are
``flags.py``; reading the flags and reporting a failure (the host side, a ``HostSide`` that
:class:`Guarded` holds) is ``host.py`` and ``report.py``; the checks of guard's arguments are ``settings.py``.
Constructing a guard is not jit-safe; the guarded step may be called inside ``jit``/``vmap``.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.errors import GuardConfigError, JaxsaneWarning, NonFiniteError
from .._core.finding import Finding
from .._core.frames import user_call_site, user_stacklevel
from .._core.tree import finite_flags, leaves_with_paths, without_carried_infs
from .._core.validate import policy_from_env, require_policy
from .._dist.hang import HangWatch, check_hang_timeout
from .._experiment.chex import FINITE_ASSERTIONS, failed_assertion, is_chexified
from .._experiment.purify import (
    call_split,
    combine,
    needs_partition,
    nnx_module as _nnx,
    nnx_positions,
    partition,
    positional_names,
    split_objects,
)
from .._jaxpr.compile_level import quick_jit
from .._jaxpr.recompile import RecompileTracker, recompile_finding, signature
from .chex import chex_failure, flags_of
from .flags import grouped_flags, replica_target, select_state, select_tree, under_trace
from .host import HostSide, flush_at_exit, traced_failure
from .kept import KeptCall, PendingStep
from .settings import ENV_ONLY, POLICIES as POLICIES, check_settings


def _wait_checks(step: Any) -> None:
    """Drain a chexified step's pending chex checks (chex's wrapper has ``wait_checks``); may raise chex's error."""
    step.wait_checks()


class _Setting:
    """A read-only attribute of :class:`Guarded` that reads guard's frozen settings (one source of truth)."""

    def __init__(self, name: str, doc: str):
        self.name, self.__doc__ = name, doc

    def __get__(self, guarded: Any, owner: type | None = None) -> Any:
        return self if guarded is None else getattr(guarded._settings, self.name)


class Guarded:
    """The step returned by :func:`guard`. Call it exactly like the wrapped step.

    Sharded steps: inputs and outputs keep their shardings. On a failure with sharded leaves the failing leaves' shards
    are inspected (failure path only) and a ``dist.nonfinite_shard`` finding names the devices, processes and batch
    rows holding the NaN/Inf. Under ``jax.distributed`` every process reads its flags at the same call (``max_lag``
    calls late), so all processes stop at the same step with the same report and none is left waiting in a collective.

    Cost with many leaves: the traced checks are one reduction per chunk of up to 64 same-shaped leaves and (with skip)
    one ``lax.cond``, so the first call on a 10,000-leaf state stays a small multiple of the bare jit's compile
    (``benchmarks/guard_leaves.py``).

    Attributes:
      step_count: calls made so far (the step index in findings).
      failures: the :class:`Finding` of every failing step seen so far.
      skipped: how many steps were skipped (``on_nonfinite="skip"``).
      recompiles: a ``step.recompiles`` :class:`Finding` per compilation after the first, naming the
        argument that changed (``extra["changes"]``); the first of them is also warned.
      hang: the ``dist.hang`` :class:`Finding` of ``hang_timeout`` once reported (also in ``failures``).
      breakpoint: True when ``guard`` read ``JAXSANE_ON_NONFINITE=breakpoint``: the first failure opens the
        debugger at its origin, then raises as ``"raise"`` (``on_nonfinite`` is ``"raise"``).
    """

    def __init__(
        self,
        step: Callable,
        *,
        on_nonfinite: str = "raise",
        dump_dir: str | None = None,
        max_consecutive_skips: int = 10,
        max_lag: int = 2,
        keep_inputs: bool = True,
        sync: bool = False,
        locate: bool = True,
        check_replicas: bool | int = False,
        warn_recompiles: bool = True,
        hang_timeout: float | None = None,
        runs: float | None = None,
    ):
        """``runs``: about how many calls this guard will see, when the caller knows it is few (doctor's one
        re-run of a failing step: 1); guard's program is then compiled for that many runs
        (``quick_jit`` of ``_jaxpr/compile_level.py``, on XLA:CPU its quick level, as jaxsane's other one-off
        programs). None (the default, and what :func:`guard` passes): XLA's defaults, as for a training loop.
        The other arguments are :func:`guard`'s."""
        # (breakpoint is set by guard() from JAXSANE_ON_NONFINITE=breakpoint)
        self._settings = check_settings(
            step,
            on_nonfinite=on_nonfinite,
            dump_dir=dump_dir,
            max_consecutive_skips=max_consecutive_skips,
            max_lag=max_lag,
            keep_inputs=keep_inputs,
            sync=sync,
            locate=locate,
            check_replicas=check_replicas,
            warn_recompiles=warn_recompiles,
        )
        hang_timeout = check_hang_timeout(hang_timeout, "jaxsane.guard", GuardConfigError)
        functools.update_wrapper(self, step)
        self.step = step
        self._replica_plans: dict = {}
        self.step_count = 0
        self.recompiles: list[Finding] = []  # step.recompiles, one per compile after the first
        self._traces = 0  # bumped each time the compiled body is traced: a compile is coming
        self._recompile = RecompileTracker()
        info = getattr(step, "_jit_info", None)
        self._static_argnums = tuple(getattr(info, "static_argnums", ()) or ())
        self._static_argnames = tuple(getattr(info, "static_argnames", ()) or ())
        donate = tuple(getattr(info, "donate_argnums", ()) or ()) if not keep_inputs else ()
        self._host = HostSide(
            self._settings,
            step=step,
            arg_names=positional_names(step),
            replay=self._run,
            static_kw=bool(self._static_argnames),
        )
        # the hot path's handles on the host side, bound once: the queue of dispatched steps and its reader
        self._pending: collections.deque[PendingStep] = self._host.pending
        self._poll = self._host.poll
        self._skips = on_nonfinite == "skip"  # the compiled body selects the old state on failure
        # hang_timeout: the dist.hang watchdog (see _dist); a no-op until a call finds process_count() > 1
        self._hang = HangWatch(hang_timeout, self.failures.append) if hang_timeout is not None else None
        # body args: (layout, statics, static_kw, nnx_state, plain args, kwargs, replicas, skip, per_leaf, rest).
        # A donating step keeps its memory behaviour only with keep_inputs=False (then the plain args are donated).
        jit: Callable[..., Any] = jax.jit if runs is None else functools.partial(quick_jit, runs=runs)
        self._compiled = jit(self._body, static_argnums=(0, 1, 2, 6, 8, 9), donate_argnums=(4,) if donate else ())
        # the common case (plain pytree args, no static args, no NNX objects, no replica check) skips the
        # static-argument hashing of the general entry point: ~10 us less per call
        self._compiled_plain = jit(self._plain_body, donate_argnums=(0,) if donate else ())
        self._plain_ok = not self._static_argnums and not self._static_argnames
        self._chex = is_chexified(step)  # chex.chexify(step): called as it is, chex stays the outermost transform
        if self._chex and self._skips:
            raise GuardConfigError(
                "[jaxsane] guard(chex.chexify(step), on_nonfinite='skip'): a chexified step runs "
                "outside guard's compiled program, so guard cannot select the old state inside "
                "it. Use on_nonfinite='raise' or 'warn', or guard the step under chexify."
            )
        atexit.register(flush_at_exit, weakref.ref(self._host))

    # ------------------------------------------------------------------ settings and the host side's state
    on_nonfinite = _Setting("on_nonfinite", 'The policy on a failing step: ``"raise"``, ``"skip"`` or ``"warn"``.')
    dump_dir = _Setting("dump_dir", "Where a failing step's inputs are dumped (None: not dumped).")
    max_consecutive_skips = _Setting(
        "max_consecutive_skips", 'With ``"skip"``: raise after this many failing steps in a row.'
    )
    max_lag = _Setting("max_lag", "How many calls a failure may be reported late.")
    keep_inputs = _Setting(
        "keep_inputs", "Whether the inputs of steps whose flags are not read yet are kept (for dumps and locate)."
    )
    sync = _Setting("sync", "Whether each call waits for its own flags.")
    locate_on_failure = _Setting("locate", "Whether a failing step is located (guard's ``locate=``).")
    check_replicas = _Setting(
        "check_replicas", "Whether (or every how many steps) replicated state is compared across devices."
    )
    warn_recompiles = _Setting("warn_recompiles", "Whether the step's second compilation warns.")

    @property
    def breakpoint(self) -> bool:
        """True when ``guard`` read ``JAXSANE_ON_NONFINITE=breakpoint`` (see the class docstring)."""
        return self._settings.breakpoint

    @breakpoint.setter
    def breakpoint(self, value: bool) -> None:
        self._settings = dataclasses.replace(self._settings, breakpoint=value)
        self._host.settings = self._settings

    @property
    def failures(self) -> list[Finding]:
        """The :class:`Finding` of every failing step seen so far."""
        return self._host.failures

    @property
    def skipped(self) -> int:
        """How many steps were skipped (``on_nonfinite="skip"``)."""
        return self._host.skipped

    # ------------------------------------------------------------------ the compiled body
    def _body(
        self, layout, statics, static_kw, nnx_state, plain, kwargs, replicas=(), skip=None, per_leaf=None, rest=None
    ):
        """Run the step and reduce inputs and outputs to finite flags. Jit-safe.

        ``rest`` (an ``_adapter.Static``) holds the args' non-array leaves (an Equinox model's activations) when
        ``plain`` and ``kwargs`` are their array parts; then ``out`` is returned as ``(arrays, Static)``.

        Inputs are checked except the state (the first argument, or the NNX objects): a non-finite
        state was already caught as the output of the step that produced it. ``skip`` (a traced bool,
        policy "skip" only) lets the host replay a failing step without the selection, through the same
        compiled program.
        """
        self._traces += 1
        in_flags = finite_flags((plain[1:] if layout is None else plain, kwargs))
        args, kw = plain, kwargs
        if rest is not None:  # Equinox: the step sees its args whole, the output leaves as arrays and the rest
            args, kw = combine((plain, kwargs), rest)
        args = list(args)
        for i, value in statics:
            args[i] = value
        state_in = (plain[0] if rest is not None else args[0]) if args else None  # the state's array part
        # the input leaves, taken before merge: the step mutates the merged objects (and may mutate
        # the variables nnx_state refers to), while skip needs the values as they came in.
        in_leaves, in_def = jax.tree_util.tree_flatten(nnx_state)
        step = self.step if rest is None else (lambda *a, **k: partition(self.step(*a, **k)))
        out, new_nnx_state = call_split(step, layout, nnx_state, args, {**kw, **dict(static_kw)})
        out, out_rest = out if rest is not None else (out, None)
        # per-leaf output flags only where the host cannot recompute them on failure (skip returns the old
        # state; keep_inputs=False keeps nothing; other processes' shards are not readable here); else the
        # cheaper grouped flags, and the failing leaves are found on the host from the kept outputs.
        per_leaf = self._host.per_leaf_flags() if per_leaf is None else per_leaf
        before = None if nnx_state is None else jax.tree_util.tree_unflatten(in_def, in_leaves)  # values as they came
        flagged = _placeholders_cleared(new_nnx_state, before, out, state_in)
        out_flags = finite_flags(flagged) if per_leaf else grouped_flags(flagged)
        # inputs with NaN/Inf are reported only when an output is non-finite: a NaN the step masks
        # (missing labels marked NaN, OGB style) is data, not a failure
        in_flags = in_flags | jnp.all(out_flags)
        ok = jnp.all(in_flags) & jnp.all(out_flags)
        replica = None
        if replicas:  # check_replicas: fingerprints of the new state's replicated leaves, compared across devices
            from .._dist.replicas import replica_fingerprints

            replica = replica_fingerprints(replica_target(out, new_nnx_state, state_in), replicas)
        if self._skips:
            keep = ok if skip is None else ok | ~skip
            if layout is not None:
                new_nnx_state = select_tree(keep, new_nnx_state, jax.tree_util.tree_unflatten(in_def, in_leaves))
            else:
                out = select_state(keep, out, state_in)
        flags = jnp.concatenate([in_flags, out_flags])
        if rest is not None:
            out = (out, out_rest)
        if replica is not None:  # the replica flags ride at the end of the flag vector
            return out, new_nnx_state, (jnp.concatenate([flags, replica[0]]), replica[1])
        return out, new_nnx_state, flags

    def _plain_body(self, plain, kwargs, skip=None):
        """``_body`` for plain pytree args (no statics, NNX objects or replica check). Jit-safe."""
        return self._body(None, (), (), None, plain, kwargs, (), skip)

    def _run(self, layout, statics, static_kw, nnx_state, plain, kwargs, plan, skip=True, rest=None):
        """The compiled body through the cheapest entry point that fits the call. ``skip=False`` (policy
        "skip", failure path) replays the step without selecting the old state, same compiled program.
        With ``rest`` (the args' non-array part) ``out`` comes back as ``(arrays, Static)``."""
        flag = (_SKIP if skip else _NO_SKIP) if self._skips else None
        if layout is None and not statics and not static_kw and not plan and rest is None:
            return self._compiled_plain(plain, kwargs, flag)
        return self._compiled(layout, statics, static_kw, nnx_state, plain, kwargs, plan, flag, None, rest)

    @property
    def compiles(self) -> int:
        """How many programs the guarded step has compiled (normally 1). Not jit-safe."""
        return self._compiled._cache_size() + self._compiled_plain._cache_size()

    # ------------------------------------------------------------------ calling
    def __call__(self, *args, **kwargs):
        if under_trace((args, kwargs)):
            return self._traced_call(*args, **kwargs)
        if self._hang is not None:  # records the step's entry and return for the dist.hang watchdog
            return self._hang.run(self.step_count, self._call, *args, **kwargs)
        return self._call(*args, **kwargs)

    def _chex_call(self, *args, **kwargs):
        """A ``chex.chexify``-ed step: called as it is, its flags read by a small program of guard's own; a
        failed chex finite assertion becomes a NonFiniteError (see ``_guard_chex``). Not jit-safe."""
        if self._pending:
            self._chex_poll(block=False)
        try:
            out = self.step(*args, **kwargs)
        except AssertionError as e:
            self._on_chex_assertion(e, (self.step_count, args, kwargs))
        flags = flags_of(tuple(args[1:]), kwargs, out)
        kept = KeptCall((), None, tuple(args), kwargs, None, out, None) if self._settings.keep_inputs else None
        self._pending.append(PendingStep(self.step_count, flags, kept))
        self.step_count += 1
        if self._settings.sync:
            self._chex_poll(block=True)
        return out

    def _chex_poll(self, block: bool) -> None:
        """``_poll`` for a chexified step: when guard's own flags report a failure, chex's pending checks are
        drained, so its error for the same NaN becomes the report's cause instead of a traceback at exit."""
        try:
            self._poll(block)
        except NonFiniteError as err:
            try:
                _wait_checks(self.step)
            except AssertionError as e:
                if failed_assertion(e) is None:
                    raise
                err.__cause__ = e
            raise

    def _on_chex_assertion(self, e: AssertionError, current: tuple | None) -> None:
        """Raise chex's failed finite assertion ``e`` as a NonFiniteError (its cause); others as they are."""
        if failed_assertion(e) not in FINITE_ASSERTIONS:
            raise e
        held = [(r.step, *r.call.user_args()) for r in self._pending if r.call is not None]
        held += [current] if current is not None else []
        try:
            self._poll(block=True)  # guard's own flags first: a NaN in the outputs has its step and dump
        except NonFiniteError as err:
            raise err from e
        self._pending.clear()
        raise chex_failure(self, e, held) from e

    def flush(self) -> None:
        """Wait for every dispatched step's flags (and a chexified step's pending chex checks) and handle
        failures (may raise). Not jit-safe."""
        if self._chex:
            try:
                _wait_checks(self.step)
            except AssertionError as e:
                self._on_chex_assertion(e, None)
        self._poll(block=True)

    def _call(self, *args, **kwargs):
        settings = self._settings
        if settings.breakpoint and self._host.multiprocess is None:
            self._host.refuse_breakpoint_across_processes()
        if self._chex:
            return self._chex_call(*args, **kwargs)
        if self._pending:
            self._poll(block=False)
        positions = nnx_positions(args)
        if self._plain_ok and not positions:
            statics, static_kw, plain = (), (), args
        else:
            statics = tuple((i, args[i]) for i in self._static_argnums if i < len(args))
            static_kw = tuple((k, kwargs.pop(k)) for k in self._static_argnames if k in kwargs)
            static_pos = {i for i, _ in statics}
            plain = tuple(None if (i in positions or i in static_pos) else a for i, a in enumerate(args))
        layout, nnx_state = split_objects(args, positions)
        rest = None
        if not positions and needs_partition((plain, kwargs)):  # Equinox: the arrays go in, the rest is static
            (plain, kwargs), rest = partition((tuple(plain), kwargs))
        objs = tuple(args[i] for i in positions)
        # nnx.split's state refers to the live variables, which nnx.update below overwrites: keep the
        # input values now (a list of immutable arrays) for dumps and locate.
        nnx_in = jax.tree_util.tree_flatten(nnx_state) if positions and settings.keep_inputs else None
        plan = self._replica_plan(nnx_state if positions else (plain[0] if plain else None))
        traces = self._traces
        out, new_nnx_state, flags = self._run(layout, statics, static_kw, nnx_state, plain, kwargs, plan, rest=rest)
        if self._traces != traces:  # this call compiled: say why (only here, off the fast path)
            self._on_compile(plain, statics, static_kw, positions, nnx_state, kwargs)
        out_arrays = out
        if rest is not None:
            out_arrays, out_rest = out
            out = combine(out_arrays, out_rest)
        replica = None
        if plan:
            flags, fps = flags
            names = [self._host.arg_name(p) for p in positions] if positions else [self._host.arg_name(0)]
            replica = (plan, fps, nnx_state if positions else plain[0], names, bool(positions))
        if positions:
            _nnx().update(objs, new_nnx_state)
        kept = None
        if settings.keep_inputs:  # NNX objects were mutated in place: keep the input values, not the objects
            kept = KeptCall(
                positions,
                nnx_in,
                plain,
                kwargs,
                new_nnx_state,
                out_arrays,
                layout[0] if layout else None,
                statics,
                static_kw,
                rest=rest,
            )
        self._pending.append(PendingStep(self.step_count, flags, kept, replica))
        self.step_count += 1
        if settings.sync:
            self._poll(block=True)
        return out

    @property
    def hang(self) -> Finding | None:
        """The ``dist.hang`` finding once the ``hang_timeout`` watchdog reported one, else None. Not jit-safe."""
        return self._hang.finding if self._hang is not None else None

    def _on_compile(self, plain, statics, static_kw, positions, nnx_state, kwargs) -> None:
        """A call traced the body again: diff its arguments' signature against the last compiled call's; at
        the second compile warn once (``step.recompiles``, ``extra["changes"]``). Not jit-safe."""
        args = list(plain)
        for i, value in statics:
            args[i] = value
        for k, p in enumerate(positions):  # NNX objects: their split state
            args[p] = nnx_state[k] if len(positions) > 1 else nnx_state
        sig = signature(
            args,
            {**kwargs, **dict(static_kw)},
            names=[self._host.arg_name(i) for i in range(len(args))],
            static_argnums=[i for i, _ in statics],
            static_argnames=[k for k, _ in static_kw],
        )
        rec = self._recompile.seen(sig, True, user_call_site())
        if rec is None:
            return
        finding = recompile_finding(rec, "the guarded step", step=self.step_count)
        self.recompiles.append(finding)
        if len(self.recompiles) == 1 and self._settings.warn_recompiles:
            warning = JaxsaneWarning(
                f"[jaxsane] {finding.headline()}\n    fix: {finding.hint}\n    (warned once; "
                f"every later compilation is listed in guarded.recompiles)"
            )
            warning.finding = finding
            warnings.warn(warning, stacklevel=user_stacklevel())

    def _replica_plan(self, state) -> tuple:
        """check_replicas: which state leaves are meant to be replicated (from their shardings), cached."""
        check = self._settings.check_replicas
        if not check or state is None:
            return ()
        if check is not True and self.step_count % int(check):
            return ()  # check_replicas=N: every N-th step (a second compiled variant, compiled once)
        from .._dist.replicas import cached_replica_plan

        return cached_replica_plan(self._replica_plans, state)

    def _traced_call(self, *args, **kwargs):
        """Under an outer jit/vmap: same checks; the host hears of failures through a callback."""
        rest = None
        if needs_partition((args, kwargs)):
            (args, kwargs), rest = partition((tuple(args), kwargs))
        out, _, flags = self._body(None, (), (), None, tuple(args), kwargs, per_leaf=True, rest=rest)
        out_arrays = out
        if rest is not None:
            out_arrays, out = out[0], combine(*out)
        in_names = [pair for i, a in enumerate(args[1:], 1) for pair in leaves_with_paths(a, self._host.arg_name(i))]
        names = (None, in_names + leaves_with_paths(kwargs), leaves_with_paths(out_arrays, "out"))
        jax.debug.callback(functools.partial(traced_failure, weakref.ref(self._host), names), flags)
        return out


_SKIP, _NO_SKIP = np.bool_(True), np.bool_(False)  # the traced ``skip`` argument of the compiled body


def guard(
    step: Callable,
    *,
    on_nonfinite: str = "raise",
    dump_dir: str | None = None,
    max_consecutive_skips: int = 10,
    max_lag: int = 2,
    keep_inputs: bool = True,
    sync: bool = False,
    locate: bool = True,
    check_replicas: bool | int = False,
    warn_recompiles: bool = True,
    hang_timeout: float | None = None,
) -> Guarded:
    """Wrap a train step so NaN/Inf in any output (or input) leaf is caught at the step it happens.

    The wrapped step has the same signature and outputs. It works on plain, ``jax.jit``-ed and ``nnx.jit``-ed steps and
    composes with ``jax.jit``/``jax.vmap`` applied outside (there a host callback reports failures). It compiles once.
    Not jit-safe to construct; the returned step may be called inside ``jit``/``vmap``.

    Args:
      step: the train step, e.g. ``(state, batch) -> (state, metrics)`` or an NNX step.
      on_nonfinite: ``"raise"`` raises :class:`NonFiniteError`; ``"skip"`` returns the failing step's input state
        bitwise (one ``lax.cond`` inside the compiled step; on failure the step is replayed once, same compiled
        program, to name the leaves) and counts it; ``"warn"`` warns. The words mean what they mean in
        :func:`jaxsane.fit` (``_validate.NONFINITE_POLICIES``). The environment variable
        ``JAXSANE_ON_NONFINITE=raise|skip|warn``, when set, overrides this argument (read here, when the step is
        wrapped); jaxsane's own loops (``fit``, doctor's run stage) build :class:`Guarded` directly and keep their
        policies. ``JAXSANE_ON_NONFINITE=breakpoint`` (only through the variable: written into code, a debugger stop
        would leave an unattended job waiting) is ``"raise"`` with a stop first: at the first failing step the origin
        is located on its inputs and :func:`jaxsane.post_mortem` opens ``pdb`` in the user's line of it; after ``c``
        the ``NonFiniteError`` is raised. A step called under an outer ``jit``/``vmap`` (reported through a callback,
        no inputs kept) raises without a stop.
      dump_dir: if set, the failing step's exact inputs are written there (``.npz`` + JSON, no pickle) and can be read
        back with :func:`jaxsane.load_dump`.
      max_consecutive_skips: with ``"skip"``, raise after this many failing steps in a row.
      max_lag: how many calls a failure may be reported late before the host waits for the flags. Healthy steps never
        block unless the host runs more than ``max_lag`` steps ahead.
      keep_inputs: keep references to the inputs of steps whose flags are not yet read, so the failing step's inputs
        can be dumped and located (also when the step donates its buffers; the donation is then not applied). ``False``
        restores donation and keeps nothing.
      sync: wait for each step's flags before returning, so the failing call itself raises.
      locate: run :func:`jaxsane.locate` on the failing inputs (off the hot path) to name the origin. Not under
        ``jax.distributed`` (it would run the step's collectives on one process): replay the dump in one process
        instead.
      check_replicas: also check, inside the compiled step, that every copy of the new state's replicated leaves (a
        sharding that puts the same index on several devices) is bitwise identical across devices and processes: one
        checksum per leaf and device and one small all-gather of them per step. A divergence is reported as
        ``dist.replica_divergence`` (raises :class:`jaxsane.ReplicaDivergenceError` with ``"raise"``, warns otherwise).
        An int ``N`` checks every N-th step only (the checksums cost about one pass over the replicated state).
      warn_recompiles: at the step's second compilation, warn (a :class:`JaxsaneWarning` whose ``.finding`` is
        ``step.recompiles``) naming the argument that changed, old and new value side by side. Every compilation after
        the first is in ``guarded.recompiles`` either way; ``False`` for a step that is meant to compile a few variants
        (a static mode argument).
      hang_timeout: under ``jax.distributed`` (``jax.process_count() > 1``), seconds a guarded call may run, or the
        newest step may wait for a process that has not entered it, before the job is reported stuck (``dist.hang``):
        which processes did not enter the step, the last step each entered and finished and when, and the Python stacks
        of the missing processes' threads, printed to stderr on every process. Then each process raises
        :class:`jaxsane.DistHangError` where its main thread runs Python, and exits with code 75 (``os._exit``, at once
        where its main thread is blocked in a collective, else a second later) so the job fails fast. Each process's
        record goes through the ``jax.distributed`` key-value store from a background thread; the call itself only
        stores a few numbers (about 1 us). None (default) is off; a single process is never watched. The first call
        (which compiles) is only watched for processes that never enter it; later calls count any host-side pause a
        process takes while the others wait (a checkpoint written by process 0 only).

    Sharded steps, and the cost with many leaves: see :class:`Guarded`.

    Returns:
      A :class:`Guarded` callable; call ``.flush()`` after the loop to hear about the last steps.

    Raises:
      GuardConfigError: (a ``ValueError`` and ``TypeError``) an argument of the wrong type or out of range, at the
        call, naming the valid values. Also when ``JAXSANE_ON_NONFINITE`` holds another word; and at the first call
        with ``JAXSANE_ON_NONFINITE=breakpoint`` under ``jax.distributed`` with more than one process (a debugger on
        one process would leave the others waiting in the step's collectives).

    Example:
      >>> import jax.numpy as jnp, jaxsane
      >>> guarded = jaxsane.guard(lambda s, b: (s + b, {"loss": jnp.sum(b)}), sync=True)
      >>> state, metrics = guarded(jnp.zeros(2), jnp.ones(2))
    """
    require_policy("jaxsane.guard", on_nonfinite, POLICIES, error=GuardConfigError)
    policy = policy_from_env("jaxsane.guard", on_nonfinite, POLICIES, error=GuardConfigError, env_only=ENV_ONLY)
    guarded = Guarded(
        step,
        on_nonfinite="raise" if policy == "breakpoint" else policy,
        dump_dir=dump_dir,
        max_consecutive_skips=max_consecutive_skips,
        max_lag=max_lag,
        keep_inputs=keep_inputs,
        sync=sync,
        locate=locate,
        check_replicas=check_replicas,
        warn_recompiles=warn_recompiles,
        hang_timeout=hang_timeout,
    )
    guarded.breakpoint = policy == "breakpoint"  # "raise", with a debugger at the origin first
    return guarded


def _placeholders_cleared(new_nnx_state: Any, nnx_state: Any, out: Any, state_in: Any) -> tuple[Any, Any]:
    """``(new_nnx_state, out)`` for the output flags, with the scalar +-inf placeholders carried from the input
    state cleared (:func:`~jaxsane._core.tree.without_carried_infs`): the NNX objects' state against theirs before
    the step, else the step's new state (``out`` or ``out[0]``) against its first argument. Jit-safe."""
    if new_nnx_state is not None and nnx_state is not None:
        return without_carried_infs(new_nnx_state, nnx_state), out
    if state_in is None:
        return new_nnx_state, out
    same = jax.tree_util.tree_structure(state_in)
    if isinstance(out, tuple) and len(out) == 2 and jax.tree_util.tree_structure(out[0]) == same:  # type: ignore[operator]
        return new_nnx_state, (without_carried_infs(out[0], state_in), out[1])
    return new_nnx_state, without_carried_infs(out, state_in)
