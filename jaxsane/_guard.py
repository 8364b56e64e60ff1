"""guard: a transform that catches NaN/Inf in a train step's outputs where it happens.

``guarded = jaxsane.guard(train_step)`` has the same call signature and outputs. Inside one
compiled program it reduces every output leaf (and every input leaf, to tell bad data from a
bad step) to a finite flag: a handful of fused reductions. Healthy steps cost no blocking
device-to-host transfer: the small flag vector is read once it is ready, at a later call
(at most ``max_lag`` calls later) or at :meth:`Guarded.flush`.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import os
import warnings
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ._adapter import call_split, nnx_module as _nnx, nnx_positions, positional_names, split_objects
from ._errors import GuardConfigError, NonFiniteError
from ._findings import Finding
from ._tree import finite_flags, host_finite_flags, is_inexact, leaves_with_paths, same_structure, to_host
from ._validate import require_policy

POLICIES = ("raise", "skip", "warn")  # the words of _validate.NONFINITE_POLICIES that guard carries out

_FIX = {
    "nonfinite.input": "the batch already holds NaN/Inf: check the data pipeline (jaxsane.check_data) and "
                       "drop or repair bad rows before they reach the step.",
    "nonfinite.forward": "run jaxsane.locate(step, *inputs) on the dumped inputs to find the line; typical "
                         "causes are log(0), exp overflow, 0/0 in a masked mean, fp16 overflow.",
    "nonfinite.update": "the loss was finite but the new state is not: run jaxsane.locate on the dumped inputs; "
                        "typical causes are a NaN gradient (double-where trap, norm at 0), fp16 Adam eps "
                        "underflow, or a learning rate blow-up.",
}


class JaxsaneWarning(RuntimeWarning):
    """Issued by ``guard(..., on_nonfinite="warn")``."""


try:  # cheap test for "called under jit/vmap/grad tracing" (no pytree flattening on the hot path)
    from jax._src.core import trace_state_clean as _trace_state_clean
except ImportError:  # pragma: no cover
    _trace_state_clean = None


def _has_tracer(tree: Any) -> bool:
    if _trace_state_clean is not None:
        return not _trace_state_clean()
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree))


def _all_set(flags: np.ndarray) -> bool:
    """``flags.all()`` for a small bool/uint8 flag vector, without numpy's reduction overhead (~8 us)."""
    if flags.dtype.itemsize == 1:
        return b"\x00" not in flags.tobytes()
    return bool(flags.all())


@dataclasses.dataclass
class _Pending:
    step: int
    flags: jax.Array
    call: "_Call | None"    # what the call saw, kept by reference (None with keep_inputs=False)
    replica: Any = None     # check_replicas: (plan, fingerprints, input state, root names); see _dist


