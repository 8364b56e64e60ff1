"""guard's host side (:class:`HostSide`, a component that :class:`jaxsane.Guarded` builds and delegates to):
the reading of a dispatched step's flags once they are ready and, on a failure, which leaves went non-finite
and their names, the shards that hold them, locate's origin, the dump, and raise/skip/warn (what guard knows
of the failure is ``failure.py``); plus the callback of a step traced under an outer jit/vmap and the flush at exit.

Not jit-safe: this runs on the host, off the hot path.
"""

from __future__ import annotations

import collections
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.errors import GuardConfigError, JaxsaneWarning, NonFiniteError, ReplicaDivergenceError
from .._core.finding import Finding
from .._core.frames import user_stacklevel
from .._core.tree import host_finite_flags, leaves_with_paths, same_structure, to_host
from .._experiment.purify import Layout
from .failure import FIX, Failure, classify, nnx_records, some_paths, stop_at_origin, try_locate
from .flags import flag_chunks
from .kept import KeptCall, PendingStep
from .settings import GuardSettings


def _all_set(flags: np.ndarray) -> bool:
    """``flags.all()`` for a small bool/uint8 flag vector, without numpy's reduction overhead (~8 us)."""
    if flags.dtype.itemsize == 1:
        return b"\x00" not in flags.tobytes()
    return bool(flags.all())


def _echoes_args(out: Any, plain: tuple) -> bool:
    """True when ``out`` is ``(*new values of the first k args, metrics)``, k >= 1: the same structure, leaf
    shapes and dtypes (a function of an int returning ``(jnp.nan, y)`` echoes no state)."""
    k = len(out) - 1 if isinstance(out, tuple) else 0
    return 1 <= k <= len(plain) and all(_same_leaves(out[j], plain[j]) for j in range(k))


def _same_leaves(a: Any, b: Any) -> bool:
    if not same_structure(a, b):
        return False
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        try:
            if np.shape(x) != np.shape(y) or jnp.result_type(x) != jnp.result_type(y):
                return False
        except TypeError:  # leaves jnp cannot type (objects): the structure decides
            continue
    return True


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


def _kept_values(call: KeptCall) -> list:
    """The checked input leaves of ``call`` (the state, its first argument, is not checked on input)."""
    values = [x for i, a in enumerate(call.plain) if i > 0 or call.positions for x in jax.tree_util.tree_leaves(a)]
    return values + jax.tree_util.tree_leaves(call.kwargs)


