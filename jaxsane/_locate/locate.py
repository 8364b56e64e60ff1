"""locate: find where the first non-finite value that reaches a function's outputs is born.

``jaxsane.locate(fn, *args, **kwargs)`` traces ``fn`` to a jaxpr and replays it on the real
inputs, equation by equation (the replay is a set of hooks on jaxsane's one interpreter,
``_jaxpr/interpret.py``). ``jit``, ``custom_jvp``/``custom_vjp``
and ``remat`` calls are replayed inline. The common primitives (elementwise math, reductions,
``dot_general``, shape ops, ``select_n``) run on the host with numpy, so the replay compiles
nothing; the rest run through ``bind`` (compiled once per primitive, shape and parameters, and
cached by jax). ``scan``, ``while_loop``, ``cond``/``switch`` and ``shard_map`` first run whole;
only when one of them hands a NaN/Inf towards the outputs does the interpreter descend into its
body (per loop iteration, per branch taken, per device shard under a ``vmap`` that names the
mesh axes). After the replay, a backward pass over the data flow keeps only non-finite values
that actually flow into non-finite outputs, so NaNs produced and masked away
(``jnp.where(mask, x / d, 0)``, ``-inf`` attention masks with a finite softmax) are never
reported. The origin is the first computation with finite inputs and a non-finite result (or a
NaN result from merely infinite inputs, e.g. a ``-inf`` mask giving ``-inf - -inf``) on such a
path; a NaN/Inf constant of the program that reaches the outputs (``nonfinite.literal``); or a
non-finite input (``nonfinite.input``, also when its first operation only turns its inf into NaN).
Python int and float arguments are traced as weak-typed scalars, as ``jax.jit`` does (a ``TrainState``'s
``step`` is a Python ``0`` until the first jitted step returns an array); held static when the function
needs them in Python (a shape, a branch).
``nan_causes.py`` names the cause and the fix.

When the replay is finite but the compiled program is not, the report says "not reproduced
outside XLA" and the smallest compiled prefix of the program that produces the non-finite value
is found by bisection (:func:`bisect_compiled`).

Nothing here is jit-safe: locate runs on the host, off the hot path, after a failure. On an
accelerator the replay copies the values it computes to host memory.

Here: the entry points (:func:`locate`, :func:`replay_dump`) and the XLA-only bisection. The replay
engine lives in ``replay.py``, the data-flow analysis after it in ``flow.py``,
the origins and custom_vjp backward lines in ``origins.py``, the report classes in
``result.py``, the traceback frames in ``_core/frames.py`` and the post-mortem debugger
at an origin in ``debugger.py``.
"""

from __future__ import annotations

import inspect
import os
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import core as jcore

from .._core.errors import ArgumentError
from .._core.finding import Finding
from .._core.frames import is_library_file, user_frame
from .._core.tree import is_inexact, leaves_with_paths
from .._dump.nnx import standin_message
from .._experiment.chex import chex_asserts_off, locate_target
from .._experiment.purify import (
    arrays_of,
    call_split,
    nnx_positions,
    positional_names,
    split_objects,
    uncounted,
    unwrap,
)
from .._jaxpr.compile_level import quick_jit
from .._jaxpr.interpret import closed as open_closed
from .flow import Analysis, nonfinite_counts
from .latent import as_latent, latent_candidate
from .origins import find_origins, recording_custom_vjp
from .replay import Ctx, Replay, Val, flags
from .result import LocateReport, Origin
from .screen import finite_everywhere, screen_pays

# ----------------------------------------------------------------------------- entry point


def _arg_names(fn: Callable, n: int) -> list[str]:
    names = positional_names(fn)
    return [names[i] if i < len(names) else f"args[{i}]" for i in range(n)]


SCALAR_LEVELS: tuple[tuple[type, ...], ...] = ((int, float, complex), (float, complex), ())
"""The Python scalar types traced, tried in turn: all of them, as ``jax.jit`` traces them; floats only (an int
that the function needs in Python, a shape or a loop count); none (a float it branches on)."""