class Guarded:
    """The step returned by :func:`guard`. Call it exactly like the wrapped step.

    Attributes:
      step_count: calls made so far (the step index in findings).
      failures: the :class:`Finding` of every failing step seen so far.
      skipped: how many steps were skipped (``on_nonfinite="skip"``).
    """

    def __init__(self, step: Callable, *, on_nonfinite: str = "raise", dump_dir: str | None = None,
                 max_consecutive_skips: int = 10, max_lag: int = 2, keep_inputs: bool = True,
                 sync: bool = False, locate: bool = True, check_replicas: bool | int = False):
        dump_dir = _check_args(step, on_nonfinite, dump_dir, max_consecutive_skips, max_lag, keep_inputs, sync,
                               locate, check_replicas)
        functools.update_wrapper(self, step)
        self.step = step
        self.on_nonfinite = on_nonfinite
        self.dump_dir = dump_dir
        self.max_consecutive_skips = max_consecutive_skips
        self.max_lag = max_lag
        self.keep_inputs = keep_inputs
        self.sync = sync
        self.locate_on_failure = locate
        self.check_replicas = check_replicas
        self._replica_plans: dict = {}
        self._multiprocess: bool | None = None  # jax.process_count() > 1, read at the first poll
        self.step_count = 0
        self.skipped = 0
        self.failures: list[Finding] = []
        self._consecutive = 0
        self._last_failed_step: int | None = None
        self._pending: collections.deque[_Pending] = collections.deque()
        info = getattr(step, "_jit_info", None)
        self._static_argnums = tuple(getattr(info, "static_argnums", ()) or ())
        self._static_argnames = tuple(getattr(info, "static_argnames", ()) or ())
        donate = tuple(getattr(info, "donate_argnums", ()) or ()) if not keep_inputs else ()
        self._arg_names = positional_names(step)
        # body args: (layout, statics, static_kw, nnx_state, plain args, kwargs). A donating step keeps its
        # memory behaviour only with keep_inputs=False (then the plain args tuple is donated).
        self._compiled = jax.jit(self._body, static_argnums=(0, 1, 2, 6), donate_argnums=(4,) if donate else ())
        # the common case (plain pytree args, no static args, no NNX objects, no replica check) skips the
        # static-argument hashing of the general entry point: ~10 us less per call
        self._compiled_plain = jax.jit(self._plain_body, donate_argnums=(0,) if donate else ())
        self._plain_ok = not self._static_argnums and not self._static_argnames
        atexit.register(_flush_at_exit, weakref.ref(self))

    # ------------------------------------------------------------------ naming
    def _arg_name(self, i: int) -> str:
        return self._arg_names[i] if i < len(self._arg_names) else f"args[{i}]"

    # ------------------------------------------------------------------ the compiled body
    def _body(self, layout, statics, static_kw, nnx_state, plain, kwargs, replicas=(), skip=None, per_leaf=None):
        """Run the step and reduce inputs and outputs to finite flags. Jit-safe.

        Inputs are checked except the state (the first argument, or the NNX objects): a non-finite
        state was already caught as the output of the step that produced it. ``skip`` (a traced bool,
        policy "skip" only) lets the host replay a failing step without the selection, through the same
        compiled program.
        """
        in_flags = finite_flags((plain[1:] if layout is None else plain, kwargs))
        args = list(plain)
        for i, value in statics:
            args[i] = value
        # the input leaves, taken before merge: the step mutates the merged objects (and may mutate
        # the variables nnx_state refers to), while skip needs the values as they came in.
        in_leaves, in_def = jax.tree_util.tree_flatten(nnx_state)
        out, new_nnx_state = call_split(self.step, layout, nnx_state, args, {**kwargs, **dict(static_kw)})
        # per-leaf output flags only where the host cannot recompute them on failure (skip returns the old
        # state; keep_inputs=False keeps nothing; other processes' shards are not readable here); else the
        # cheaper grouped flags, and the failing leaves are found on the host from the kept outputs.
        per_leaf = self._per_leaf_flags() if per_leaf is None else per_leaf
        out_flags = finite_flags((new_nnx_state, out)) if per_leaf else _grouped_flags((new_nnx_state, out))
        # inputs with NaN/Inf are reported only when an output is non-finite: a NaN the step masks
        # (missing labels marked NaN, OGB style) is data, not a failure
        in_flags = in_flags | jnp.all(out_flags)
        ok = jnp.all(in_flags) & jnp.all(out_flags)
        replica = None
        if replicas:  # check_replicas: fingerprints of the new state's replicated leaves, compared across devices
            from ._dist import replica_fingerprints
            replica = replica_fingerprints(_replica_target(out, new_nnx_state, args[0] if args else None), replicas)
        if self.on_nonfinite == "skip":
            keep = ok if skip is None else ok | ~skip
            if layout is not None:
                new_nnx_state = _select(keep, new_nnx_state, jax.tree_util.tree_unflatten(in_def, in_leaves))
            else:
                out = _select_state(keep, out, args[0] if args else None)
        flags = jnp.concatenate([in_flags, out_flags])
        if replica is not None:  # the replica flags ride at the end of the flag vector
            return out, new_nnx_state, (jnp.concatenate([flags, replica[0]]), replica[1])
        return out, new_nnx_state, flags

    def _plain_body(self, plain, kwargs, skip=None):
        """``_body`` for plain pytree args (no statics, NNX objects or replica check). Jit-safe."""
        return self._body(None, (), (), None, plain, kwargs, (), skip)

    def _run(self, layout, statics, static_kw, nnx_state, plain, kwargs, plan, skip=True):
        """The compiled body through the cheapest entry point that fits the call. ``skip=False`` (policy
        "skip", failure path) replays the step without selecting the old state, same compiled program."""
        flag = (_SKIP if skip else _NO_SKIP) if self.on_nonfinite == "skip" else None
        if layout is None and not statics and not static_kw and not plan:
            return self._compiled_plain(plain, kwargs, flag)
        return self._compiled(layout, statics, static_kw, nnx_state, plain, kwargs, plan, flag)

    @property
    def compiles(self) -> int:
        """How many programs the guarded step has compiled (normally 1). Not jit-safe."""
        return self._compiled._cache_size() + self._compiled_plain._cache_size()

    # ------------------------------------------------------------------ calling
    def __call__(self, *args, **kwargs):
        if _has_tracer((args, kwargs)):
            return self._traced_call(*args, **kwargs)
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
        objs = tuple(args[i] for i in positions)
        # nnx.split's state refers to the live variables, which nnx.update below overwrites: keep the
        # input values now (a list of immutable arrays) for dumps and locate.
        nnx_in = jax.tree_util.tree_flatten(nnx_state) if positions and self.keep_inputs else None
        plan = self._replica_plan(nnx_state if positions else (plain[0] if plain else None))
        out, new_nnx_state, flags = self._run(layout, statics, static_kw, nnx_state, plain, kwargs, plan)
        replica = None
        if plan:
            flags, fps = flags
            names = [self._arg_name(p) for p in positions] if positions else [self._arg_name(0)]
            replica = (plan, fps, nnx_state if positions else plain[0], names, bool(positions))
        if positions:
            _nnx().update(objs, new_nnx_state)
        kept = None
        if self.keep_inputs:  # NNX objects were mutated in place: keep the input values, not the objects
            kept = _Call(positions, nnx_in, plain, kwargs, new_nnx_state, out, layout[0] if layout else None,
                         statics, static_kw)
        self._pending.append(_Pending(self.step_count, flags, kept, replica))
        self.step_count += 1
        if self.sync:
            self._poll(block=True)
        return out

    def _replica_plan(self, state) -> tuple:
        """check_replicas: which state leaves are meant to be replicated (from their shardings), cached."""
        if not self.check_replicas or state is None:
            return ()
        if self.check_replicas is not True and self.step_count % int(self.check_replicas):
            return ()  # check_replicas=N: every N-th step (a second compiled variant, compiled once)
        leaves = jax.tree_util.tree_leaves(state)
        key = (jax.tree_util.tree_structure(state),
               tuple((getattr(x, "sharding", None), getattr(x, "shape", None)) for x in leaves))
        if key not in self._replica_plans:
            from ._dist import replica_plan
            self._replica_plans[key] = replica_plan(state)
        return self._replica_plans[key]

    def _traced_call(self, *args, **kwargs):
        """Under an outer jit/vmap: same checks; the host hears of failures through a callback."""
        out, _, flags = self._body(None, (), (), None, tuple(args), kwargs, per_leaf=True)
        in_names = [pair for i, a in enumerate(args[1:], 1) for pair in leaves_with_paths(a, self._arg_name(i))]
        names = (None, in_names + leaves_with_paths(kwargs), leaves_with_paths(out, "out"))
        jax.debug.callback(functools.partial(_traced_failure, weakref.ref(self), names), flags)
        return out

    # ------------------------------------------------------------------ host side
    def _poll(self, block: bool) -> None:
        while self._pending:
            rec = self._pending[0]
            if self._multiprocess is None:
                self._multiprocess = jax.process_count() > 1
            # Under jax.distributed every process must decide at the same call (a failure path may run
            # collectives, and a process that stops early would leave the others waiting in the next step's
            # collectives): there flags are read after exactly max_lag calls, never "when ready".
            if not block and len(self._pending) <= self.max_lag and (self._multiprocess or not rec.flags.is_ready()):
                return
            self._pending.popleft()
            flags = np.asarray(rec.flags)
            if _all_set(flags):
                self._consecutive = 0
            else:
                self._on_failure(rec, flags)

    def flush(self) -> None:
        """Wait for every dispatched step's flags and handle failures (may raise). Not jit-safe."""
        self._poll(block=True)

    def _names(self, call: "_Call") -> tuple[list[str], list[str]]:
        """(input leaf paths, output leaf paths), in the order of the flag vector."""
        obj_names = [self._arg_name(p) for p in call.positions]
        in_paths = []
        for i, a in enumerate(call.plain):
            if i > 0 or call.positions:  # the state (first argument) is not checked on input
                in_paths += [p for p, _ in leaves_with_paths(a, self._arg_name(i))]
        in_paths += [p for p, _ in leaves_with_paths(call.kwargs)]
        out_paths = _nnx_paths(call.new_nnx_state, obj_names)
        out = call.out
        if call.positions:
            root = "metrics" if isinstance(out, (dict, tuple, list)) else "loss"
            out_paths += [p for p, _ in leaves_with_paths(out, root)]
        elif isinstance(out, tuple) and len(out) == 2 and call.plain and same_structure(out[0], call.plain[0]):
            out_paths += [p for p, _ in leaves_with_paths(out[0], self._arg_name(0))]
            out_paths += [p for p, _ in leaves_with_paths(out[1], "metrics" if isinstance(out[1], dict) else "loss")]
        else:
            root = self._arg_name(0) if call.plain and same_structure(out, call.plain[0]) else "out"
            out_paths += [p for p, _ in leaves_with_paths(out, root)]
        return in_paths, out_paths

    # ------------------------------------------------------------------ sharded steps (see _dist)
    def _replica_failures(self, rec: _Pending, flags: np.ndarray) -> tuple[np.ndarray, list[Finding]]:
        """Split the replica flags off the flag vector; dist.replica_divergence findings for those that failed."""
        plan, fps, state_in, names, is_nnx = rec.replica
        n = sum(len(group[1]) for group in plan)
        finite, agree = flags[:len(flags) - n], flags[len(flags) - n:]
        if agree.all():
            return finite, []
        from ._dist import plan_findings
        paths = _nnx_paths(state_in, names) if is_nnx else [p for p, _ in leaves_with_paths(state_in, names[0])]
        return finite, plan_findings(plan, fps, paths, step=rec.step)

    def _on_divergence(self, rec: _Pending, divergence: list[Finding]) -> None:
        """check_replicas: report copies of replicated state that differ ("skip" cannot undo it: it warns)."""
        from ._dist import ReplicaDivergenceError
        self.failures.extend(divergence)
        text = (f"[jaxsane] dist.replica_divergence at step {rec.step}: the new state is not the same on every "
                f"device/process\n" + "\n".join(f"  {d.message}" for d in divergence)
                + f"\n  fix: {divergence[0].hint}")
        if self.on_nonfinite != "raise":
            warnings.warn(text, JaxsaneWarning, stacklevel=4)
            return
        self._pending.clear()
        raise ReplicaDivergenceError(text, divergence)

    def _shard_finding(self, call: "_Call", bad: np.ndarray, step: int, code: str) -> Finding | None:
        """dist.nonfinite_shard for a failing sharded step (failure path only), else None.

        First the failing leaves' shards are inspected; when the NaN/Inf is everywhere (spread by an
        all-reduce), the step is replayed once per batch shard to find the shard whose rows cause it.
        """
        from ._dist_shards import nonfinite_shards, replay_shards
        values = [x for i, a in enumerate(call.plain) if i > 0 or call.positions for x in jax.tree_util.tree_leaves(a)]
        values += jax.tree_util.tree_leaves(call.kwargs)
        values += jax.tree_util.tree_leaves((call.new_nnx_state, call.out))
        in_paths, out_paths = self._names(call)
        names = in_paths + out_paths
        found = None
        # (if the flag layout changed under us, better no attribution than a wrong one)
        if len(names) == len(values) and any(isinstance(values[i], jax.Array) and len(values[i].sharding.device_set) > 1
                                             for i in bad if i < len(values)):
            found = nonfinite_shards([(names[i], values[i]) for i in bad], step=step, what=code)
        if found is not None or code == "nonfinite.input" or call.positions or self._static_argnames:
            return found
        statics = call.statics

        def run(plain, kwargs) -> bool:
            return _all_set(np.asarray(self._run(None, statics, (), None, plain, kwargs, ())[2]))

        try:
            return replay_shards(run, call.plain, call.kwargs, step=step)
        except Exception as e:  # attribution must never hide the original failure
            warnings.warn(f"[jaxsane] per-shard replay failed: {type(e).__name__}: {e}", JaxsaneWarning)
            return None

    def _per_leaf_flags(self) -> bool:
        """Whether the compiled step returns one output flag per leaf (see ``_body``)."""
        return not self.keep_inputs or jax.process_count() > 1

    def _leaf_flags(self, rec: _Pending, flags: np.ndarray) -> np.ndarray:
        """Per-leaf flags in the order of ``_names`` (failure path): the input part as computed in the step,
        the output part recomputed on the host from the kept outputs when the step returned grouped flags.
        With skip the returned state is the old one: the step is replayed once (same compiled program,
        selection off) and its outputs replace ``call.out`` for the report."""
        call = rec.call
        if self._per_leaf_flags():
            return flags
        in_values = [x for i, a in enumerate(call.plain) if i > 0 or call.positions
                     for x in jax.tree_util.tree_leaves(a)] + jax.tree_util.tree_leaves(call.kwargs)
        in_flags = flags[:len(in_values)]
        if self.on_nonfinite == "skip" and in_flags.all() and not call.replayed:
            state = jax.tree_util.tree_unflatten(call.nnx_in[1], call.nnx_in[0]) if call.positions else None
            layout = (call.graphdef, call.positions) if call.positions else None
            plan = rec.replica[0] if rec.replica is not None else ()
            try:
                call.out, call.new_nnx_state, _ = self._run(layout, call.statics, call.static_kw, state, call.plain,
                                                            call.kwargs, plan, skip=False)
                call.replayed = True
            except Exception as e:  # the report must never hide the original failure
                warnings.warn(f"[jaxsane] replaying the skipped step to name its non-finite leaves failed: "
                              f"{type(e).__name__}: {e}", JaxsaneWarning)
        out_values = jax.tree_util.tree_leaves((call.new_nnx_state, call.out))
        out_flags = host_finite_flags(out_values)
        grouped = flags[len(in_values):]
        if out_flags.all() and not grouped.all():  # not reproduced (or not replayed): every leaf of a failing group
            for chunk, finite in zip(_chunks(out_values), grouped):
                out_flags[chunk] &= bool(finite)
        return np.concatenate([in_flags, out_flags])

    def _on_failure(self, rec: _Pending, flags: np.ndarray) -> None:
        call = rec.call
        divergence: list[Finding] = []
        if rec.replica is not None:  # the replica flags ride at the end of the flag vector
            flags, divergence = self._replica_failures(rec, flags)
            if flags.all():
                return self._on_divergence(rec, divergence)
        if call is not None:
            flags = self._leaf_flags(rec, flags)
        bad = np.flatnonzero(~flags)
        if call is None:
            code, paths = "nonfinite.forward", [f"leaf {i}" for i in bad]
            message = f"step {rec.step} produced NaN/Inf (keep_inputs=False: leaf names and inputs not kept)"
        else:
            in_paths, out_paths = self._names(call)
            names = in_paths + out_paths
            bad_inputs = [names[i] for i in bad if i < len(in_paths)]
            bad_outputs = [names[i] for i in bad if i >= len(in_paths)]
            if bad_inputs:
                code, paths = "nonfinite.input", bad_inputs
                message = f"the inputs of step {rec.step} already hold NaN/Inf at {_some(bad_inputs)}"
            else:
                in_metrics = any(p.startswith(("metrics", "loss", "out")) for p in bad_outputs)
                code, paths = ("nonfinite.forward" if in_metrics else "nonfinite.update"), bad_outputs
                message = f"step {rec.step} produced NaN/Inf in {_some(bad_outputs)}"
        hint, file, line, located, host_inputs, shard = _FIX[code], None, None, None, None, None
        if call is not None:
            shard = self._shard_finding(call, bad, rec.step, code)
            if self._multiprocess:  # leaves spread over processes are gathered (the same collective everywhere)
                from ._dist_shards import gather_to_host
                host_inputs = gather_to_host((call.args(), call.kwargs))
            else:
                host_inputs = (to_host(call.args()), to_host(call.kwargs))
            # locate replays the step equation by equation on this host only: under jax.distributed that would
            # run the step's collectives on one process, so it is left to a single-process replay of the dump.
            if self.locate_on_failure and code != "nonfinite.input" and not self._multiprocess:
                located = _try_locate(self.step, call)
        origin = located.origins[0] if located is not None and getattr(located, "origins", None) else None
        if origin is not None:
            code = getattr(origin, "code", code)
            file, line = getattr(origin, "file", None), getattr(origin, "line", None)
            hint = getattr(origin, "fix", None) or hint
            message += f"; origin: {origin.summary()}"
        dump_path, dump_error = None, None
        if self.dump_dir and host_inputs is not None:
            from ._dump import save_dump
            dump_path = os.path.join(self.dump_dir, f"step_{rec.step:06d}")
            try:
                if not self._multiprocess or jax.process_index() == 0:  # the gathered inputs are the same everywhere
                    save_dump(dump_path, host_inputs[0], host_inputs[1],
                              meta={"step": rec.step, "finding": {"code": code, "message": message, "paths": paths}})
                message += f" (inputs dumped to {dump_path})"
            except Exception as e:  # a failed dump is a warning inside the failure, never a replacement for it
                dump_error, dump_path = str(e), None
                message += (f" (warning: the inputs could not be dumped: {dump_error}; they are still in "
                            "NonFiniteError.inputs)")
        finding = Finding(code, message, hint, path=paths[0] if paths else None, step=rec.step, file=file,
                          line=line, extra={"paths": paths, "policy": self.on_nonfinite,
                                            **({"dump": dump_path} if dump_path else {}),
                                            **({"dump_error": dump_error} if dump_error else {}),
                                            **({"nonfinite_shard": {"message": shard.message, **shard.extra}}
                                               if shard is not None else {})})
        self.failures.append(finding)
        self.failures.extend([shard] if shard is not None else [])
        self.failures.extend(divergence)
        consecutive = self._last_failed_step is not None and rec.step == self._last_failed_step + 1
        self._consecutive = self._consecutive + 1 if consecutive else 1
        self._last_failed_step = rec.step
        text = f"[jaxsane] {code} at step {rec.step}: {message}\n  fix: {hint}"
        if shard is not None:
            text += f"\n  {shard.code}: {shard.message}"
        text += "".join(f"\n  {d.code}: {d.message}" for d in divergence)
        if located is not None:
            text += "\n" + str(located)
        if self.on_nonfinite == "skip":
            self.skipped += 1
            if self._consecutive < self.max_consecutive_skips:
                return
            text = (f"[jaxsane] {self._consecutive} consecutive steps skipped (max_consecutive_skips="
                    f"{self.max_consecutive_skips}); the last one:\n{text}")
        elif self.on_nonfinite == "warn":
            warnings.warn(text, JaxsaneWarning, stacklevel=3)
            return
        self._pending.clear()  # later steps ran on a non-finite state: the first failure is the story
        raise NonFiniteError(text, finding, dump_path=dump_path, inputs=host_inputs, located=located,
                             dump_error=dump_error)


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_args(step, on_nonfinite, dump_dir, max_consecutive_skips, max_lag, keep_inputs, sync, locate,
                check_replicas) -> str | None:
    """Validate guard's arguments before any work; returns ``dump_dir`` as a ``str`` (or None). Not jit-safe.

    Raises:
      GuardConfigError: naming the argument, what it got, and the values it accepts.
    """
    def bad(name: str, value: Any, valid: str) -> GuardConfigError:
        return GuardConfigError(f"[jaxsane] {name} must be {valid}; got {value!r} ({type(value).__name__}). "
                                f"Fix the {name}= argument of jaxsane.guard.")

    if not callable(step):
        raise GuardConfigError(f"[jaxsane] guard needs a callable step, e.g. (state, batch) -> (state, metrics); "
                               f"got {type(step).__name__}. Pass the train step function itself, not its result.")
    require_policy("jaxsane.guard", on_nonfinite, POLICIES, error=GuardConfigError)
    if dump_dir is not None:
        if not isinstance(dump_dir, (str, os.PathLike)) or isinstance(dump_dir, bytes):
            raise bad("dump_dir", dump_dir, "None or a directory path (str or os.PathLike)")
        dump_dir = os.fspath(dump_dir)
        if not isinstance(dump_dir, str) or not dump_dir:
            raise bad("dump_dir", dump_dir, "None or a non-empty directory path (str or os.PathLike)")
        if os.path.exists(dump_dir) and not os.path.isdir(dump_dir):
            raise GuardConfigError(f"[jaxsane] guard(dump_dir={dump_dir!r}): the path exists and is not a "
                                   f"directory. Pass a directory (it is created on the first failure) or None.")
    if not _is_int(max_consecutive_skips) or max_consecutive_skips < 1:
        raise bad("max_consecutive_skips", max_consecutive_skips, "an int >= 1 (default 10)")
    if not _is_int(max_lag) or max_lag < 0:
        raise bad("max_lag", max_lag, "an int >= 0 (default 2; 0 reads each step's flags at the next call)")
    for name, value in (("keep_inputs", keep_inputs), ("sync", sync), ("locate", locate)):
        if not isinstance(value, (bool, np.bool_)):
            raise bad(name, value, "True or False")
    if not isinstance(check_replicas, (bool, np.bool_)) and not (_is_int(check_replicas) and check_replicas >= 1):
        raise bad("check_replicas", check_replicas, "True, False, or a step interval int >= 1 (check every N-th "
                                                    "step)")
    return dump_dir


