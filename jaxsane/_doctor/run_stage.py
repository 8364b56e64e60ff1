"""The doctor's run stage: a short monitored run built from programs that are compiled once.

``fit`` runs the fused monitored step (:class:`~jaxsane.Monitor` inside :func:`jaxsane.guard`): one program
holding the step, a second gradient, the telemetry and guard's flags, which pays off over a long run. For
doctor's few steps that program costs more to compile than the steps cost to run (on XLA:CPU about three
times the step's own compile: measured 28 s against 8.6 s on a 2-layer transformer LM). So the run stage
calls the step that the step stage already compiled (the user's own jit, through the pure view; one
``jax.jit`` of the pure step when the user's step is not jitted) and measures around it with small programs,
which :func:`prepare_run` compiles in doctor's background thread while the earlier stages run:

* ``before(params, batch)``: the loss, per-leaf gradient norms and parameter norms (:func:`gradient_telemetry`,
  whose gradient the grads stage's check shares);
* ``after(state, new_state, metrics, batch)``: per-leaf update norms and whether every value is finite, on
  every step (a step that samples no telemetry drops the norms: a pass over the parameters costs less than
  compiling a second program for those steps, 0.6 s on the 1M-parameter LM's CPU);
* ``dead(params, inputs)``: dead-ReLU fractions on the Monitor's dead steps, when apply has ReLU sites.

The :class:`~jaxsane.History` is the one the fused monitored step records. A step whose values are not
finite is run once more under ``Guarded`` (``_guard/guard.py``) on the same inputs, so its finding (the code,
the paths, the located origin) is exactly guard's. Nothing here is jit-safe; the programs' bodies are.
"""

from __future__ import annotations

import concurrent.futures
import itertools
from collections.abc import Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._core.errors import NonFiniteError
from .._core.finding import Finding, ran_beside
from .._core.host_memory import Releaser
from .._core.tree import (
    PyTree,
    accumulates_gradients,
    copy_arrays,
    grouped_finite_flags,
    is_inexact,
    one_replica,
    replicated_placement,
    without_carried_infs,
)
from .._experiment.batches import count_examples, get_inputs, iter_batches, slice_examples, sliceable
from .._experiment.contract import PureExperiment
from .._guard.guard import Guarded
from .._jaxpr.compile_level import Jitted, quick_jit
from .._monitor.monitor import (
    MODE_BARE,
    MODE_FULL,
    MODE_NORMS,
    Monitor,
    check_training,
    dead_fractions,
    finite_or_minus_one,
    leaf_norms,
    relu_outputs,
)
from .._precision.underflow import has_low_precision, shadow_lost_fractions, shadow_supported
from .options import RunOptions

RELEASE_EVERY = 4
"""Steps between two looks at whether to return the host memory the run freed to the OS (``_core/host_memory.py``,
:class:`Releaser`: only once the resident memory grew): the step and the telemetry's programs free large buffers
from XLA's threads, and on the 50M-parameter LM the run's resident memory grew to 6.5 GB without this against 5.0
GB with it (the user's own run: 4.1 GB), for about 70 ms a return while the step dispatched before it runs."""


def _floats(tree: PyTree) -> list:
    return [x for x in jax.tree_util.tree_leaves(tree) if is_inexact(x)]