class HostSide:
    """The host side of :class:`jaxsane.Guarded`: reading the flag vectors of dispatched steps and, on a
    failure, naming the leaves, attributing shards, locating, dumping and raising/warning/skipping.

    ``Guarded`` builds one and appends each dispatched step to its :attr:`pending`; ``replay`` is the
    guarded step's compiled body (``Guarded._run``), called again on the failure path only. Not jit-safe.
    """

    def __init__(
        self,
        settings: GuardSettings,
        *,
        step: Callable,
        arg_names: Sequence[str],
        replay: Callable[..., tuple],
        static_kw: bool,
    ):
        self.settings = settings
        self.step = step  # the wrapped step, for locate
        self.arg_names = tuple(arg_names)
        self.replay = replay
        self.static_kw = static_kw  # the step has static keyword args: no per-shard replay
        self.pending: collections.deque[PendingStep] = collections.deque()
        self.failures: list[Finding] = []
        self.skipped = 0
        self.multiprocess: bool | None = None  # jax.process_count() > 1, read at the first poll
        self._consecutive = 0
        self._last_failed_step: int | None = None

    def arg_name(self, i: int) -> str:
        """The name of the step's ``i``-th positional argument (``args[i]`` past its signature)."""
        return self.arg_names[i] if i < len(self.arg_names) else f"args[{i}]"

    def poll(self, block: bool) -> None:
        """Read the flags of the dispatched steps that are ready (all with ``block``), in order; a failure is
        handled (may raise). Not jit-safe."""
        while self.pending:
            rec = self.pending[0]
            if self.multiprocess is None:
                self.multiprocess = jax.process_count() > 1
            # Under jax.distributed every process must decide at the same call (a failure path may run
            # collectives, and a process that stops early would leave the others waiting in the next step's
            # collectives): there flags are read after exactly max_lag calls, never "when ready".
            if not block and len(self.pending) <= self.settings.max_lag:
                ready = rec.flags.is_ready  # type: ignore[attr-defined]  # (jax.Array's stub lacks is_ready)
                if self.multiprocess or not ready():
                    return
            self.pending.popleft()
            flags = np.asarray(rec.flags)
            if _all_set(flags):
                self._consecutive = 0
            else:
                self.on_failure(rec, flags)

    def refuse_breakpoint_across_processes(self) -> None:
        """JAXSANE_ON_NONFINITE=breakpoint under jax.distributed: refused at the first call, on every process
        alike (read there, not when wrapping: jax.distributed.initialize may come after guard()). Not jit-safe."""
        self.multiprocess = jax.process_count() > 1
        if self.multiprocess:
            raise GuardConfigError(
                f"[jaxsane] JAXSANE_ON_NONFINITE='breakpoint' cannot be used under jax.distributed "
                f"({jax.process_count()} processes) in jaxsane.guard: a debugger stopped on one process leaves the "
                "others waiting in the step's collectives until the job hangs. Fix: unset it (or use raise) and "
                "pass dump_dir=...; then debug the dump in one process: jaxsane replay DUMP --step module:step --pdb."
            )

    def names(self, call: KeptCall) -> tuple[list[str], list[str]]:
        """(input leaf paths, output leaf paths), in the order of the flag vector."""
        obj_names = [self.arg_name(p) for p in call.positions]
        in_paths = []
        for i, a in enumerate(call.plain):
            if i > 0 or call.positions:  # the state (first argument) is not checked on input
                in_paths += [p for p, _ in leaves_with_paths(a, self.arg_name(i))]
        in_paths += [p for p, _ in leaves_with_paths(call.kwargs)]
        out_paths = _nnx_paths(call.new_nnx_state, obj_names)
        out = call.out
        if call.positions:
            root = "metrics" if isinstance(out, (dict, tuple, list)) else "loss"
            out_paths += [p for p, _ in leaves_with_paths(out, root)]
        elif _echoes_args(out, call.plain):  # (state, metrics), or (model, opt_state, loss) for step(model, ...)
            for k, part in enumerate(out[:-1]):
                out_paths += [p for p, _ in leaves_with_paths(part, self.arg_name(k))]
            out_paths += [p for p, _ in leaves_with_paths(out[-1], "metrics" if isinstance(out[-1], dict) else "loss")]
        else:
            # the new state: the first argument's structure, shapes and dtypes (a single array is not a train
            # state, as in locate: grad(f)(x) or a function returning jnp.nan has outputs, not an update)
            state = call.plain[0] if call.plain else None
            is_state = len(jax.tree_util.tree_leaves(state)) >= 2 and _same_leaves(out, state)
            root = self.arg_name(0) if is_state else "out"
            out_paths += [p for p, _ in leaves_with_paths(out, root)]
        return in_paths, out_paths

    def per_leaf_flags(self) -> bool:
        """Whether the compiled step returns one output flag per leaf (see ``Guarded._body``)."""
        return not self.settings.keep_inputs or jax.process_count() > 1

    # ------------------------------------------------------------------ sharded steps (see _dist)
    def _replica_failures(self, rec: PendingStep, flags: np.ndarray) -> tuple[np.ndarray, list[Finding]]:
        """Split the replica flags off the flag vector; dist.replica_divergence findings for those that failed."""
        plan, fps, state_in, names, is_nnx = rec.replica
        n = sum(len(group[1]) for group in plan)
        finite, agree = flags[: len(flags) - n], flags[len(flags) - n :]
        if agree.all():
            return finite, []
        from .._dist.replicas import plan_findings

        paths = _nnx_paths(state_in, names) if is_nnx else [p for p, _ in leaves_with_paths(state_in, names[0])]
        return finite, plan_findings(plan, fps, paths, step=rec.step)

    def _on_divergence(self, rec: PendingStep, divergence: list[Finding]) -> None:
        """check_replicas: report copies of replicated state that differ ("skip" cannot undo it: it warns)."""

        self.failures.extend(divergence)
        text = (
            f"[jaxsane] dist.replica_divergence at step {rec.step}: the new state is not the same on every "
            f"device/process\n" + "\n".join(f"  {d.message}" for d in divergence) + f"\n  fix: {divergence[0].hint}"
        )
        if self.settings.on_nonfinite != "raise":
            warnings.warn(text, JaxsaneWarning, stacklevel=user_stacklevel())
            return
        self.pending.clear()
        raise ReplicaDivergenceError(text, divergence)

    def _shard_finding(self, call: KeptCall, bad: np.ndarray, step: int, code: str) -> Finding | None:
        """dist.nonfinite_shard for a failing sharded step (failure path only), else None.

        First the failing leaves' shards are inspected; when the NaN/Inf is everywhere (spread by an
        all-reduce), the step is replayed once per batch shard to find the shard whose rows cause it.
        """
        from .._dist.shards import nonfinite_shards, replay_shards

        values = _kept_values(call) + jax.tree_util.tree_leaves((call.new_nnx_state, call.out))
        in_paths, out_paths = self.names(call)
        names = in_paths + out_paths
        found = None
        # (if the flag layout changed under us, better no attribution than a wrong one)
        if len(names) == len(values) and any(
            isinstance(values[i], jax.Array) and len(values[i].sharding.device_set) > 1 for i in bad if i < len(values)
        ):
            found = nonfinite_shards([(names[i], values[i]) for i in bad], step=step, what=code)
        if found is not None or code == "nonfinite.input" or call.positions or self.static_kw:
            return found
        statics = call.statics

        def run(plain, kwargs) -> bool:
            return _all_set(np.asarray(self.replay(None, statics, (), None, plain, kwargs, (), rest=call.rest)[2]))

        try:
            return replay_shards(run, call.plain, call.kwargs, step=step)
        except Exception as e:  # attribution must never hide the original failure
            warnings.warn(
                f"[jaxsane] per-shard replay failed: {type(e).__name__}: {e}",
                JaxsaneWarning,
                stacklevel=user_stacklevel(),
            )
            return None

    def _replay_unselected(self, rec: PendingStep, call: KeptCall) -> None:
        """policy "skip": the returned state is the old one, so the failing step is replayed once (same compiled
        program, selection off) and its outputs replace ``call.out`` for the report."""
        state = jax.tree_util.tree_unflatten(call.nnx_in[1], call.nnx_in[0]) if call.positions else None
        layout = Layout(call.graphdef, call.positions) if call.positions else None
        plan = rec.replica[0] if rec.replica is not None else ()
        try:
            call.out, call.new_nnx_state, _ = self.replay(
                layout, call.statics, call.static_kw, state, call.plain, call.kwargs, plan, skip=False, rest=call.rest
            )
            if call.rest is not None:
                call.out = call.out[0]  # (arrays, Static): the flags and names are the arrays'
            call.replayed = True
        except Exception as e:  # the report must never hide the original failure
            warnings.warn(
                f"[jaxsane] replaying the skipped step to name its non-finite leaves failed: {type(e).__name__}: {e}",
                JaxsaneWarning,
                stacklevel=user_stacklevel(),
            )

    def _leaf_flags(self, rec: PendingStep, call: KeptCall, flags: np.ndarray) -> np.ndarray:
        """Per-leaf flags in the order of :meth:`names` (failure path): the input part as computed in the step,
        the output part recomputed on the host from the kept outputs when the step returned grouped flags."""
        if self.per_leaf_flags():
            return flags
        n_in = len(_kept_values(call))
        in_flags = flags[:n_in]
        if self.settings.on_nonfinite == "skip" and in_flags.all() and not call.replayed:
            self._replay_unselected(rec, call)
        out_values = jax.tree_util.tree_leaves((call.new_nnx_state, call.out))
        out_flags = host_finite_flags(out_values)
        grouped = flags[n_in:]
        if out_flags.all() and not grouped.all():  # not reproduced (or not replayed): every leaf of a failing group
            for chunk, finite in zip(flag_chunks(out_values), grouped):
                out_flags[chunk] &= bool(finite)
        return np.concatenate([in_flags, out_flags])

    # ------------------------------------------------------------------ a failing step
    def on_failure(self, rec: PendingStep, flags: np.ndarray) -> None:
        """Failure the failing step ``rec`` (its flag vector ``flags`` has a False): name its leaves, then
        raise, warn or count a skip by the policy. Not jit-safe."""
        call = rec.call
        divergence: list[Finding] = []
        if rec.replica is not None:  # the replica flags ride at the end of the flag vector
            flags, divergence = self._replica_failures(rec, flags)
            if flags.all():
                return self._on_divergence(rec, divergence)
        if call is not None:
            flags = self._leaf_flags(rec, call, flags)
        bad = np.flatnonzero(~flags)
        failure = classify(rec.step, call, bad, self.names(call) if call is not None else ([], []))
        failure.divergence = divergence
        if call is not None:
            self._examine(failure, call, bad)
        failure.take_origin()
        if call is not None and failure.host_inputs is not None and self.settings.dump_dir:
            self._dump(failure, call, self.settings.dump_dir)
        self._act(failure)

    def _examine(self, failure: Failure, call: KeptCall, bad: np.ndarray) -> None:
        """The failing step's shards, its inputs on the host and (where it can run) locate's origin."""
        failure.shard = self._shard_finding(call, bad, failure.step, failure.code)
        if self.multiprocess:  # leaves spread over processes are gathered (the same collective everywhere)
            from .._dist.shards import gather_to_host

            failure.host_inputs = gather_to_host((call.args(), call.kwargs))
        else:
            failure.host_inputs = (to_host(call.args()), to_host(call.kwargs))
        # locate replays the step equation by equation on this host only: under jax.distributed that would
        # run the step's collectives on one process, so it is left to a single-process replay of the dump.
        if self.settings.locate and failure.code != "nonfinite.input" and not self.multiprocess:
            failure.located = try_locate(self.step, call)

    def _dump(self, failure: Failure, call: KeptCall, dump_dir: str) -> None:
        """Write the failing step's inputs under ``dump_dir``; a failed dump becomes a warning in the message."""
        from .._dump.dump import save_dump

        assert failure.host_inputs is not None  # (checked by the caller)
        args, kwargs = failure.host_inputs
        dump_path = os.path.join(dump_dir, f"step_{failure.step:06d}")
        try:
            if not self.multiprocess or jax.process_index() == 0:  # the gathered inputs are the same everywhere
                meta = {
                    "step": failure.step,
                    "finding": {"code": failure.code, "message": failure.message, "paths": failure.paths},
                    "arg_names": [self.arg_name(i) for i in range(len(args))],
                    **nnx_records(call),
                }
                save_dump(dump_path, args, kwargs, meta=meta)
            failure.dump_path = dump_path
            failure.message += f" (inputs dumped to {dump_path})"
        except Exception as e:  # a failed dump is a warning inside the failure, never a replacement for it
            failure.dump_error = str(e)
            failure.message += (
                f" (warning: the inputs could not be dumped: {failure.dump_error}; they are still in "
                "NonFiniteError.inputs)"
            )

    def _act(self, failure: Failure) -> None:
        """Record the failure's findings, then carry out the policy: count a skip (raise past
        max_consecutive_skips), warn, or raise (after the debugger with JAXSANE_ON_NONFINITE=breakpoint)."""
        settings = self.settings
        finding = failure.finding(settings.policy)
        self.failures.append(finding)
        self.failures.extend([failure.shard] if failure.shard is not None else [])
        self.failures.extend(failure.divergence)
        consecutive = self._last_failed_step is not None and failure.step == self._last_failed_step + 1
        self._consecutive = self._consecutive + 1 if consecutive else 1
        self._last_failed_step = failure.step
        text = failure.text()
        if settings.on_nonfinite == "skip":
            self.skipped += 1
            if self._consecutive < settings.max_consecutive_skips:
                return
            text = (
                f"[jaxsane] {self._consecutive} consecutive steps skipped (max_consecutive_skips="
                f"{settings.max_consecutive_skips}); the last one:\n{text}"
            )
        elif settings.on_nonfinite == "warn":
            warnings.warn(text, JaxsaneWarning, stacklevel=user_stacklevel())
            return
        self.pending.clear()  # later steps ran on a non-finite state: the first failure is the story
        if settings.breakpoint:  # JAXSANE_ON_NONFINITE=breakpoint: stop at the origin, then raise
            stop_at_origin(text, failure.located, failure.code)
        raise NonFiniteError(
            text,
            finding,
            dump_path=failure.dump_path,
            inputs=failure.host_inputs,
            located=failure.located,
            dump_error=failure.dump_error,
        )