@dataclasses.dataclass
class _Call:
    """What one guarded call saw, kept by reference until its flags are read."""
    positions: tuple
    nnx_in: Any             # (leaves, treedef) of the NNX objects' state as it came in, or None
    plain: tuple            # positional args, with NNX objects and static args replaced by None
    kwargs: dict
    new_nnx_state: Any
    out: Any
    graphdef: Any
    statics: tuple = ()     # (position, value) of static positional args
    static_kw: tuple = ()   # (name, value) of static keyword args
    replayed: bool = False  # skip: out/new_nnx_state replaced by the failing step's own (unselected) outputs

    def args(self) -> tuple:
        """The positional args as the step saw them; NNX objects as their pure input ``nnx.State``."""
        args = list(self.plain)
        for i, value in self.statics:
            args[i] = value
        if self.positions:
            state = jax.tree_util.tree_unflatten(self.nnx_in[1], self.nnx_in[0])
            for k, p in enumerate(self.positions):
                args[p] = state[k]
        return tuple(args)


def _some(paths: list[str], n: int = 4) -> str:
    return ", ".join(paths[:n]) + (f" and {len(paths) - n} more leaves" if len(paths) > n else "")


def _nnx_paths(state: Any, names: list[str]) -> list[str]:
    """Leaf paths of a split tuple of NNX objects, with ``[k]`` replaced by the k-th argument name."""
    if state is None:
        return []
    out = []
    for path, _ in leaves_with_paths(state):
        head, _, rest = path.partition("]")
        k = head.lstrip("[")
        out.append((names[int(k)] if k.isdigit() and int(k) < len(names) else head + "]") + rest)
    return out