class RunPrograms:
    """The run stage's step and its telemetry programs, for one :class:`Monitor`. Not jit-safe to build."""

    def __init__(self, adapted: PureExperiment, monitor: Monitor, steps: int, reports_loss: bool):
        self.adapted, self.monitor = adapted, monitor
        self.step = adapted.host_step()
        # each program compiles for the steps it runs on (_jaxpr/compile_level.py): a step that reports no loss
        # takes its loss from the telemetry on every step
        sampled = sum(monitor.mode_for(i) != MODE_BARE for i in range(steps)) if reports_loss else steps
        # with gradients, the one program the grads stage also takes its reverse-mode derivatives from
        self.before = gradient_telemetry(adapted, sampled) if monitor.grads else quick_jit(self._before, runs=sampled)
        # every step's finiteness with the update norms (a bare step drops them): one compile, not two
        self.after = quick_jit(self._after, runs=steps)
        self.dead = quick_jit(self._dead, runs=sum(monitor.mode_for(i) == MODE_FULL for i in range(steps)))
        self.lost = quick_jit(self._lost, runs=sampled)
        self.shadow_ok: bool | None = None  # bf16/fp16 parameters and a step that runs upcast (decided once)
        self.dead_sites: int | None = None  # ReLU sites in apply; found by dead_count()

    @staticmethod
    def _before(params: PyTree, batch: PyTree) -> dict[str, jax.Array]:
        return {"param_norm": leaf_norms(params)}

    def _after(self, state: PyTree, new_state: PyTree, metrics: Any) -> tuple[jax.Array, jax.Array]:
        before, after = _floats(self.adapted.params(state)), _floats(self.adapted.params(new_state))
        return leaf_norms([a - b for a, b in zip(after, before)]), self._finite(state, new_state, metrics)

    @staticmethod
    def _finite(state: PyTree, new_state: PyTree, metrics: Any) -> jax.Array:
        # inputs count only when an output is bad; an infinite placeholder carried from the input is no output
        return jnp.all(grouped_finite_flags((without_carried_infs(new_state, state), metrics)))

    def _lost(self, state: PyTree, new_state: PyTree, batch: PyTree) -> jax.Array:
        adapted = self.adapted
        return shadow_lost_fractions(adapted.step, adapted.params, state, batch, adapted.params(new_state))

    def measures_lost(self, state: PyTree, batch: PyTree) -> bool:
        """Whether the run measures updates lost to rounding (``_precision/underflow.py``): bf16/fp16
        parameters and a step that runs on a float32-upcast state (checked abstractly once)."""
        if self.shadow_ok is None:
            self.shadow_ok = (
                self.monitor.underflow
                and has_low_precision(self.adapted.params(state))
                and shadow_supported(self.adapted.step, state, batch, self.adapted.params)
            )
        return self.shadow_ok

    def _dead(self, params: PyTree, inputs: Any) -> jax.Array:
        apply_fn = self.adapted.apply_fn
        assert apply_fn is not None, "a Monitor samples dead ReLUs only with apply"
        return finite_or_minus_one(dead_fractions(relu_outputs(apply_fn, params, inputs)))

    def dead_count(self, params: PyTree, inputs: Any) -> int:
        """How many ReLU sites apply has (traced abstractly once, no compile)."""
        if self.dead_sites is None:
            self.dead_sites = int(jax.eval_shape(self._dead, params, inputs).shape[0])
        return self.dead_sites

    def dead_fractions(self, params: PyTree, inputs: Any) -> jax.Array:
        """Dead-ReLU fractions per site; nothing is compiled for a model without ReLU sites."""
        if self.dead_count(params, inputs) == 0:
            return jnp.zeros((0,), jnp.float32)
        return self.dead(params, inputs)


GRADIENT_TELEMETRY = "jit:gradient_telemetry"  # its name among the PureExperiment's shared functions


def gradient_telemetry(adapted: PureExperiment, runs: int) -> Jitted:
    """The run's gradient telemetry, ``(params, batch) -> {"loss", "grads", "param_norm", "grad_norm"}``: one
    compiled program per PureExperiment (compiled for about ``runs`` runs by whoever makes it first). It returns
    the whole gradient (a leaf that is not a float: a float32 zero) so that the grads stage's reverse-mode check,
    on the same examples, runs this program instead of compiling its own (a large model's telemetry and check
    take the gradient on the same examples, ``budget.few_examples``: one compile of the model's backward pass
    less, 1.2-1.7 s of a 1M-parameter LM's on a CPU). Not jit-safe to build; the program is jitted."""
    loss_fn = adapted.loss_fn
    assert loss_fn is not None, "a Monitor samples gradients only with a loss"

    def telemetry(params: PyTree, batch: PyTree) -> dict[str, Any]:
        loss, grads = jax.value_and_grad(loss_fn, allow_int=True)(params, batch)  # int leaves: float0
        grads = jax.tree_util.tree_map(lambda g, p: g if is_inexact(p) else jnp.zeros((), jnp.float32), grads, params)
        return {"loss": loss, "grads": grads, "param_norm": leaf_norms(params), "grad_norm": leaf_norms(grads)}

    return adapted.memo(GRADIENT_TELEMETRY, lambda: quick_jit(telemetry, runs=runs))