def _is_traced_leaf(x: Any, scalars: tuple[type, ...] = SCALAR_LEVELS[0]) -> bool:
    """Arrays are traced; so are Python scalars of the types in ``scalars``, as weak-typed scalars, as
    ``jax.jit`` traces them (a NaN passed as ``np.nan`` is then an input, not a constant of the program).
    A ``bool`` is held static: it is a flag (``train=True``) far more often than data."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return True
    return isinstance(x, scalars) and not isinstance(x, bool)


def _trace(pure: Callable, arrays: list):
    """``(closed jaxpr, output shape)`` of ``pure`` on ``arrays``, with chex's assertions off."""
    with chex_asserts_off():
        return jax.make_jaxpr(pure, return_shape=True)(*arrays)


def _trace_call(fn: Callable, args: tuple, kwargs: dict):
    """``(closed jaxpr, output shape, traced leaves, their paths, output namer)`` of ``fn(*args, **kwargs)``,
    Python scalars traced as far as the function allows (:data:`SCALAR_LEVELS`); the last level's error is
    raised when none traces."""
    error: Exception | None = None
    tried: set[int] = set()
    for scalars in SCALAR_LEVELS:
        pure, arrays, in_paths, out_paths_of = _prepare(fn, args, kwargs, scalars)
        if len(arrays) in tried:
            continue  # no scalar of the type dropped: the trace that failed already
        tried.add(len(arrays))
        try:
            closed, out_shape = _trace(pure, arrays)
        except Exception as e:  # noqa: BLE001 - Python needs one of the scalars (a shape, a branch): hold more static
            error = e
            continue
        return closed, out_shape, arrays, in_paths, out_paths_of
    assert error is not None
    raise error


def _prepare(fn: Callable, args: tuple, kwargs: dict, scalars: tuple[type, ...] = SCALAR_LEVELS[0]):
    """A pure function of flat array leaves, the leaves, their paths and a namer for the outputs.
    ``scalars``: the Python scalar types traced too (the others are held static, as constants)."""
    names = _arg_names(fn, len(args))
    positions = nnx_positions(args)
    layout, nnx_state = split_objects(args, positions)
    plain = tuple(None if i in positions else a for i, a in enumerate(args))
    tree = (nnx_state, plain, kwargs)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    paths = [_rename(path, names, positions) for path, _ in leaves_with_paths(tree)]
    traced = [i for i, x in enumerate(leaves) if _is_traced_leaf(x, scalars)]

    def pure(*arrays):
        flat = list(leaves)
        for i, a in zip(traced, arrays):
            flat[i] = a
        state, plain_, kw = jax.tree_util.tree_unflatten(treedef, flat)
        out, new_state = call_split(uncounted(fn), layout, state, plain_, kw)
        out = arrays_of(out)  # an Equinox model in the output: its activations are not values of the program
        return (out, new_state) if positions else out

    def out_paths(out) -> list[str]:
        if positions:
            res, new_state = out
            return _named_out_paths(res, args, names, positions) + [
                _rename(p, names, positions, prefix="(state)") for p, _ in leaves_with_paths((new_state, None, None))
            ]
        return _named_out_paths(out, args, names, positions)

    return pure, [leaves[i] for i in traced], [paths[i] for i in traced], out_paths


def _rename(path: str, names: list[str], positions: Sequence[int], prefix: str = "") -> str:
    """Paths of the (nnx_state, plain, kwargs) tuple -> ``model...``, ``batch['x']``, ``kwargs['k']``."""
    if path.startswith("[0]"):
        rest = path[3:]
        k = rest[1:].split("]")[0] if rest.startswith("[") else ""
        if k.isdigit() and int(k) < len(positions):
            return names[positions[int(k)]] + rest[len(k) + 2 :]
        return "nnx_state" + rest
    if path.startswith("[1]["):
        rest = path[4:]
        k, _, tail = rest.partition("]")
        return (names[int(k)] if k.isdigit() and int(k) < len(names) else f"args[{k}]") + tail
    if path.startswith("[2]"):
        return "kwargs" + path[3:]
    return path