def _replica_target(out: Any, new_nnx_state: Any, state_in: Any) -> Any:
    """The new state (same structure as the state passed in) whose replicas are checked. Jit-safe."""
    if new_nnx_state is not None:
        return new_nnx_state
    if isinstance(out, tuple) and len(out) >= 1 and same_structure(out[0], state_in):
        return out[0]
    return out if same_structure(out, state_in) else state_in  # a loss-only step: check the state passed in


_SKIP, _NO_SKIP = np.bool_(True), np.bool_(False)  # the traced ``skip`` argument of the compiled body
_CHUNK = 64  # leaves per grouped reduction: XLA:CPU compiles many small fusions faster than a few huge ones


def _grouped_flags(tree: Any) -> jax.Array:
    """One bool per chunk of at most ``_CHUNK`` inexact leaves of one (shape, dtype): True when all are finite.

    Leaves of one shape (a kernel, its Adam ``mu`` and ``nu``) are combined elementwise before a single
    ``uint8`` min-reduction, so XLA reads each array once; chunking bounds the size of each fused
    computation, so a state of 10,000 same-shaped leaves compiles as fast as a few hundred small fusions.
    No reshapes or concatenations: sharded leaves stay sharded. Jit-safe.
    """
    leaves = jax.tree_util.tree_leaves(tree)
    flags = []
    for chunk in _chunks(leaves):
        finite = jnp.isfinite(leaves[chunk[0]])
        for i in chunk[1:]:
            finite = finite & jnp.isfinite(leaves[i])
        flags.append(jnp.min(finite.astype(jnp.uint8)).astype(bool) if finite.ndim else finite)
    return jnp.stack(flags) if flags else jnp.ones((0,), bool)