def _monitor(adapted: PureExperiment, every: int, dead_every: int, steps: int) -> Monitor:
    return Monitor(adapted, every=every, dead_every=dead_every, log_every=max(1, steps))


def _eval_loss(adapted: PureExperiment, eval_batch: Any, opts: RunOptions) -> Jitted | None:
    if eval_batch is not None and adapted.loss_fn is not None and opts.run_eval_every > 0:
        return adapted.jitted("loss")
    return None


def eval_examples(experiment: Any, eval_batch: Any, examples: int) -> Any:
    """The eval batch the run evaluates: its first ``examples`` examples (all when 0, or when the batch cannot be
    cut by examples). Cut to the train batch's size, the eval loss is the program the init stage already
    compiled. Not jit-safe."""
    if eval_batch is None or examples == 0 or sliceable(experiment, eval_batch) is not None:
        return eval_batch
    if count_examples(experiment, eval_batch) <= examples:
        return eval_batch
    return slice_examples(experiment, eval_batch, examples)


def reports_loss(adapted: PureExperiment, batch: PyTree) -> bool:
    """Whether the step's metrics hold its loss (traced abstractly: the step stage's trace, no compile); False
    when that cannot be told (then the telemetry takes every step's whole batch, which is right either way). Not
    jit-safe."""
    try:
        _, metrics = jax.eval_shape(adapted.step, adapted.example_state, batch)
    except Exception:  # the run reports the step's own failure
        return False
    return "loss" in metrics


def telemetry_batch(experiment: Any, batch: PyTree, examples: int) -> PyTree:
    """The batch the telemetry's gradient is taken on: the first ``examples`` examples of ``batch``, or the whole
    batch (``examples`` 0, a batch that cannot be cut by examples, or one no larger). Not jit-safe."""
    if not examples or sliceable(experiment, batch) is not None:
        return batch
    if count_examples(experiment, batch) <= examples:
        return batch
    return slice_examples(experiment, batch, examples)


def telemetry_examples(opts: RunOptions, reports_loss: bool) -> int:
    """:attr:`RunOptions.run_telemetry_examples`, or 0 (the whole batch) for a step that reports no loss: the run's
    loss comes from the telemetry then. Decided once per run, so every sample is taken on the same examples."""
    return opts.run_telemetry_examples if reports_loss else 0


def prepare_run(ctx: Any, pool: concurrent.futures.Executor) -> dict[str, Any]:
    """Build the run stage's programs and compile them in ``pool`` while the earlier stages run (``ctx``: the
    stage's StageContext). Returns ``{"programs": RunPrograms, "future": ...}``; what fails in the background
    is compiled again by the stage, which reports it. Not jit-safe."""
    adapted, batch, opts = ctx.adapted, ctx.batch, ctx.options
    eval_batch = eval_examples(ctx.experiment, ctx.eval_batch, opts.run_eval_examples)
    monitor = _monitor(adapted, opts.run_telemetry_every, opts.run_dead_every, opts.run_steps)
    with_loss = reports_loss(adapted, batch)
    programs = RunPrograms(adapted, monitor, opts.run_steps, with_loss)
    eval_loss = _eval_loss(adapted, eval_batch, opts)

    def compile_all() -> None:
        state = adapted.example_state
        params = adapted.params(state)
        sampled = telemetry_batch(ctx.experiment, batch, telemetry_examples(opts, with_loss))
        programs.before.lower(params, sampled).compile()
        outputs = _placed_as(jax.eval_shape(adapted.step, state, batch), state)  # traced abstractly
        programs.after.lower(*one_replica((state, *outputs))).compile()
        if programs.monitor.dead and programs.dead_count(params, get_inputs(adapted.experiment, batch)):
            programs.dead.lower(params, get_inputs(adapted.experiment, batch)).compile()
        if eval_loss is not None:
            eval_loss.lower(params, eval_batch).compile()

    return {"programs": programs, "future": pool.submit(compile_all)}


