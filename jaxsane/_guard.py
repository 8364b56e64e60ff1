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
import inspect
import os
import warnings
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ._errors import NonFiniteError
from ._experiment import _nnx, _unwrap
from ._findings import Finding
from ._tree import finite_flags, leaves_with_paths, same_structure, to_host

POLICIES = ("raise", "skip", "warn")

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


def _is_nnx_object(x: Any) -> bool:
    try:
        return isinstance(x, _nnx().Pytree)
    except ImportError:  # pragma: no cover
        return False


def _has_tracer(tree: Any) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree))


@dataclasses.dataclass
class _Pending:
    step: int
    flags: jax.Array
    call: "_Call | None"    # what the call saw, kept by reference (None with keep_inputs=False)


class Guarded:
    """The step returned by :func:`guard`. Call it exactly like the wrapped step.

    Attributes:
      step_count: calls made so far (the step index in findings).
      failures: the :class:`Finding` of every failing step seen so far.
      skipped: how many steps were skipped (``on_nonfinite="skip"``).
    """

    def __init__(self, step: Callable, *, on_nonfinite: str = "raise", dump_dir: str | None = None,
                 max_consecutive_skips: int = 10, max_lag: int = 2, keep_inputs: bool = True,
                 sync: bool = False, locate: bool = True):
        if not callable(step):
            raise TypeError(f"[jaxsane] guard needs a callable step, got {type(step).__name__}.")
        if on_nonfinite not in POLICIES:
            raise ValueError(f"[jaxsane] on_nonfinite must be one of {POLICIES}, got {on_nonfinite!r}.")
        if max_consecutive_skips < 1 or max_lag < 0:
            raise ValueError("[jaxsane] max_consecutive_skips must be >= 1 and max_lag >= 0.")
        functools.update_wrapper(self, step)
        self.step = step
        self.on_nonfinite = on_nonfinite
        self.dump_dir = dump_dir
        self.max_consecutive_skips = max_consecutive_skips
        self.max_lag = max_lag
        self.keep_inputs = keep_inputs
        self.sync = sync
        self.locate_on_failure = locate
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
        try:
            params = list(inspect.signature(_unwrap(step)).parameters.values())
            self._arg_names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            self._arg_names = []
        # body args: (layout, statics, static_kw, nnx_state, plain args, kwargs). A donating step keeps its
        # memory behaviour only with keep_inputs=False (then the plain args tuple is donated).
        self._compiled = jax.jit(self._body, static_argnums=(0, 1, 2), donate_argnums=(4,) if donate else ())
        atexit.register(_flush_at_exit, weakref.ref(self))

    # ------------------------------------------------------------------ naming
    def _arg_name(self, i: int) -> str:
        return self._arg_names[i] if i < len(self._arg_names) else f"args[{i}]"

    # ------------------------------------------------------------------ the compiled body
    def _body(self, layout, statics, static_kw, nnx_state, plain, kwargs):
        """Run the step and reduce inputs and outputs to one finite flag per leaf. Jit-safe."""
        in_flags = finite_flags((nnx_state, plain, kwargs))
        args = list(plain)
        for i, value in statics:
            args[i] = value
        objs = None
        if layout is not None:
            graphdef, positions = layout
            objs = _nnx().merge(graphdef, nnx_state)
            for p, obj in zip(positions, objs):
                args[p] = obj
        out = self.step(*args, **kwargs, **dict(static_kw))
        new_nnx_state = _nnx().state(objs) if objs is not None else None
        out_flags = finite_flags((new_nnx_state, out))
        ok = jnp.all(in_flags) & jnp.all(out_flags)
        if self.on_nonfinite == "skip":
            if objs is not None:
                new_nnx_state = _select(ok, new_nnx_state, nnx_state)
            else:
                out = _select_state(ok, out, args[0] if args else None)
        return out, new_nnx_state, jnp.concatenate([in_flags, out_flags])

    # ------------------------------------------------------------------ calling
    def __call__(self, *args, **kwargs):
        if _has_tracer((args, kwargs)):
            return self._traced_call(*args, **kwargs)
        self._poll(block=False)
        statics = tuple((i, args[i]) for i in self._static_argnums if i < len(args))
        static_kw = tuple((k, kwargs.pop(k)) for k in self._static_argnames if k in kwargs)
        static_pos = {i for i, _ in statics}
        positions = tuple(i for i, a in enumerate(args) if _is_nnx_object(a))
        plain = tuple(None if (i in positions or i in static_pos) else a for i, a in enumerate(args))
        layout, nnx_state, objs = None, None, ()
        if positions:
            objs = tuple(args[i] for i in positions)
            graphdef, nnx_state = _nnx().split(objs)
            layout = (graphdef, positions)
        out, new_nnx_state, flags = self._compiled(layout, statics, static_kw, nnx_state, plain, kwargs)
        if positions:
            _nnx().update(objs, new_nnx_state)
        kept = _Call(positions, nnx_state, plain, kwargs, new_nnx_state, out, args) if self.keep_inputs else None
        self._pending.append(_Pending(self.step_count, flags, kept))
        self.step_count += 1
        if self.sync:
            self._poll(block=True)
        return out

    def _traced_call(self, *args, **kwargs):
        """Under an outer jit/vmap: same checks; the host hears of failures through a callback."""
        out, _, flags = self._body(None, (), (), None, args, kwargs)
        names = ([self._arg_name(i) for i in range(len(args))], leaves_with_paths((None, args, kwargs)),
                 leaves_with_paths(out, "out"))
        jax.debug.callback(functools.partial(_traced_failure, weakref.ref(self), names), flags)
        return out

    # ------------------------------------------------------------------ host side
    def _poll(self, block: bool) -> None:
        while self._pending:
            rec = self._pending[0]
            if not block and len(self._pending) <= self.max_lag and not rec.flags.is_ready():
                return
            self._pending.popleft()
            flags = np.asarray(rec.flags)
            if flags.all():
                self._consecutive = 0
            else:
                self._on_failure(rec, flags)

    def flush(self) -> None:
        """Wait for every dispatched step's flags and handle failures (may raise). Not jit-safe."""
        self._poll(block=True)

    def _names(self, call: "_Call") -> tuple[list[str], list[str]]:
        """(input leaf paths, output leaf paths), in the order of the flag vector."""
        obj_names = [self._arg_name(p) for p in call.positions]
        in_paths = _nnx_paths(call.nnx_state, obj_names)
        for i, a in enumerate(call.plain):
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

    def _on_failure(self, rec: _Pending, flags: np.ndarray) -> None:
        call = rec.call
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
                state_names = {self._arg_name(0), *(self._arg_name(p) for p in call.positions)}
                only_state = all(p.split("[")[0].split(".")[0] in state_names for p in bad_inputs)
                message = (f"the inputs of step {rec.step} already hold NaN/Inf at {_some(bad_inputs)}"
                           + (" (the state passed in was already non-finite)" if only_state else ""))
            else:
                in_metrics = any(p.startswith(("metrics", "loss", "out")) for p in bad_outputs)
                code, paths = ("nonfinite.forward" if in_metrics else "nonfinite.update"), bad_outputs
                message = f"step {rec.step} produced NaN/Inf in {_some(bad_outputs)}"
        hint, file, line, located, host_inputs = _FIX[code], None, None, None, None
        if call is not None:
            host_inputs = (to_host(tuple(_pure_args(call.args))), to_host(call.kwargs))
            if self.locate_on_failure and code != "nonfinite.input":
                located = _try_locate(self.step, call.args, call.kwargs)
        origin = located.origins[0] if located is not None and getattr(located, "origins", None) else None
        if origin is not None:
            code = getattr(origin, "code", code)
            file, line = getattr(origin, "file", None), getattr(origin, "line", None)
            hint = getattr(origin, "fix", None) or hint
        dump_path = None
        if self.dump_dir and host_inputs is not None:
            from ._dump import save_dump
            dump_path = os.path.join(self.dump_dir, f"step_{rec.step:06d}")
            save_dump(dump_path, host_inputs[0], host_inputs[1],
                      meta={"step": rec.step, "finding": {"code": code, "message": message, "paths": paths}})
            message += f" (inputs dumped to {dump_path})"
        finding = Finding(code, message, hint, path=paths[0] if paths else None, step=rec.step, file=file,
                          line=line, extra={"paths": paths, "policy": self.on_nonfinite,
                                            **({"dump": dump_path} if dump_path else {})})
        self.failures.append(finding)
        consecutive = self._last_failed_step is not None and rec.step == self._last_failed_step + 1
        self._consecutive = self._consecutive + 1 if consecutive else 1
        self._last_failed_step = rec.step
        text = f"[jaxsane] {code} at step {rec.step}: {message}\n  fix: {hint}"
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
        raise NonFiniteError(text, finding, dump_path=dump_path, inputs=host_inputs, located=located)