def _named_out_paths(out, args, names, positions) -> list[str]:
    from .._core.tree import same_structure

    plain0 = arrays_of(args[0]) if args and 0 not in positions else None
    if plain0 is not None and len(jax.tree_util.tree_leaves(plain0)) < 2:
        plain0 = None  # a single array is not a train state: name the outputs "out"
    if isinstance(out, tuple) and len(out) == 2 and plain0 is not None and same_structure(out[0], plain0):
        root = "metrics" if isinstance(out[1], dict) else "loss"
        return [p for p, _ in leaves_with_paths(out[0], names[0])] + [p for p, _ in leaves_with_paths(out[1], root)]
    if plain0 is not None and same_structure(out, plain0):
        return [p for p, _ in leaves_with_paths(out, names[0])]
    if positions and not isinstance(out, (tuple, list, dict)):
        return [p for p, _ in leaves_with_paths(out, "loss")]
    return [p for p, _ in leaves_with_paths(out, "out")]


def _run_compiled(closed, args: Sequence) -> list:
    """Run a ClosedJaxpr compiled by XLA. Tests replace this to simulate compiler-only NaNs."""
    return list(quick_jit(jcore.jaxpr_as_fun(closed))(*args))


def locate(fn: Callable, *args, **kwargs) -> LocateReport | None:
    """Find where the first non-finite value that reaches ``fn``'s outputs is born, and why.

    ``fn`` is any function of arrays and pytrees: a plain or jitted function, a whole train step
    (``grad``/``value_and_grad`` and an optax update inside), an ``nnx.jit`` step taking NNX
    objects (they are split into pure state and merged back; their new state counts as output).
    Python ``int`` and ``float`` leaves are traced as ``jax.jit`` traces them (held static where the function
    needs them in Python: a shape, a branch); other non-array leaves are held static. The inputs are not modified.

    Not jit-safe: it replays ``fn`` on the host, equation by equation (``scan``/``while``/``cond``/
    ``shard_map`` run whole and are only opened when they hand a NaN/Inf towards the outputs).

    To stop in a debugger at the origin use :func:`jaxsane.debug_origin` (same call) or
    :func:`jaxsane.post_mortem` on the report: ``locate`` takes no options of its own (no ``breakpoint=``),
    so every keyword, whatever its name, reaches ``fn``. Each origin keeps the replay's values there
    (``origin.context``) for that debugger.

    Args:
      fn: the function that produced non-finite outputs.
      *args, **kwargs: its exact inputs.

    When the compiled program's outputs are finite but the replay's are not, and every origin is in the
    backward pass (the ``jnp.where(x > 0, jnp.log(x), 0.0)`` trap: eager mode, ``jax.debug_nans`` and
    other backends or fusions give NaN gradients), the report is ``latent`` and its origins are
    ``nonfinite.latent`` warnings, with the line and the fix.

    Returns:
      None when every output is finite (compiled and replayed); else a :class:`LocateReport` whose
      ``origins[0]`` is the root cause (``.code``, ``.file``, ``.line``, ``.fix``, ``.summary()``).

    Raises:
      JaxsaneError: ``fn`` is not callable or does not trace on the given inputs.
      DumpError: an argument is an NNX object's state read from a dump without its template
        (``load_dump(path)`` without ``like=``); the message says how to rebuild the objects.

    Example:
      >>> import jax.numpy as jnp, jaxsane
      >>> report = jaxsane.locate(lambda x: jnp.log(x) * 2, jnp.zeros(3))
      >>> report.origins[0].primitive, report.origins[0].code
      ('log', 'nonfinite.forward')
    """
    return _locate(fn, args, kwargs, compiled_failed=False)


def locate_failure(fn: Callable, *args, **kwargs) -> LocateReport | None:
    """:func:`locate` for a call whose compiled outputs are known to be non-finite (a guarded step that just
    failed): the same report, without compiling the program again to tell a latent NaN. Not jit-safe."""
    return _locate(fn, args, kwargs, compiled_failed=True)