def _placed_as(outputs: PyTree, state: PyTree) -> PyTree:
    """The step's abstract outputs (``jax.eval_shape``'s, placed nowhere) replicated as ``state`` is, when it is
    replicated over a mesh: a data-parallel step returns them there, and ``after`` then runs on their replica
    (compiled ahead for one placed nowhere, it compiled again on its first call: 0.4 s of an MLP-Mixer's run).
    Outputs placed otherwise at run time compile then, as before. Not jit-safe."""
    placement = replicated_placement(state)
    if placement is None:
        return outputs

    def placed(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type, sharding=placement)
        return x

    return jax.tree_util.tree_map(placed, outputs)


def _guard_finding(
    adapted: PureExperiment, state: PyTree, batch: PyTree, step: int, metrics: Any, reports_loss: bool
) -> Finding:
    """The finding guard gives for step ``step`` on these inputs (the step runs once more under it). A step that
    reports no loss runs with Experiment.loss before it as its loss, the loss the run recorded for it."""
    step_fn = adapted.step
    if not reports_loss and adapted.loss_fn is not None:

        def step_fn(state, batch):
            loss = adapted.loss_fn(adapted.params(state), batch)  # first, as the run computed it: before the step
            new_state, out = adapted.step(state, batch)
            return new_state, {**out, "loss": loss}

    guarded = Guarded(step_fn, on_nonfinite="raise", sync=True, runs=1)  # one call: a quick compile
    guarded.step_count = step
    try:
        guarded(state, batch)
        guarded.flush()
    except NonFiniteError as e:
        return e.finding
    in_metrics = not bool(jnp.all(grouped_finite_flags(metrics)))
    return Finding(
        "nonfinite.forward" if in_metrics else "nonfinite.update",
        f"step {step} produced NaN/Inf in its {'metrics' if in_metrics else 'new state'}, but not when it "
        "ran again on the same inputs under jaxsane.guard: the step is not deterministic",
        "wrap the step in jaxsane.guard(step, dump_dir=...) in the training loop to catch and dump it",
        step=step,
    )


def _placed(kept: PyTree, shardings: list) -> PyTree:
    """``kept`` (a state's copy, perhaps of one replica) with each leaf that had a committed sharding placed there
    again. Not jit-safe."""
    leaves, treedef = jax.tree_util.tree_flatten(kept)
    return jax.tree_util.tree_unflatten(
        treedef,
        [jax.device_put(x, s) if isinstance(x, jax.Array) and s is not None else x for x, s in zip(leaves, shardings)],
    )


class _Dispatched(NamedTuple):
    """One step of the run, dispatched: its inputs (``kept``: the state, a copy while the step may donate it, of
    one replica when it is replicated over a mesh), batch, outputs and the device flag of whether they are all
    finite, not yet read."""

    def inputs(self) -> PyTree:
        """The step's input state as the step took it: ``kept`` placed back where the step's inputs were."""
        return _placed(self.kept, self.shardings)

    step: int
    kept: PyTree
    shardings: list  # the sharding of each committed leaf of the step's input state: ``kept`` may be one replica
    batch: PyTree
    new_state: PyTree
    metrics: Any
    finite: jax.Array
    reports_loss: bool