def _chunks(leaves: list) -> list[list[int]]:
    """The leaf indices behind each flag of :func:`_grouped_flags`, in flag order. Jit-safe."""
    groups: dict = {}
    for i, x in enumerate(leaves):
        if is_inexact(x) and np.size(x):  # empty leaves are trivially finite
            groups.setdefault((np.shape(x), np.dtype(x.dtype)), []).append(i)
    return [idx[start:start + _CHUNK] for idx in groups.values() for start in range(0, len(idx), _CHUNK)]


def _select(ok: jax.Array, new: Any, old: Any) -> Any:
    """``new`` if ``ok`` else ``old``, as one ``lax.cond`` over the whole pytree: one op however many leaves
    (a per-leaf select made XLA:CPU's compile time explode with the leaf count). Under ``vmap`` with a
    batched ``ok`` JAX turns it into selects. Jit-safe."""
    new_leaves, new_def = jax.tree_util.tree_flatten(new)
    old_leaves = jax.tree_util.tree_leaves(old)
    if not new_leaves:
        return new
    for k, (n, o) in enumerate(zip(new_leaves, old_leaves)):
        if jnp.shape(n) != jnp.shape(o) or jnp.result_type(n) != jnp.result_type(o):
            path = leaves_with_paths(new, "state")[k][0]  # (names only on this error path)
            raise GuardConfigError(
                f"[jaxsane] guard(on_nonfinite='skip') keeps the old state when a step fails, so the step must "
                f"return its state with the same shapes and dtypes; {path} comes in as "
                f"{jnp.result_type(o)}{list(jnp.shape(o))} and goes out as {jnp.result_type(n)}{list(jnp.shape(n))}. "
                f"Cast it back in the step (a dtype change is usually a bug), or use on_nonfinite='raise'.")
    chosen = jax.lax.cond(ok, lambda n, o: list(n), lambda n, o: list(o), new_leaves, old_leaves)
    return jax.tree_util.tree_unflatten(new_def, chosen)