@dataclasses.dataclass
class _Call:
    """What one guarded call saw, kept by reference until its flags are read."""
    positions: tuple
    nnx_state: Any
    plain: tuple
    kwargs: dict
    new_nnx_state: Any
    out: Any
    args: tuple


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


def _pure_args(args: tuple) -> list:
    """NNX objects become their pure ``nnx.State`` so that dumps hold arrays only."""
    return [_nnx().state(a) if _is_nnx_object(a) else a for a in args]


def _select(ok: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree_util.tree_map(lambda n, o: jax.lax.select(ok, n, o), new, old)


def _select_state(ok: jax.Array, out: Any, state_in: Any) -> Any:
    """Replace the state part of a step's output by ``state_in`` when ``ok`` is False. Jit-safe."""
    if state_in is None:
        return out
    if isinstance(out, tuple) and len(out) >= 1 and same_structure(out[0], state_in):
        return (_select(ok, out[0], state_in), *out[1:])
    if same_structure(out, state_in):
        return _select(ok, out, state_in)
    raise TypeError("[jaxsane] guard(on_nonfinite='skip') needs a step that returns its new state (or "
                    "(state, metrics)) with the same structure as its first argument; use on_nonfinite='raise' "
                    "for steps that return something else.")


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


def _try_locate(step: Callable, args: tuple, kwargs: dict):
    """Run jaxsane.locate on the failing inputs, off the hot path; None if unavailable or it fails."""
    try:
        from ._locate import locate
    except ImportError:
        return None
    try:
        return locate(step, *args, **kwargs)
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
          locate: bool = True) -> Guarded:
    """Wrap a train step so NaN/Inf in any output (or input) leaf is caught at the step it happens.

    The wrapped step has the same signature and outputs. It works on plain, ``jax.jit``-ed and
    ``nnx.jit``-ed steps and composes with ``jax.jit``/``jax.vmap`` applied outside (there a
    host callback reports failures). It compiles once.

    Args:
      step: the train step, e.g. ``(state, batch) -> (state, metrics)`` or an NNX step.
      on_nonfinite: ``"raise"`` raises :class:`NonFiniteError`; ``"skip"`` returns the failing step's
        input state bitwise (selected inside the compiled step) and counts it; ``"warn"`` warns.
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

    Returns:
      A :class:`Guarded` callable; call ``.flush()`` after the loop to hear about the last steps.

    Not jit-safe to construct; the returned step may be called inside ``jit``/``vmap``.

    Example:
      >>> import jax.numpy as jnp, jaxsane
      >>> guarded = jaxsane.guard(lambda s, b: (s + b, {"loss": jnp.sum(b)}), sync=True)
      >>> state, metrics = guarded(jnp.zeros(2), jnp.ones(2))
    """
    return Guarded(step, on_nonfinite=on_nonfinite, dump_dir=dump_dir,
                   max_consecutive_skips=max_consecutive_skips, max_lag=max_lag, keep_inputs=keep_inputs,
                   sync=sync, locate=locate)
