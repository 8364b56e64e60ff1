"""guard's host side: what a guarded call kept (:class:`KeptCall`, :class:`PendingStep`), the reading
of its flags once they are ready and, on a failure, the report (:class:`HostSide`, a base class of
:class:`~jaxsane._guard.guard.Guarded`): which leaves went non-finite and their names, the shards that hold them,
locate's origin, the dump, and raise/skip/warn; plus the callback of a step traced under an outer
jit/vmap and the flush at exit.

Not jit-safe: this runs on the host, off the hot path.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._core.errors import JaxsaneWarning, NonFiniteError, ReplicaDivergenceError
from .._core.finding import Finding
from .._core.frames import user_stacklevel
from .._core.tree import host_finite_flags, leaves_with_paths, same_structure, to_host
from .._experiment.chex import chex_asserts_off, locate_target
from .._experiment.purify import Layout, combine, nnx_module as _nnx
from .flags import flag_chunks

_FIX = {
    "nonfinite.input": "the batch already holds NaN/Inf: check the data pipeline (jaxsane.check_data) and "
    "drop or repair bad rows before they reach the step.",
    "nonfinite.forward": "run jaxsane.locate(step, *inputs) on the dumped inputs to find the line; typical "
    "causes are log(0), exp overflow, 0/0 in a masked mean, fp16 overflow.",
    "nonfinite.update": "the loss was finite but the new state is not: run jaxsane.locate on the dumped inputs; "
    "typical causes are a NaN gradient (double-where trap, norm at 0), fp16 Adam eps "
    "underflow, or a learning rate blow-up.",
}


def _all_set(flags: np.ndarray) -> bool:
    """``flags.all()`` for a small bool/uint8 flag vector, without numpy's reduction overhead (~8 us)."""
    if flags.dtype.itemsize == 1:
        return b"\x00" not in flags.tobytes()
    return bool(flags.all())


@dataclasses.dataclass
class PendingStep:
    """A dispatched guarded step whose flag vector is not read yet."""

    step: int
    flags: jax.Array
    call: KeptCall | None  # what the call saw, kept by reference (None with keep_inputs=False)
    replica: Any = None  # check_replicas: (plan, fingerprints, input state, root names); see _dist


@dataclasses.dataclass
class KeptCall:
    """What one guarded call saw, kept by reference until its flags are read."""

    positions: tuple
    nnx_in: Any  # (leaves, treedef) of the NNX objects' state as it came in, or None
    plain: tuple  # positional args, with NNX objects and static args replaced by None
    kwargs: dict
    new_nnx_state: Any
    out: Any
    graphdef: Any
    statics: tuple = ()  # (position, value) of static positional args
    static_kw: tuple = ()  # (name, value) of static keyword args
    replayed: bool = False  # skip: out/new_nnx_state replaced by the failing step's own (unselected) outputs
    rest: Any = None  # the args' non-array part (an _adapter.Static) when plain/kwargs/out are array parts

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

    def user_args(self) -> tuple[tuple, dict]:
        """``(args, kwargs)`` as the user passed them: :meth:`args` with an Equinox model's non-array leaves
        put back (NNX objects stay pure states)."""
        if self.rest is None:
            return self.args(), self.kwargs
        return combine((self.args(), self.kwargs), self.rest)


def _echoes_args(out: Any, plain: tuple) -> bool:
    """True when ``out`` is ``(*new values of the first k args, metrics)``, k >= 1."""
    k = len(out) - 1 if isinstance(out, tuple) else 0
    return 1 <= k <= len(plain) and all(same_structure(out[j], plain[j]) for j in range(k))


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