def _select_state(ok: jax.Array, out: Any, state_in: Any) -> Any:
    """Replace the state part of a step's output by ``state_in`` when ``ok`` is False. Jit-safe."""
    if state_in is None:
        return out
    if isinstance(out, tuple) and len(out) >= 1 and same_structure(out[0], state_in):
        return (_select(ok, out[0], state_in), *out[1:])
    if same_structure(out, state_in):
        return _select(ok, out, state_in)
    raise GuardConfigError("[jaxsane] guard(on_nonfinite='skip') needs a step that returns its new state (or "
                           "(state, metrics)) with the same structure as its first argument; use "
                           "on_nonfinite='raise' for steps that return something else.")


def _traced_failure(ref, names, flags) -> None:
    self = ref()
    flags = np.asarray(flags)
    if self is None or flags.all():
        return
    _, in_names, out_names = names
    all_names = [p for p, _ in in_names] + [p for p, _ in out_names]
    flat = flags.reshape(-1, flags.shape[-1]).all(axis=0) if flags.ndim > 1 else flags
    bad = [all_names[i] if i < len(all_names) else f"leaf {i}" for i in np.flatnonzero(~flat)]
    code = "nonfinite.input" if any(i < len(in_names) for i in np.flatnonzero(~flat)) else "nonfinite.forward"
    where = "" if flags.ndim == 1 else f" (batch index {np.flatnonzero(~flags.reshape(-1, flags.shape[-1]).all(-1)).tolist()} under vmap)"
    finding = Finding(code, f"a guarded step traced under jit/vmap produced NaN/Inf in {_some(bad)}{where}",
                      _FIX[code], path=bad[0] if bad else None, extra={"paths": bad, "traced": True})
    self.failures.append(finding)
    if self.on_nonfinite == "raise":
        raise NonFiniteError(f"[jaxsane] {finding}", finding)
    if self.on_nonfinite == "warn":
        warnings.warn(f"[jaxsane] {finding}", JaxsaneWarning)
    else:
        self.skipped += 1


