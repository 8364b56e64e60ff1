"""The doctor pipeline: each stage in checklist order, as plain functions of a typed context.

A stage is ``fn(ctx: StageContext) -> Iterable[Finding]``: it calls the public ``check_*`` of its
concept with the options of its frozen options dataclass (``_doctor/options.py``) and may store
results for the report in ``ctx.artifacts``. A stage that cannot judge the program (a handle it
needs is missing) returns only ``doctor.skipped`` findings that say why. :data:`STAGES` is the
list :func:`jaxsane.doctor` runs; ``_doctor/doctor.py`` runs it and turns crashes into findings.
Nothing here is jit-safe: stages run on the host and compile what they need.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any

import jax

from .._checks.batch import check_batch_independence, check_example_slices, loss_pairs_labels
from .._checks.ignore_index import judged_ignore_index
from .._checks.init import activation_stats, check_activations
from .._checks.init_baseline import CannotCompare, check_init_loss_vs_constant, constant_loss
from .._checks.init_loss import check_init_loss, classification_of, initial_loss
from .._checks.init_sweep import init_scale_sweep, plan_init_scale_sweep
from .._checks.init_symmetry import judge_by_gradient, moving_updates, sign_step
from .._checks.sequence import (
    loss_reads_first_target,
    output_sees_own_target,
)
from .._checks.step import time_one_step, timed_check_step
from .._core.errors import DataError, DoctorOptionError, ExperimentError, JaxsaneError
from .._core.finding import Finding, ran_beside
from .._core.tree import copy_arrays
from .._data.check import check_data, judge_masked_nonfinite
from .._experiment.batches import (
    Replayable,
    count_examples,
    get_inputs,
    get_labels,
    get_mask,
    rows_not_examples,
    slice_examples,
    sliceable,
    whole_shards,
)
from .._experiment.contract import Experiment, PureExperiment
from .._jaxpr.compile_level import quick_jit
from .._monitor.train_checks import check_training
from .._overfit.overfit import plan_overfit
from .._precision.step_check import check_step_underflow
from .budget import data_seconds, sweep_seconds
from .grads_stage import grads_stage, prepare_grads
from .handles import traceable_handle
from .options import (
    OPTION_CLASSES,
    BatchOptions,
    DataOptions,
    GradsOptions,
    InitOptions,
    OverfitOptions,
    RunOptions,
    StageOptions,
    StepOptions,
)
from .run_stage import prepare_run, run_stage
from .sequence_stage import sequence_checks


@dataclasses.dataclass(frozen=True)
class StageContext:
    """What a stage gets: the experiment, its pure view, the key, the first batches and its options.

    Attributes:
      experiment: the user's :class:`~jaxsane.Experiment` (train/eval replayable from the start).
      adapted: the pure view of it (:class:`PureExperiment`); None only when ``Experiment.init`` crashed,
        in which case only stages that need no state run.
      key: the PRNG key for init and the checks.
      batch: the first train batch.
      eval_batch: the first eval batch, or None.
      options: this stage's options dataclass (e.g. :class:`RunOptions`).
      artifacts: the Diagnosis's artifacts, where a stage stores what the report draws.
      prepared: what doctor prepared ahead for this stage (see :data:`PREPARE`), e.g. the overfit plan
        and the future of its compiled sweep program; empty when nothing was.
    """

    experiment: Experiment
    adapted: PureExperiment | None
    key: jax.Array
    batch: Any
    eval_batch: Any
    options: Any
    artifacts: dict[str, Any]
    prepared: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def pure(self) -> PureExperiment:
        """``adapted``, for a stage that needs ``"state"``: the runner never runs one when init crashed."""
        assert self.adapted is not None, "a stage that needs a state ran without one"
        return self.adapted


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pipeline stage: its name, function, options dataclass and what it needs to run.

    ``needs`` lists ``"state"`` (a working ``Experiment.init``) and ``"step"`` (a step whose
    output is usable as ``(new_state, metrics)``); the runner skips a stage whose needs failed.
    Stages run while doctor compiles later stages' programs in a background thread, so a stage that
    counts compilations counts only its own thread's (``count_compilations(this_thread=True)``).
    """

    name: str
    run: Callable[[StageContext], Iterable[Finding]]
    options: type[StageOptions]
    needs: tuple[str, ...]

    @property
    def description(self) -> str:
        return self.options.description