class HostSide:
    """The host side of :class:`~jaxsane._guard.guard.Guarded`: reading the flag vectors of dispatched steps and,
    on a failure, naming the leaves, attributing shards, locating, dumping and raising/warning/skipping.

    A base class of ``Guarded`` only: its methods use the guarded step's state (``_pending``,
    ``_arg_name``, ``_run``, the policy). Not jit-safe.
    """

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

    def _names(self, call: KeptCall) -> tuple[list[str], list[str]]:
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
        elif _echoes_args(
            out, call.plain
        ):  # (state, metrics), or (model, opt_state, loss) for step(model, opt_state, ..)
            for k, part in enumerate(out[:-1]):
                out_paths += [p for p, _ in leaves_with_paths(part, self._arg_name(k))]
            out_paths += [p for p, _ in leaves_with_paths(out[-1], "metrics" if isinstance(out[-1], dict) else "loss")]
        else:
            root = self._arg_name(0) if call.plain and same_structure(out, call.plain[0]) else "out"
            out_paths += [p for p, _ in leaves_with_paths(out, root)]
        return in_paths, out_paths

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
        if self.on_nonfinite != "raise":
            warnings.warn(text, JaxsaneWarning, stacklevel=user_stacklevel())
            return
        self._pending.clear()
        raise ReplicaDivergenceError(text, divergence)

    def _shard_finding(self, call: KeptCall, bad: np.ndarray, step: int, code: str) -> Finding | None:
        """dist.nonfinite_shard for a failing sharded step (failure path only), else None.

        First the failing leaves' shards are inspected; when the NaN/Inf is everywhere (spread by an
        all-reduce), the step is replayed once per batch shard to find the shard whose rows cause it.
        """
        from .._dist.shards import nonfinite_shards, replay_shards

        values = [x for i, a in enumerate(call.plain) if i > 0 or call.positions for x in jax.tree_util.tree_leaves(a)]
        values += jax.tree_util.tree_leaves(call.kwargs)
        values += jax.tree_util.tree_leaves((call.new_nnx_state, call.out))
        in_paths, out_paths = self._names(call)
        names = in_paths + out_paths
        found = None
        # (if the flag layout changed under us, better no attribution than a wrong one)
        if len(names) == len(values) and any(
            isinstance(values[i], jax.Array) and len(values[i].sharding.device_set) > 1 for i in bad if i < len(values)
        ):
            found = nonfinite_shards([(names[i], values[i]) for i in bad], step=step, what=code)
        if found is not None or code == "nonfinite.input" or call.positions or self._static_argnames:
            return found
        statics = call.statics

        def run(plain, kwargs) -> bool:
            return _all_set(np.asarray(self._run(None, statics, (), None, plain, kwargs, (), rest=call.rest)[2]))

        try:
            return replay_shards(run, call.plain, call.kwargs, step=step)
        except Exception as e:  # attribution must never hide the original failure
            warnings.warn(f"[jaxsane] per-shard replay failed: {type(e).__name__}: {e}", JaxsaneWarning)
            return None

    def _per_leaf_flags(self) -> bool:
        """Whether the compiled step returns one output flag per leaf (see ``_body``)."""
        return not self.keep_inputs or jax.process_count() > 1

    def _leaf_flags(self, rec: PendingStep, flags: np.ndarray) -> np.ndarray:
        """Per-leaf flags in the order of ``_names`` (failure path): the input part as computed in the step,
        the output part recomputed on the host from the kept outputs when the step returned grouped flags.
        With skip the returned state is the old one: the step is replayed once (same compiled program,
        selection off) and its outputs replace ``call.out`` for the report."""
        call = rec.call
        if self._per_leaf_flags():
            return flags
        in_values = [
            x for i, a in enumerate(call.plain) if i > 0 or call.positions for x in jax.tree_util.tree_leaves(a)
        ] + jax.tree_util.tree_leaves(call.kwargs)
        in_flags = flags[: len(in_values)]
        if self.on_nonfinite == "skip" and in_flags.all() and not call.replayed:
            state = jax.tree_util.tree_unflatten(call.nnx_in[1], call.nnx_in[0]) if call.positions else None
            layout = Layout(call.graphdef, call.positions) if call.positions else None
            plan = rec.replica[0] if rec.replica is not None else ()
            try:
                call.out, call.new_nnx_state, _ = self._run(
                    layout,
                    call.statics,
                    call.static_kw,
                    state,
                    call.plain,
                    call.kwargs,
                    plan,
                    skip=False,
                    rest=call.rest,
                )
                if call.rest is not None:
                    call.out = call.out[0]  # (arrays, Static): the flags and names are the arrays'

                call.replayed = True
            except Exception as e:  # the report must never hide the original failure
                warnings.warn(
                    f"[jaxsane] replaying the skipped step to name its non-finite leaves failed: "
                    f"{type(e).__name__}: {e}",
                    JaxsaneWarning,
                )
        out_values = jax.tree_util.tree_leaves((call.new_nnx_state, call.out))
        out_flags = host_finite_flags(out_values)
        grouped = flags[len(in_values) :]
        if out_flags.all() and not grouped.all():  # not reproduced (or not replayed): every leaf of a failing group
            for chunk, finite in zip(flag_chunks(out_values), grouped):
                out_flags[chunk] &= bool(finite)
        return np.concatenate([in_flags, out_flags])

    def _on_failure(self, rec: PendingStep, flags: np.ndarray) -> None:
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
                from .._dist.shards import gather_to_host

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
            from .._dump.dump import save_dump

            dump_path = os.path.join(self.dump_dir, f"step_{rec.step:06d}")
            try:
                if not self._multiprocess or jax.process_index() == 0:  # the gathered inputs are the same everywhere
                    save_dump(
                        dump_path,
                        host_inputs[0],
                        host_inputs[1],
                        meta={
                            "step": rec.step,
                            "finding": {"code": code, "message": message, "paths": paths},
                            "arg_names": [self._arg_name(i) for i in range(len(host_inputs[0]))],
                            **_nnx_records(call),
                        },
                    )
                message += f" (inputs dumped to {dump_path})"
            except Exception as e:  # a failed dump is a warning inside the failure, never a replacement for it
                dump_error, dump_path = str(e), None
                message += (
                    f" (warning: the inputs could not be dumped: {dump_error}; they are still in NonFiniteError.inputs)"
                )
        finding = Finding(
            code,
            message,
            hint,
            path=paths[0] if paths else None,
            step=rec.step,
            file=file,
            line=line,
            extra={
                "paths": paths,
                "policy": "breakpoint" if getattr(self, "breakpoint", False) else self.on_nonfinite,
                **({"dump": dump_path} if dump_path else {}),
                **({"dump_error": dump_error} if dump_error else {}),
                **({"nonfinite_shard": {"message": shard.message, **shard.extra}} if shard is not None else {}),
            },
        )
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
            text = (
                f"[jaxsane] {self._consecutive} consecutive steps skipped (max_consecutive_skips="
                f"{self.max_consecutive_skips}); the last one:\n{text}"
            )
        elif self.on_nonfinite == "warn":
            warnings.warn(text, JaxsaneWarning, stacklevel=user_stacklevel())
            return
        self._pending.clear()  # later steps ran on a non-finite state: the first failure is the story
        if getattr(self, "breakpoint", False):  # JAXSANE_ON_NONFINITE=breakpoint: stop at the origin, then raise
            _stop_at_origin(text, located, code)
        raise NonFiniteError(
            text, finding, dump_path=dump_path, inputs=host_inputs, located=located, dump_error=dump_error
        )