def _locate(
    fn: Callable, args: tuple, kwargs: dict, compiled_failed: bool, xla_only: bool = True
) -> LocateReport | None:
    """The body of :func:`locate`; ``compiled_failed``: the caller saw the compiled outputs non-finite;
    ``xla_only``: when the replay is finite, compile the program to look for XLA-only NaNs (else None)."""
    from .._core.errors import DumpError, JaxsaneError

    if not callable(fn):
        raise ArgumentError(f"locate needs a callable, got {type(fn).__name__}. Fix: call locate(step, *inputs).")
    message = standin_message(args)
    if message is not None:  # a dump's NNX state where the step takes the object: say how to get it back
        raise DumpError(message)
    fn = locate_target(fn)  # a chexified step: the function under chexify, traced with chex's assertions off
    try:
        closed, out_shape, arrays, in_paths, out_paths_of = _trace_call(fn, args, kwargs)
    except Exception as e:  # noqa: BLE001 - the user's function does not trace on these inputs
        raise JaxsaneError(
            f"locate could not trace {getattr(fn, '__name__', fn)!r} on the given inputs: "
            f"{type(e).__name__}: {e}. Pass exactly the inputs of the failing call; arguments "
            "that are not arrays or Python numbers are held static."
        ) from e
    out_paths = out_paths_of(out_shape)
    replay = Replay()
    # Python scalars are replayed as the weak-typed arrays the trace made of them
    arrays = [
        np.asarray(a, aval.dtype) if isinstance(a, (int, float, complex)) else a
        for a, aval in zip(arrays, closed.in_avals)
    ]
    if not (compiled_failed or xla_only) and screen_pays(closed) and _screened_finite(closed, arrays):
        return None  # every value the replay would see is finite: nothing to locate, nothing latent
    ins = [Val(a, kind="input", name=p) for a, p in zip(arrays, in_paths)]
    outs, env = replay.replay(closed.jaxpr, closed.consts, ins, Ctx())
    if len(out_paths) != len(outs):  # pragma: no cover - defensive
        out_paths = [f"out[{i}]" for i in range(len(outs))]
    if not any(v.bad for v in outs):
        return _compiled_only(closed, arrays, env, replay, out_paths) if xla_only else None
    analysis = Analysis(replay, outs, out_paths)
    analysis.retrace = lambda: _trace_custom_vjps(fn, args, kwargs)
    bad_outputs = [(p, *nonfinite_counts(v.value)) for v, p in zip(outs, out_paths) if v.bad]
    origins = find_origins(analysis)
    inputs = dict(zip(in_paths, arrays))
    for o in origins:  # for the debugger (post_mortem): the inputs by path and the call, by reference
        if o.context is not None:
            o.context.inputs, o.context.call = inputs, (fn, args, kwargs)
    if not origins and analysis.xla:
        return _xla_report(bad_outputs, _inner_prefix(analysis.xla[0][0]), replay.count)
    report = LocateReport(origins, bad_outputs, equations=replay.count)
    if not compiled_failed and latent_candidate(origins):  # a backward NaN: is the compiled program finite?
        report = as_latent(report, [v.bad for v in outs], _run_compiled(closed, arrays))
    return report


def _screened_finite(closed, arrays: list) -> bool:
    """:func:`finite_everywhere` (``screen.py``): the replay's outputs would be finite. False when the screen
    cannot run the program (the replay then decides, as without it)."""
    try:
        return finite_everywhere(closed, arrays)
    except Exception:  # noqa: BLE001 - a program the screen cannot compile: the replay judges it
        return False


def _compiled_only(closed, arrays: list, env: dict, replay: Replay, out_paths: list) -> LocateReport | None:
    """The replay is finite: None when the compiled program is too, else the XLA-only report, bisected."""
    compiled = _run_compiled(closed, arrays)
    bad = [i for i, o in enumerate(compiled) if any(flags(o))]
    if not bad:
        return None
    bad_outputs = [(out_paths[i], *nonfinite_counts(compiled[i])) for i in bad]
    target, target_env = closed, env
    while (
        len(target.jaxpr.eqns) == 1
        and target.jaxpr.eqns[0].primitive.name in ("pjit", "jit")
        and list(target.jaxpr.eqns[0].invars) == list(target.jaxpr.invars)
    ):
        inner = target.jaxpr.eqns[0].params["jaxpr"]  # a jitted function: bisect its body
        target, target_env = inner, replay.envs.get(id(inner.jaxpr), (None, {}))[1]
    return _xla_report(bad_outputs, bisect_compiled(target, arrays, env=target_env), replay.count)