class _Runner:
    """The run stage's loop state: one step dispatched after another, its metrics recorded without a sync."""

    def __init__(self, ctx: Any, programs: RunPrograms, reports_loss: bool, telemetry_examples: int):
        self.ctx, self.programs, self.adapted = ctx, programs, ctx.adapted
        self.telemetry_examples = telemetry_examples  # fixed for the run (see telemetry_examples())
        self.copy_inputs = True  # until the first step shows that the step does not donate its inputs
        self.reports_loss = reports_loss  # when not, every step runs the loss (telemetry), on the whole batch

    def dispatch(self, i: int, state: PyTree, batch: PyTree) -> _Dispatched:
        """Step ``i`` on ``state`` with its telemetry, recorded in the Monitor; nothing waits for the device."""
        programs, monitor = self.programs, self.programs.monitor
        mode = monitor.mode_for(i) if self.reports_loss else max(monitor.mode_for(i), MODE_NORMS)
        tel: dict[str, Any] = {}
        if mode != MODE_BARE:  # dispatched before the step, which may donate the state: they read it as it was
            params = self.adapted.params(state)  # (only here: the pure view costs an NNX graph walk per call)
            tel = programs.before(params, telemetry_batch(self.ctx.experiment, batch, self.telemetry_examples))
            tel.pop("grads", None)  # (shared with the grads stage's check; the run records only norms)
            if mode == MODE_FULL and monitor.dead:
                tel["dead_fraction"] = programs.dead_fractions(params, get_inputs(self.ctx.experiment, batch))
        lost = mode != MODE_BARE and programs.measures_lost(state, batch)  # reruns the user's step: the whole state
        arrays = jax.tree_util.tree_leaves(state)
        # (an uncommitted input stays uncommitted: placed on its device, a shard_map step over a mesh refuses it)
        shardings = [x.sharding if isinstance(x, jax.Array) and x.committed else None for x in arrays]
        kept, replica = self._kept(state, whole=lost)
        new_state, metrics = programs.step(state, batch)
        self.reports_loss = "loss" in metrics
        if self.copy_inputs:  # its inputs deleted, or the donated copies of shared ones (_experiment/donation.py)
            spared = getattr(self.adapted.memoized("traced:step"), "donates", None)
            self.copy_inputs = bool(spared) or any(x.is_deleted() for x in arrays if isinstance(x, jax.Array))
        measured = one_replica((kept, new_state, metrics))
        if replica and measured[0] is kept:  # the outputs live elsewhere than the replica kept: measure on the mesh
            measured = (_placed(kept, shardings), new_state, metrics)
        update_norm, finite = programs.after(*measured)
        if mode != MODE_BARE:
            handle_loss = tel.pop("loss", None)
            if "loss" not in metrics and handle_loss is not None:
                metrics = {**metrics, "loss": handle_loss}  # a step that reports no loss: Experiment.loss before it
            tel = {"param_norm": tel["param_norm"], "update_norm": update_norm, **tel}
            if lost:
                tel["update_lost"] = programs.lost(kept, new_state, batch)
            metrics = {**metrics, "telemetry": tel}
        return _Dispatched(i, kept, shardings, batch, new_state, metrics, finite, self.reports_loss)

    def _kept(self, state: PyTree, whole: bool) -> tuple[PyTree, bool]:
        """The step's inputs, kept, and whether that is one replica of them: a copy while the step may donate them
        (of one replica of a state replicated over a mesh, unless ``whole``: 1/8 of the copy on 8 devices), else a
        new tree of the same arrays (an NNX step replaces the values of the state's Variables in place, the arrays
        themselves never change)."""
        if not self.copy_inputs:
            return jax.tree_util.tree_map(lambda x: x, state), False
        local = state if whole else one_replica(state)
        return copy_arrays(local), local is not state