# ----------------------------------------------------------------------------- the stages


# batches of a one-shot stream the data stage leaves cached for the later stages to replay (the run stage
# reads run_steps, 30 by default); the data stage may read thousands, which are not all kept
_KEEP_BATCHES = 100


def data_stage(ctx: StageContext) -> Iterable[Finding]:
    """doctor stage: :func:`check_data` on the experiment's train (and eval) data (:class:`DataOptions`).

    A stream is read until it ends, starts over (one epoch) or ``data_max_seconds`` run out (or
    ``data_max_batches`` when given); ``data.partial`` and the ``data`` artifact say how much was read. A
    one-shot iterator (doctor makes it :class:`Replayable`) keeps only its first batches for the later stages."""
    exp = ctx.experiment
    opts: DataOptions = ctx.options
    apply_fn = params = None
    if ctx.adapted is not None and ctx.adapted.apply_fn is not None:
        try:
            params = ctx.adapted.params(ctx.adapted.init(ctx.key))
            apply_fn = ctx.adapted.apply_fn
        except Exception:  # init problems are the init stage's to report
            apply_fn = params = None
    try:
        diagnosis = check_data(
            _read_once(exp.train),
            _read_once(exp.eval),
            num_classes=exp.num_classes,
            inputs=exp.inputs,
            labels=exp.labels,
            mask=exp.mask,
            apply=apply_fn,
            params=params,
            max_batches=opts.data_max_batches,
            max_seconds=data_seconds(opts.data_max_seconds, ctx.artifacts),
        )
    except DataError:
        why = rows_not_examples(exp, ctx.batch)
        if why is None:
            raise
        return [
            Finding(
                "doctor.skipped",
                f"data checks not run: they read one example per row, and in this batch {why} (a graph batch, "
                f"packed sequences: rows are not examples)",
                "check such data in your own pipeline tests",
            )
        ]
    ctx.artifacts["data"] = diagnosis.artifacts.get("data")
    found = [
        f
        for f in diagnosis
        if not (f.code == "data.unshifted_targets" and _shifts_inside(ctx, params, f))
        and not (f.code == "data.shape" and "broadcast" in f.message and _pairs_labels(ctx, params))
        and not (f.code == "data.shape" and "cannot be compared" in f.message and _takes_the_shapes(ctx))
    ]
    adapted = ctx.adapted
    loss_fn = adapted.loss_fn if adapted is not None else None
    if adapted is not None and loss_fn is not None and params is None:
        try:
            params = adapted.params(adapted.init(ctx.key))
        except Exception:  # init problems are the init stage's to report
            loss_fn = None
    if loss_fn is not None and params is not None:  # an ignore index the loss masks out is no finding
        found = judged_ignore_index(
            found, lambda: (traceable_handle(ctx.pure, "loss"), params, ctx.batch, get_labels(exp, ctx.batch))
        )
    held = diagnosis.artifacts.get("nonfinite_batches", {})
    return judge_masked_nonfinite(found, loss_fn, params, {what: [batch] for what, batch in held.items()}, 1)


def _read_once(data: Any) -> Any:
    """What the data stage reads of one split: a :class:`Replayable` through its bounded cache."""
    return data.reading(_KEEP_BATCHES) if isinstance(data, Replayable) else data


def _shifts_inside(ctx: StageContext, params: Any, finding: Finding) -> bool:
    """True when targets equal to the inputs are not a bug: the model shifts them right inside (Flax's
    lm1b and wmt: output t does not move when only target t changes), or the loss does (the Hugging Face
    convention: it never reads target 0, logits[:, :-1] against labels[:, 1:])."""
    adapted = ctx.adapted
    if adapted is None or "wrong way" in finding.message:
        return False
    try:
        params = adapted.params(adapted.init(ctx.key)) if params is None else params
        labels = get_labels(ctx.experiment, ctx.batch)
        inputs = get_inputs(ctx.experiment, ctx.batch)
        if adapted.apply_fn is not None:
            if output_sees_own_target(traceable_handle(adapted, "apply"), params, inputs, labels) is False:
                return True
        if adapted.loss_fn is None:
            return False
        return loss_reads_first_target(traceable_handle(adapted, "loss"), params, ctx.batch, labels, inputs) is False
    except Exception:  # the model's or loss's own problems are the later stages' to report
        return False