def _inner_prefix(node) -> tuple[int, int, str] | None:
    """The smallest compiled prefix inside a jit/loop/branch node that the replay kept finite inside."""
    sub, consts = open_closed(node.eqn.params["jaxpr"]) if "jaxpr" in node.eqn.params else (None, [])
    pre = None
    if sub is not None and node.prim in ("pjit", "jit"):
        pre = bisect_compiled(jcore.ClosedJaxpr(sub, consts), [x.value for x in node.ins], env=node.env)
    if pre is None and node.jaxpr is not None:  # the compiled loop/branch itself is the smallest prefix
        frame = node.frame
        at = f"{os.path.basename(frame[0])}:{frame[1]}" if frame else "<unknown location>"
        pre = (node.index + 1, len(node.jaxpr.eqns), f"{node.prim} at {at}")
    return pre


def latent_nan_findings(fn: Callable, *args, **kwargs) -> list[Finding]:
    """``nonfinite.latent`` warnings for ``fn(*args, **kwargs)`` (typically ``jax.grad(loss)``): its compiled
    outputs are finite, but replayed equation by equation its gradient is not (:mod:`.latent`); each names the
    line and the fix. Empty when the replay is finite too, when the compiled outputs are non-finite (a real
    failure, for the checks that run the program to report), or when the replay cannot run the program (a
    sub-check of a stage whose own check ran: it judges nothing rather than mark the stage skipped). Not
    jit-safe (a host replay of ``fn``, and one compile when the replay is non-finite)."""
    try:  # (a finite replay cannot be latent: no compile then)
        report = _locate(fn, args, kwargs, compiled_failed=False, xla_only=False)
    except Exception:  # noqa: BLE001 - a program the replay cannot run: no judgement, never crash the caller
        return []
    return report.findings() if report is not None and report.latent else []