def run_stage(ctx: Any) -> Iterable[Finding]:
    """doctor stage: a short monitored, guarded run on the train data (:class:`RunOptions`).

    NaNs are caught (and located); the dynamics are judged by :func:`check_training` on the
    recorded history, stored in ``artifacts["run"]`` (``History.to_dict()``) for the report.
    Evaluations use the first eval batch, when the Experiment has ``eval`` and ``loss``.

    The host reads step ``i``'s finiteness only once step ``i + 1`` is dispatched, so the host's work for a
    step (the pure view, the telemetry calls) overlaps the device's: a loop that waited for every step ran the
    10M-parameter LM's steps about 20% slower than the user's own loop. A step after a non-finite one has run
    but is neither recorded nor evaluated: the history is the one a step-by-step loop records.
    """
    opts: RunOptions = ctx.options
    adapted = ctx.adapted
    programs = ctx.prepared.get("programs")
    with_loss = reports_loss(adapted, ctx.batch)
    if programs is None:
        monitor = _monitor(adapted, opts.run_telemetry_every, opts.run_dead_every, opts.run_steps)
        programs = RunPrograms(adapted, monitor, opts.run_steps, with_loss)
    else:  # wait for the background compile, never compile the same program twice at once
        ctx.prepared["future"].exception()  # helps with the queued work meanwhile (BackgroundPool)
    monitor = programs.monitor
    eval_batch = eval_examples(ctx.experiment, ctx.eval_batch, opts.run_eval_examples)
    eval_loss = _eval_loss(adapted, eval_batch, opts)
    state = adapted.init(ctx.key)
    findings: list[Finding] = []
    failed = False
    if eval_loss is not None:
        monitor.record_eval(0, float(eval_loss(adapted.params(state), eval_batch)))
    runner = _Runner(ctx, programs, with_loss, telemetry_examples(opts, with_loss))
    previous: _Dispatched | None = None
    release = Releaser()
    for batch in itertools.chain(iter_batches(ctx.experiment.train, opts.run_steps), [None]):  # None: the last flag
        evaluated, eval_error = None, None
        if previous is not None and eval_loss is not None and (previous.step + 1) % opts.run_eval_every == 0:
            try:  # the state after the previous step, evaluated before the next step may donate it
                evaluated = eval_loss(adapted.params(state), eval_batch)
            except Exception as e:  # reported once that step's own finiteness is known (a NaN state comes first)
                eval_error = e
        try:
            current = None if batch is None else runner.dispatch(previous.step + 1 if previous else 0, state, batch)
        except Exception:
            if previous is None or bool(previous.finite):
                raise
            current = None  # a step on the non-finite state of the one before failed: that one is the finding
        if previous is not None:
            if not bool(previous.finite):  # recorded, so the report marks it; guard names it
                p = previous
                findings.append(_guard_finding(adapted, p.inputs(), p.batch, p.step, p.metrics, p.reports_loss))
                failed = True
                break
            if eval_error is not None:
                raise eval_error
            if evaluated is not None:
                monitor.record_eval(previous.step + 1, float(evaluated))
        if current is not None:
            monitor.record(current.step, current.metrics, current.kept, current.batch)
            state, previous = current.new_state, current
            if current.step % RELEASE_EVERY == RELEASE_EVERY - 1:
                release()
    history = monitor.pull()
    ctx.artifacts["run"] = history.to_dict()
    if not failed:  # after a NaN the dynamics are moot: the NaN is the story
        thresholds: dict[str, Any] = opts.run_thresholds  # keys checked against check_training's by check_options
        findings.extend(_between_updates(check_training(history, **thresholds), adapted.example_state))
    return [ran_beside(f) for f in findings]  # the run ran, whatever it could not judge


def _between_updates(findings: list[Finding], state: PyTree) -> list[Finding]:
    """``findings`` less a zero update ratio of a state that accumulates gradients (``optax.MultiSteps``): its
    parameters move once every k steps, and telemetry sampled every few steps can fall between two updates every
    time (check_training already leaves out the samples that moved nothing when some did). Not jit-safe."""
    if not accumulates_gradients(state):
        return findings
    return [f for f in findings if not (f.code == "train.update_ratio" and (f.extra or {}).get("ratio") == 0.0)]