def _pairs_labels(ctx: StageContext, params: Any) -> bool:
    """True when shapes that would broadcast do not in the loss: it pairs each prediction with its own label
    (it reshapes the labels, or squeezes the predictions, first), so rolling the labels moves it."""
    adapted = ctx.adapted
    if adapted is None or adapted.loss_fn is None:
        return False
    try:
        params = adapted.params(adapted.init(ctx.key)) if params is None else params
        labels = get_labels(ctx.experiment, ctx.batch)
        return loss_pairs_labels(traceable_handle(adapted, "loss"), params, ctx.batch, labels) is True
    except Exception:  # the loss's own problems are the later stages' to report
        return False


def _takes_the_shapes(ctx: StageContext) -> bool:
    """True when predictions and labels that no elementwise loss could compare go through the user's loss (else
    step) as they are: the loss aligns them itself (CTC's frames against a shorter label sequence)."""
    adapted = ctx.adapted
    if adapted is None:
        return False
    try:
        state = adapted.init(ctx.key)  # the init stage's own (doctor reuses one init per key)
        if adapted.loss_fn is not None:
            jax.eval_shape(traceable_handle(adapted, "loss"), adapted.params(state), ctx.batch)
        else:
            jax.eval_shape(adapted.step, state, ctx.batch)
        return True
    except Exception:  # the shapes do not go through: the finding stands
        return False


def init_stage(ctx: StageContext) -> Iterable[Finding]:
    """doctor stage: loss at init against ln C (a C-way classifier) or the best constant prediction (any other
    loss, ``_checks/init_baseline.py``), then :func:`check_activations` on ``apply`` (:class:`InitOptions`)."""
    opts: InitOptions = ctx.options
    adapted = ctx.pure
    state = adapted.init(ctx.key)
    num_classes, why_not = classification_of(adapted, state, ctx.batch)
    loss, source = initial_loss(adapted, state, ctx.batch)
    ctx.artifacts["init_loss"] = {"loss": loss, "source": source, "num_classes": num_classes}
    findings: list[Finding] = []
    if num_classes is None:
        findings += _init_loss_vs_constant(ctx, state, loss, why_not, factor=opts.init_loss_factor)
    elif loss is None:
        findings.append(
            Finding(
                "doctor.skipped",
                "loss at init not checked: needs a loss (Experiment.loss, apply + labels, or a step reporting 'loss')",
                "",
            )
        )
    else:
        findings += check_init_loss(loss, num_classes, rtol=opts.init_loss_rtol)
    if adapted.apply_fn is None:
        findings.append(
            Finding(
                "doctor.skipped",
                "activation statistics at init not checked: they need Experiment.apply ((params, inputs) -> outputs)",
                "pass Experiment(apply=...)",
            )
        )
        return findings
    layers = activation_stats(
        traceable_handle(adapted, "apply"), adapted.params(state), get_inputs(ctx.experiment, ctx.batch)
    )
    ctx.artifacts["init_activations"] = [dataclasses.asdict(layer) for layer in layers]
    findings = [ran_beside(f) for f in findings]
    findings += check_activations(
        layers,
        scale_ratio=opts.init_scale_ratio,
        per_layer_factor=opts.init_per_layer_factor,
        max_saturated=opts.init_max_saturated,
        symmetric_tol=opts.init_symmetric_tol,
    )
    # symmetric units are stuck only when the first update moves them alike too: the loss's gradient (and after a
    # synthetic first update, where it is zero), else the step's first moving updates (of copies: a donating step
    # deletes its inputs)
    if adapted.loss_fn is None:
        updates = moving_updates(lambda s: adapted.step(copy_arrays(s), ctx.batch)[0], adapted.params, state)
        return judge_by_gradient(findings, lambda: next(updates), lambda _: next(updates))
    grad, params = quick_jit(jax.grad(adapted.loss_fn), runs=2), adapted.params(state)
    return judge_by_gradient(
        findings, lambda: grad(params, ctx.batch), lambda first: grad(sign_step(params, first), ctx.batch)
    )