def replay_dump(path: str, target: Any, load: Callable | None = None, like: Any = None) -> LocateReport | None:
    """Run :func:`locate` on the inputs a guarded step dumped (``guard(..., dump_dir=...)``). Not jit-safe.

    Args:
      path: the dump directory.
      target: the step function, an :class:`~jaxsane.Experiment`, or a zero-argument callable returning
        one. For an Experiment the step runs through ``PureExperiment(experiment).step`` on the dumped
        ``(state, batch)``; a dump of an NNX step's ``(model, optimizer, batch)`` is merged back into
        the Experiment's NNX objects. A step whose dump holds NNX objects, given without ``like``, takes
        its templates from an Experiment in the step's own module (an ``Experiment`` object, or a
        zero-argument callable named ``experiment``).
      load: the dump reader (default :func:`jaxsane.load_dump`).
      like: templates of the dumped positional args (NNX objects included), or a zero-argument callable
        returning them (``jaxsane replay DUMP --step m:train_step --like m:make_objects``); args it leaves
        out at the end come from the dump's data.

    Returns:
      The :class:`LocateReport`, or None when the step's outputs are finite on the dumped inputs.

    Raises:
      DumpError: the dump is damaged, or it holds NNX objects and nothing can rebuild them (the message
        says how: ``like=``, ``--step module:experiment`` or ``--like module:make_objects``).
    """
    from .._core.errors import JaxsaneError
    from .._dump.dump import load_dump
    from .._dump.nnx import objects_error
    from .._experiment.batches import first_batch
    from .._experiment.contract import Experiment, PureExperiment

    load = load or load_dump
    exp = target if isinstance(target, Experiment) else None
    if exp is None and callable(target) and callable_without_arguments(target):
        made = call_users(target, "your --step factory")
        exp = made if isinstance(made, Experiment) else None
        if exp is None:
            raise JaxsaneError(f"{target!r}() returned a {type(made).__name__}, not an Experiment or a step.")
    if like is not None:
        templates = call_users(like, "your --like factory") if callable_without_arguments(like) else like
        dump = load(path, like=tuple(templates) if isinstance(templates, (tuple, list)) else (templates,))
        step = target if exp is None else exp.step if PureExperiment(exp).nnx else PureExperiment(exp).step
        return locate(step, *dump.args, **dump.kwargs)
    if exp is None:
        if not callable(target):
            raise JaxsaneError(f"--step must name a step function or an Experiment, got {type(target).__name__}")
        dump = load(path)
        if not dump.objects:
            return locate(target, *dump.args, **dump.kwargs)
        found = _module_experiment(target)
        if found is None:
            raise objects_error(path, dump.objects, positional_names(target))
        objs = call_users(lambda: found.init(jax.random.key(0)), "your Experiment's init")
        dump = load(path, like=tuple(objs) if isinstance(objs, (tuple, list)) else (objs,))
        return locate(target, *dump.args, **dump.kwargs)
    adapted = PureExperiment(exp)
    batch = first_batch(exp.train)
    n_args = len(load(path).args)
    if adapted.nnx:
        objs = call_users(lambda: exp.init(jax.random.key(0)), "your Experiment's init")
        objs = tuple(objs) if isinstance(objs, (tuple, list)) else (objs,)
        if n_args == len(objs) + 1:
            dump = load(path, like=objs)  # the objects from templates, the batch from the dump's data
            return locate(exp.step, *dump.args, **dump.kwargs)
    if n_args != 2:
        raise JaxsaneError(
            f"the dump at {path} holds {n_args} positional arguments; an Experiment's step "
            "replays (state, batch). Pass the step function itself with --step instead."
        )
    try:
        dump = load(path, like=(adapted.example_state, batch))
    except Exception:  # plain containers rebuild without a template
        dump = load(path)
    return locate(adapted.step, *dump.args, **dump.kwargs)


def _module_experiment(step: Callable) -> Any:
    """The Experiment in ``step``'s own module (already imported): one whose step is ``step``, else the only
    ``Experiment`` there, else what a zero-argument ``experiment()`` there returns; None when none is."""
    from .._experiment.contract import Experiment

    namespace = getattr(unwrap(step), "__globals__", None)
    if not isinstance(namespace, dict):
        return None
    found = [v for v in list(namespace.values()) if isinstance(v, Experiment)]
    mine = [e for e in found if unwrap(e.step) is unwrap(step)]
    if mine or len(found) == 1:
        return (mine or found)[0]
    make = namespace.get("experiment")
    if not found and callable(make) and callable_without_arguments(make):
        made = call_users(make, "your module's")
        return made if isinstance(made, Experiment) else None
    return None


def callable_without_arguments(fn: Any) -> bool:
    """Whether ``fn`` is a function that can be called with no arguments: every parameter has a default or is
    ``*args``/``**kwargs`` (``make_objects(seed=0)`` is a factory, not a template value). Not jit-safe."""
    if not callable(fn) or isinstance(fn, type):
        return False
    try:
        params = inspect.signature(unwrap(fn)).parameters.values()
    except (TypeError, ValueError):  # no readable signature (a builtin): not a factory we can call blind
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def call_users(fn: Callable, role: str) -> Any:
    """``fn()``, a function of the user's; when it raises, a :class:`JaxsaneError` that says so, with the
    exception's type and message and the ``file:line`` of the raising frame in the user's code. Not jit-safe."""
    from .._core.errors import JaxsaneError

    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the user's code raised: say where, in one line
        frames = traceback.extract_tb(e.__traceback__)
        frame = next((f for f in reversed(frames) if not is_library_file(f.filename)), None)
        where = f" at {frame.filename}:{frame.lineno}" if frame is not None else ""
        name = getattr(fn, "__qualname__", "")
        call = f" {name}()" if name and name != "<lambda>" else ""
        text = " ".join(str(e).split())
        raise JaxsaneError(
            f"replay: {role}{call} raised {type(e).__name__}: {text}{where}. Fix it there (it "
            "must build the objects the dump was taken from), then replay again."
        ) from e