def traced_failure(ref, names, flags) -> None:
    """The host callback of a guarded step traced under an outer jit/vmap: report its non-finite leaves
    by the guarded step's policy (``ref``: a weak reference to its :class:`HostSide`). Not jit-safe (it runs on
    the host, through ``jax.debug.callback``)."""
    host = ref()
    flags = np.asarray(flags)
    if host is None or flags.all():
        return
    _, in_names, out_names = names
    all_names = [p for p, _ in in_names] + [p for p, _ in out_names]
    flat = flags.reshape(-1, flags.shape[-1]).all(axis=0) if flags.ndim > 1 else flags
    bad = [all_names[i] if i < len(all_names) else f"leaf {i}" for i in np.flatnonzero(~flat)]
    code = "nonfinite.input" if any(i < len(in_names) for i in np.flatnonzero(~flat)) else "nonfinite.forward"
    where = (
        ""
        if flags.ndim == 1
        else f" (batch index {np.flatnonzero(~flags.reshape(-1, flags.shape[-1]).all(-1)).tolist()} under vmap)"
    )
    finding = Finding(
        code,
        f"a guarded step traced under jit/vmap produced NaN/Inf in {some_paths(bad)}{where}",
        FIX[code],
        path=bad[0] if bad else None,
        extra={"paths": bad, "traced": True},
    )
    host.failures.append(finding)
    if host.settings.on_nonfinite == "raise":
        raise NonFiniteError(f"[jaxsane] {finding}", finding)
    if host.settings.on_nonfinite == "warn":
        warnings.warn(f"[jaxsane] {finding}", JaxsaneWarning, stacklevel=user_stacklevel())
    else:
        host.skipped += 1


def flush_at_exit(ref) -> None:
    """At interpreter exit, read the flags of a guarded step's last calls (``ref``: a weak reference to its
    :class:`HostSide`); a failure there warns. Not jit-safe."""
    host = ref()
    if host is None or not host.pending:
        return
    try:
        host.poll(block=True)
    except NonFiniteError as e:
        warnings.warn(
            f"{e}\n(reported at exit: the failing step was the last one called)",
            JaxsaneWarning,
            stacklevel=user_stacklevel(),
        )
    except Exception:
        pass