def _init_loss_vs_constant(
    ctx: StageContext, state: Any, loss: float | None, why_not: str, *, factor: float
) -> list[Finding]:
    """``init.loss`` of a loss that is not a C-way cross-entropy, against the best constant prediction."""
    adapted, exp = ctx.pure, ctx.experiment
    if loss is not None and not math.isfinite(loss):
        return check_init_loss_vs_constant(loss, math.nan)
    if adapted.loss_fn is None or adapted.apply_fn is None:
        return [
            Finding(
                "doctor.skipped",
                f"loss at init not compared with chance level ln C ({why_not}), nor with "
                "the best constant prediction: that needs Experiment.loss ((params, batch) -> scalar) and "
                "Experiment.apply ((params, inputs) -> outputs)",
                "pass Experiment(loss=..., apply=...), or Experiment(num_classes=C) for a C-way classifier",
            )
        ]
    try:
        labels = get_labels(exp, ctx.batch)
    except Exception:  # an autoencoder's batch: no labels, the starts of the fit do without them
        labels = None
    try:
        base = constant_loss(
            traceable_handle(adapted, "loss"),
            traceable_handle(adapted, "apply"),
            adapted.params(state),
            ctx.batch,
            get_inputs(exp, ctx.batch),
            examples=count_examples(exp, ctx.batch),
            labels=labels,
        )
    except CannotCompare as e:
        return [
            Finding(
                "doctor.skipped",
                f"loss at init not compared with the best constant prediction: {e} (nor "
                f"with chance level ln C: {why_not})",
                "",
            )
        ]
    ctx.artifacts["init_loss"]["constant_loss"] = base.constant_loss
    if not base.constant_loss > 0:
        return [
            Finding(
                "doctor.skipped",
                f"loss at init not compared with the best constant prediction: its loss is "
                f"{base.constant_loss:.4g}, not positive, so a ratio says nothing (a log-likelihood that can "
                f"go negative, a loss unbounded below such as a flipped sign, or labels constant on this batch)",
                "",
            )
        ]
    return check_init_loss_vs_constant(base.loss, base.constant_loss, factor=factor)


def step_stage(ctx: StageContext) -> Iterable[Finding]:
    """doctor stage: :func:`check_step` on the first train batch (:class:`StepOptions`)."""
    findings, timing = timed_check_step(ctx.pure, ctx.batch, key=ctx.key, calls=ctx.options.step_calls)
    # the user's own costs on this machine: the overfit sweep's time guard
    ctx.artifacts.setdefault("user_seconds", {}).update(step=timing.fastest, first_step=timing.first)
    underflow = check_step_underflow(ctx.pure, ctx.batch, key=ctx.key, calls=ctx.options.step_calls)
    if any(f.code == "train.update_underflow" for f in underflow):  # float32 moves: not a zero update
        findings = [f for f in findings if f.code != "step.no_update"]
    return [ran_beside(f) for f in (*findings, *underflow)]  # the step ran, whatever it could not judge


def batch_stage(ctx: StageContext) -> Iterable[Finding]:
    """doctor stage: :func:`check_batch_independence` of ``Experiment.apply`` at init (:class:`BatchOptions`)."""
    adapted = ctx.pure
    findings = list(sequence_checks(ctx))
    if adapted.apply_fn is None:
        return findings + [
            Finding(
                "doctor.skipped",
                "batch independence not checked: it needs Experiment.apply ((params, inputs) -> outputs, in eval mode)",
                "pass Experiment(apply=...)",
            )
        ]
    why = rows_not_examples(ctx.experiment, ctx.batch)
    if why is not None:
        exp = ctx.experiment
        if exp.examples is not None and sliceable(exp, ctx.batch) is None:  # Experiment.examples cuts them
            state = adapted.init(ctx.key)
            try:
                return findings + check_example_slices(
                    traceable_handle(adapted, "apply"), adapted.params(state), ctx.batch, exp.examples,
                    lambda b: get_inputs(exp, b), count_examples(exp, ctx.batch), real_rows=lambda b: get_mask(exp, b),
                )  # fmt: skip
            except ExperimentError as e:  # outputs that match neither the examples nor the rows: no judgement
                return [*findings, Finding("doctor.skipped", f"batch independence not checked: {e}", "")]
        return findings + [
            Finding(
                "doctor.skipped",
                f"batch independence not checked: in this batch {why}, so outputs cannot be matched to "
                "examples row by row (a graph batch, packed sequences)",
                "pass Experiment(examples=lambda batch, n: ...) returning "
                "the first n examples, and this stage compares the outputs of cut batches",
            )
        ]
    state = adapted.init(ctx.key)
    return findings + check_batch_independence(
        traceable_handle(adapted, "apply"),
        adapted.params(state),
        get_inputs(ctx.experiment, ctx.batch),
        probes=ctx.options.batch_probes,
    )