def _try_locate(step: Callable, call: _Call):
    """Run jaxsane.locate on the failing step's inputs, off the hot path; None if unavailable or it fails.

    NNX objects are rebuilt from their input state (``nnx.merge``), so locate sees the step exactly
    as it was called, before the in-place update.
    """
    try:
        from ._locate import locate
    except ImportError:
        return None
    args = list(call.args())
    if call.positions:
        objs = _nnx().merge(call.graphdef, jax.tree_util.tree_unflatten(call.nnx_in[1], call.nnx_in[0]))
        for p, obj in zip(call.positions, objs):
            args[p] = obj
    try:
        return locate(step, *args, **call.kwargs)
    except Exception as e:  # locate must never hide the original failure
        warnings.warn(f"[jaxsane] locate failed on the failing step's inputs: {type(e).__name__}: {e}",
                      JaxsaneWarning)
        return None


def _flush_at_exit(ref) -> None:
    self = ref()
    if self is None or not self._pending:
        return
    try:
        self._poll(block=True)
    except NonFiniteError as e:
        warnings.warn(f"{e}\n(reported at exit: the failing step was the last one called)", JaxsaneWarning)
    except Exception:
        pass


def guard(step: Callable, *, on_nonfinite: str = "raise", dump_dir: str | None = None,
          max_consecutive_skips: int = 10, max_lag: int = 2, keep_inputs: bool = True, sync: bool = False,
          locate: bool = True, check_replicas: bool | int = False) -> Guarded:
    """Wrap a train step so NaN/Inf in any output (or input) leaf is caught at the step it happens.

    The wrapped step has the same signature and outputs. It works on plain, ``jax.jit``-ed and
    ``nnx.jit``-ed steps and composes with ``jax.jit``/``jax.vmap`` applied outside (there a
    host callback reports failures). It compiles once.

    Args:
      step: the train step, e.g. ``(state, batch) -> (state, metrics)`` or an NNX step.
      on_nonfinite: ``"raise"`` raises :class:`NonFiniteError`; ``"skip"`` returns the failing step's
        input state bitwise (one ``lax.cond`` inside the compiled step; on failure the step is replayed once,
        same compiled program, to name the leaves) and counts it; ``"warn"`` warns. The words mean what they
        mean in :func:`jaxsane.fit` (``_validate.NONFINITE_POLICIES``).
      dump_dir: if set, the failing step's exact inputs are written there (``.npz`` + JSON, no
        pickle) and can be read back with :func:`jaxsane.load_dump`.
      max_consecutive_skips: with ``"skip"``, raise after this many failing steps in a row.
      max_lag: how many calls a failure may be reported late before the host waits for the flags.
        Healthy steps never block unless the host runs more than ``max_lag`` steps ahead.
      keep_inputs: keep references to the inputs of steps whose flags are not yet read, so the
        failing step's inputs can be dumped and located (also when the step donates its buffers;
        the donation is then not applied). ``False`` restores donation and keeps nothing.
      sync: wait for each step's flags before returning, so the failing call itself raises.
      locate: run :func:`jaxsane.locate` on the failing inputs (off the hot path) to name the origin.
        Not under ``jax.distributed`` (it would run the step's collectives on one process): replay the
        dump in one process instead.
      check_replicas: also check, inside the compiled step, that every copy of the new state's replicated
        leaves (a sharding that puts the same index on several devices) is bitwise identical across
        devices and processes: one checksum per leaf and device and one small all-gather of them per
        step. A divergence is reported as ``dist.replica_divergence`` (raises
        :class:`jaxsane.ReplicaDivergenceError` with ``"raise"``, warns otherwise). An int ``N``
        checks every N-th step only (the checksums cost about one pass over the replicated state).

    Sharded steps: inputs and outputs keep their shardings. On a failure with sharded leaves the
    failing leaves' shards are inspected (failure path only) and a ``dist.nonfinite_shard`` finding
    names the devices, processes and batch rows holding the NaN/Inf. Under ``jax.distributed`` every
    process reads its flags at the same call (``max_lag`` calls late), so all processes stop at the
    same step with the same report and none is left waiting in a collective.

    Cost with many leaves: the traced checks are one reduction per chunk of up to 64 same-shaped leaves
    and (with skip) one ``lax.cond``, so the first call on a 10,000-leaf state stays a small multiple of
    the bare jit's compile (``benchmarks/guard_leaves.py``).

    Returns:
      A :class:`Guarded` callable; call ``.flush()`` after the loop to hear about the last steps.

    Raises:
      GuardConfigError: (a ``ValueError`` and ``TypeError``) an argument of the wrong type or out of
        range, at the call, naming the valid values.

    Not jit-safe to construct; the returned step may be called inside ``jit``/``vmap``.

    Example:
      >>> import jax.numpy as jnp, jaxsane
      >>> guarded = jaxsane.guard(lambda s, b: (s + b, {"loss": jnp.sum(b)}), sync=True)
      >>> state, metrics = guarded(jnp.zeros(2), jnp.ones(2))
    """
    return Guarded(step, on_nonfinite=on_nonfinite, dump_dir=dump_dir,
                   max_consecutive_skips=max_consecutive_skips, max_lag=max_lag, keep_inputs=keep_inputs,
                   sync=sync, locate=locate, check_replicas=check_replicas)