def traced_failure(ref, names, flags) -> None:
    """The host callback of a guarded step traced under an outer jit/vmap: report its non-finite leaves
    by the guarded step's policy. Not jit-safe (it runs on the host, through ``jax.debug.callback``)."""
    self = ref()
    flags = np.asarray(flags)
    if self is None or flags.all():
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
        f"a guarded step traced under jit/vmap produced NaN/Inf in {_some(bad)}{where}",
        _FIX[code],
        path=bad[0] if bad else None,
        extra={"paths": bad, "traced": True},
    )
    self.failures.append(finding)
    if self.on_nonfinite == "raise":
        raise NonFiniteError(f"[jaxsane] {finding}", finding)
    if self.on_nonfinite == "warn":
        warnings.warn(f"[jaxsane] {finding}", JaxsaneWarning)
    else:
        self.skipped += 1


def _stop_at_origin(text: str, located: Any, code: str) -> None:
    """JAXSANE_ON_NONFINITE=breakpoint: print the failure and open the debugger at its origin (or say why
    there is none: bad inputs, locate=False, a NaN only the compiled program makes). Not jit-safe."""
    from .._locate.debugger import post_mortem

    print(text, flush=True)
    if located is None:
        why = (
            "the step's inputs already hold NaN/Inf: nothing the step computed made it"
            if code == "nonfinite.input"
            else "the failing step was not located (locate=False, keep_inputs=False, or locate failed)"
        )
        print(
            f"[jaxsane] JAXSANE_ON_NONFINITE=breakpoint: no debugger opened: {why}; raising NonFiniteError.", flush=True
        )
        return
    try:
        opened = post_mortem(located)
    except Exception as e:  # noqa: BLE001 - no terminal (stdin captured, closed): the failure is still raised
        print(
            f"[jaxsane] JAXSANE_ON_NONFINITE=breakpoint: the debugger could not run ({type(e).__name__}: {e}); "
            "raising NonFiniteError.",
            flush=True,
        )
        return
    if opened:
        print("[jaxsane] leaving the debugger: raising NonFiniteError (JAXSANE_ON_NONFINITE=breakpoint).", flush=True)


def _try_locate(step: Callable, call: KeptCall):
    """Run jaxsane.locate on the failing step's inputs, off the hot path; None if unavailable or it fails.

    NNX objects are rebuilt from their input state (``nnx.merge``), so locate sees the step exactly
    as it was called, before the in-place update.
    """
    try:
        from .._locate.locate import locate
    except ImportError:
        return None
    args, kwargs = call.user_args()
    args = list(args)
    if call.positions:
        objs = _nnx().merge(call.graphdef, jax.tree_util.tree_unflatten(call.nnx_in[1], call.nnx_in[0]))
        for p, obj in zip(call.positions, objs):
            args[p] = obj
    try:
        with chex_asserts_off():  # a chexified step: replay the step under it, chex's assertions off
            return locate(locate_target(step), *args, **kwargs)
    except Exception as e:  # locate must never hide the original failure
        warnings.warn(f"[jaxsane] locate failed on the failing step's inputs: {type(e).__name__}: {e}", JaxsaneWarning)
        return None


def _nnx_records(call: KeptCall) -> dict:
    """``{"nnx": records}`` naming the NNX objects of a failing call (position, class) for its dump, or {}."""
    if not call.positions:
        return {}
    from .._dump.nnx import records_for

    try:
        objs = _nnx().merge(call.graphdef, jax.tree_util.tree_unflatten(call.nnx_in[1], call.nnx_in[0]))
    except Exception:  # the names are for messages only: never let them cost the dump
        return {"nnx": [{"arg": int(p), "class": "an NNX object"} for p in call.positions]}
    return {"nnx": records_for(call.positions, objs)}


def flush_at_exit(ref) -> None:
    """At interpreter exit, read the flags of a guarded step's last calls; a failure there warns. Not jit-safe."""
    self = ref()
    if self is None or not self._pending:
        return
    try:
        self._poll(block=True)
    except NonFiniteError as e:
        warnings.warn(f"{e}\n(reported at exit: the failing step was the last one called)", JaxsaneWarning)
    except Exception:
        pass