def overfit_stage(ctx: StageContext) -> Iterable[Finding]:
    """doctor stage: the overfit sweep with small defaults, then the init-scale sweep (:class:`OverfitOptions`).

    Stores ``artifacts["overfit"]`` (an :class:`OverfitResult`) and ``artifacts["init_scales"]``
    (an ``InitScaleSweep``).
    """
    opts: OverfitOptions = ctx.options
    why_not = sliceable(ctx.experiment, ctx.batch)
    if why_not is not None:
        return [
            Finding(
                "doctor.skipped",
                f"overfit sweep not run: it fits the first {opts.overfit_batch_size} examples, and {why_not}",
                "pass Experiment(examples=lambda batch, n: ...)",
            )
        ]
    batch = slice_examples(ctx.experiment, ctx.batch, whole_shards(ctx.batch, opts.overfit_batch_size))
    sweep: dict[str, Any] = dict(
        seeds=opts.overfit_seeds,
        steps=opts.overfit_steps,
        learning_rates=opts.overfit_learning_rates,
        init_scales=opts.overfit_init_scales,
        reference_batch=ctx.batch,  # the step stage runs the user's step on it: no compile at another shape
        **_plan_limits(ctx),
    )
    precompiled: concurrent.futures.Future | None = None
    ahead = _prepared_result(ctx.prepared.get("future"))  # planned and compiled while the earlier stages ran
    if ahead is not None:
        plan, compiled = ahead
        precompiled = concurrent.futures.Future()
        precompiled.set_result(compiled)
    else:  # planned here, where what failed ahead is reported as the user's crash or a skip
        plan = plan_overfit(ctx.pure, batch, **sweep, progress=False)  # doctor shows its own progress
    retime = functools.partial(time_one_step, ctx.pure, ctx.batch, ctx.key)
    result = plan.run(precompiled=precompiled, time_limit=sweep_seconds(opts.overfit_seconds, ctx.artifacts, retime))
    ctx.artifacts["overfit"] = result
    if opts.init_scales is None:  # nothing will draw it
        return list(result.findings)
    try:
        scales = _prepared_result(ctx.prepared.get("scales"))
        ctx.artifacts["init_scales"] = (
            scales.run()
            if scales is not None
            else init_scale_sweep(ctx.pure, batch, scales=opts.init_scales, key=ctx.key, progress=False)
        )
    except JaxsaneError:
        pass  # the init-scale sweep needs a loss or apply handle; the overfit verdict stands on its own
    return list(result.findings)


def _plan_limits(ctx: StageContext) -> dict[str, Any]:
    """The overfit sweep's limits from doctor's plan (``_doctor/budget.py``): its flops, its states' memory and
    how often it checks for its early exit."""
    plan = ctx.artifacts.get("plan") or {}
    chunk = {"chunk": plan["sweep_chunk"]} if plan.get("sweep_chunk") else {}
    return dict(budget_flops=plan.get("overfit_budget_flops"), memory_bytes=plan.get("sweep_memory_bytes"), **chunk)


def _prepared_result(future: concurrent.futures.Future | None) -> Any:
    """What a background preparation made, or None when there was none or it failed (the stage then does the
    work itself, where a failure is reported)."""
    try:
        return None if future is None else future.result()
    except Exception:
        return None