def _trace_custom_vjps(fn: Callable, args: tuple, kwargs: dict) -> list:
    """Trace ``fn``'s Python again and record its custom_vjp calls. Jit is disabled meanwhile, so that the
    jitted functions ``fn`` calls (the user's jitted step inside a wrapper) run their Python again instead of
    taking their jaxpr from jit's trace cache. ``fn`` itself is traced first (``unwrap`` would also strip a
    ``jax.grad``, whose ``__wrapped__`` is the function it differentiates), then its unwrapped function."""
    records: list = []
    for target in (fn, unwrap(fn)):
        for scalars in SCALAR_LEVELS:
            pure, arrays, _, _ = _prepare(target, args, kwargs, scalars)
            try:
                with recording_custom_vjp(records), chex_asserts_off(), jax.disable_jit():
                    jax.make_jaxpr(pure)(*arrays)
                break
            except Exception:  # noqa: BLE001 - Python control flow on a float argument: hold it static
                records.clear()
        if records or target is unwrap(fn):
            return records
    return records


def _xla_report(bad_outputs, pre, count) -> LocateReport:
    if pre is None:
        return LocateReport([], bad_outputs, xla_only=True, equations=count)
    k, total, at = pre
    return LocateReport([], bad_outputs, xla_only=True, prefix=k, prefix_total=total, prefix_at=at, equations=count)


# ----------------------------------------------------------------------------- XLA-only bisection


def _prefix(closed, k: int):
    """The first ``k`` equations of ``closed`` as a ClosedJaxpr returning every float value they define."""
    j = closed.jaxpr
    eqns = j.eqns[:k]
    outvars = [v for e in eqns for v in e.outvars if not isinstance(v, jcore.DropVar) and is_inexact(v.aval)]
    effects = jcore.join_effects(*(e.effects for e in eqns)) if eqns else frozenset()
    pj = jcore.Jaxpr(j.constvars, j.invars, outvars, eqns, effects)
    return jcore.ClosedJaxpr(pj, closed.consts), outvars


def bisect_compiled(
    closed, args: Sequence, env: dict | None = None, run: Callable | None = None
) -> tuple[int, int, str] | None:
    """Smallest prefix of ``closed`` whose compiled run makes a value non-finite that the replay kept finite.

    Args:
      closed: the program (a ``ClosedJaxpr``).
      args: its inputs.
      env: the replay's values (``Var -> Val``); values absent from it count as finite.
      run: ``run(closed, args) -> outputs`` compiling a program (default: ``jax.jit``); tests pass
        a simulated compiler.

    Returns:
      ``(k, total, "prim at file:line")`` for the smallest such prefix of ``k`` equations, or None
      when even the whole program, with every intermediate as an output, stays finite. Not jit-safe.
    """
    run = run or _run_compiled
    env = env or {}
    n = len(closed.jaxpr.eqns)

    def bad(k: int) -> bool:
        if k == 0:
            return False
        pj, outvars = _prefix(closed, k)
        if not outvars:
            return False
        outs = run(pj, list(args))
        for v, o in zip(outvars, outs):
            ev = env.get(v)
            if any(flags(o)) and (ev is None or not ev.bad):
                return True
        return False

    if not bad(n):
        return None
    lo, hi = 0, n  # bad(lo) False, bad(hi) True
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if bad(mid):
            hi = mid
        else:
            lo = mid
    eqn = closed.jaxpr.eqns[hi - 1]
    frame = user_frame(eqn)
    where = f"{os.path.basename(frame[0])}:{frame[1]}" if frame else "<unknown location>"
    return hi, n, f"{eqn.primitive.name} at {where}"


__all__ = ["LocateReport", "Origin", "bisect_compiled", "locate", "locate_failure", "replay_dump", "user_frame"]