def prepare_overfit(ctx: StageContext, pool: concurrent.futures.Executor) -> dict[str, Any]:
    """Plan and compile the overfit stage's sweep (the largest program doctor compiles) and its init-scale
    sweep in ``pool`` while the earlier stages run. Returns ``{"future": future of (plan, (compiled, seconds)),
    "scales": future of the compiled ScaleSweepPlan}``; when one failed, the stage does that work again itself
    and reports why. Not jit-safe."""
    opts: OverfitOptions = ctx.options
    if sliceable(ctx.experiment, ctx.batch) is not None:
        return {}
    batch = slice_examples(ctx.experiment, ctx.batch, whole_shards(ctx.batch, opts.overfit_batch_size))
    sweep: dict[str, Any] = dict(
        seeds=opts.overfit_seeds,
        steps=opts.overfit_steps,
        learning_rates=opts.overfit_learning_rates,
        init_scales=opts.overfit_init_scales,
        reference_batch=ctx.batch,  # the step stage runs the user's step on it: no compile at another shape
        **_plan_limits(ctx),
    )

    def plan_and_compile():
        plan = plan_overfit(ctx.adapted, batch, **sweep, progress=False)
        return plan, plan.compile()

    def plan_scales():
        plan = plan_init_scale_sweep(ctx.adapted, batch, scales=opts.init_scales, key=ctx.key, progress=False)
        plan.compile()
        return plan

    return {
        "future": pool.submit(plan_and_compile),
        **({"scales": pool.submit(plan_scales)} if opts.init_scales is not None else {}),
    }


# ----------------------------------------------------------------------------- the list

STAGES: tuple[Stage, ...] = (
    Stage("data", data_stage, DataOptions, needs=()),
    Stage("init", init_stage, InitOptions, needs=("state",)),
    Stage("grads", grads_stage, GradsOptions, needs=("state",)),
    Stage("step", step_stage, StepOptions, needs=("state", "step")),
    Stage("batch", batch_stage, BatchOptions, needs=("state",)),
    Stage("overfit", overfit_stage, OverfitOptions, needs=("state", "step")),
    Stage("run", run_stage, RunOptions, needs=("state", "step")),
)
# stages whose work doctor starts ahead, in the background, before the first stage runs
# (``prepare(ctx, pool) -> ctx.prepared``), in this order: the overfit sweep's compile first, the longest job (on the
# 10M LM its compile and the gradient check are each ~9 s; queued after the check, the sweep's compile was still
# running when the overfit stage came, and the stages waited for it)
PREPARE: dict[str, Callable[..., dict[str, Any]]] = {
    "overfit": prepare_overfit,
    "grads": prepare_grads,
    "run": prepare_run,
}
# the order doctor runs them in: first the stages whose work is all on the main thread, in checklist order (the step
# stage, which compiles the user's step, before the batch stage) except that the data stage runs after the step
# stage, which times the user's step (how long the data stage reads a stream: budget.data_seconds); then those
# prepared in the background in the order their work was queued, so that each finds it done while the main thread's
# own stages ran meanwhile. On the 1M-parameter LM on 2 cores: 21.3 s against 22.9 s when the grads stage, waiting
# for the gradient check, ran before the batch and overfit stages; the report lists the stages in checklist order
_MAIN_ORDER = ("init", "step", "data", "batch")
RUN_ORDER: tuple[Stage, ...] = tuple(
    sorted(
        STAGES,
        key=lambda s: (
            s.name in PREPARE,
            list(PREPARE).index(s.name) if s.name in PREPARE else _MAIN_ORDER.index(s.name),
        ),
    )
)
assert tuple(s.options for s in STAGES) == OPTION_CLASSES and all(s.name == s.options.stage for s in STAGES)


def check_options(options: dict[str, Any]) -> None:
    """Checks that need the stages' own signatures (``run_thresholds`` keys). Raises DoctorOptionError."""
    run: RunOptions = options["run"]
    known = [p for p, v in inspect.signature(check_training).parameters.items() if v.kind is v.KEYWORD_ONLY]
    unknown = [k for k in run.run_thresholds if k not in known]
    if unknown:
        raise DoctorOptionError(
            f"doctor option run_thresholds has unknown key(s) {unknown}; the thresholds of "
            f"jaxsane.check_training are {known}."
        )
