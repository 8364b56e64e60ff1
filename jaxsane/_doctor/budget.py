"""doctor's stage plan: what each stage costs on this program, measured in the user's own steps, and the
options that keep it within a budget.

The yardstick is the user's step: its flops, counted in its jaxpr (``program_cost``: matrix products and
convolutions, what dominates a model's step), on the first batch of ``B`` examples. Each stage's work is a
number of such steps: the gradient check evaluates the loss (about a third of a step) twice per checked leaf
in float64 (about twice the float32 cost on a CPU) on ``grads_batch_size`` examples; the overfit sweep runs
``configurations x steps`` steps on ``overfit_batch_size`` examples; the run stage runs ``run_steps``.

Two kinds of plan, both said in the summary (``artifacts["plan"]``) and by info findings where a check ran on
less than it would (``grad.sampled``, ``overfit.budget``):

* **per-stage rules** (always): on a step of at least :data:`LARGE_STEP_FLOPS` or a training state of at least
  :data:`LARGE_STATE_BYTES` (a model the size people train),
  the gradient check takes at most :data:`GRADS_STEPS` of the user's steps (fewer examples, sampled leaves),
  the overfit sweep at most :data:`OVERFIT_STEPS` configuration-steps' worth of flops (fewer examples, then
  fewer configurations) and the sweep's stacked states at most :data:`SWEEP_STATES` of the user's states at
  once (its configurations run in chunks), stopping within :data:`SWEEP_CHUNK` steps of a fit. Smaller programs
  run the checks in full. Deterministic: the flops are counted, not timed, so the same program gets the same
  plan, and the same verdicts, on any machine load.
* **a time budget** (``doctor(time_budget=s)``, ``jaxsane doctor --budget s``): the flops rate of this machine
  is measured on a small matrix product, each stage's seconds estimated (compiles included, from the step's
  size), and the stages reduced in turn (sweep, gradient check, run) until the estimate fits.

Options the user set are never changed. Not jit-safe (host only; it traces the step once).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._experiment.batches import count_examples, get_labels, get_mask
from .._experiment.contract import PureExperiment
from .._jaxpr.compile_level import program_cost
from .options import GradsOptions, OverfitOptions, RunOptions

LARGE_STEP_FLOPS = {"cpu": 1e9, "other": 1e12}
"""A step of at least this many flops (about 20 ms of a CPU core; a model of about a million parameters on a
thousand tokens) makes the per-stage rules apply; off the CPU 1000x more."""
LARGE_STATE_BYTES = {"cpu": 2**26, "other": 2**34}
"""... and so does a training state of at least this many bytes, whatever the step's flops: 64 MiB, about 5M float32
parameters with Adam's two moments, which the update reads and writes whole every step (tens of ms of a CPU's
memory bandwidth). A recommender's 32M-parameter embedding tables cost 0.58 GFLOP a step and 0.3 s on 2 cores;
planned as small, its overfit sweep took its 30 s floor next to the user's 17 s run. Off the CPU 16 GiB."""
GRADS_STEPS = 8.0  # the gradient check's share, in user steps
OVERFIT_STEPS = 40.0  # the sweep's share, in user steps (its early exit usually spends less)
SWEEP_TIME_STEPS = 20.0  # the sweep's time guard: its runs take at most this many of the user's steps, as timed,
MIN_SWEEP_SECONDS = 30.0  # and never less than this on a small step (sweep_time_limit)
SWEEP_COLD_SHARE = 0.4  # on a large step, this share of the user's own cold run instead (doctor's other work
# beyond the user's own is about half of it: the step stage's checks, the batch probes, the run's telemetry)
MIN_LARGE_SWEEP_SECONDS = 5.0  # and never less than this (a fast step's sweep: the host's pace is noisy below it)
COLD_RUN_STEPS = 30  # the steps of the user's own cold run (init, the first step, then these): doctor's yardstick
DATA_SECONDS = 5.0  # the data stage reads an endless stream for at most this long,
DATA_SHARE = 0.1  # and for this share of the user's own cold run when that is shorter (data_seconds),
MIN_DATA_SECONDS = 1.0  # but never less than this (a cheap stream reads hundreds of batches a second)
SWEEP_STATES = 2.0  # stacked training states the sweep holds at once, in the user's own states
SMALL_BATCH = 4  # examples a large model's gradient check, run telemetry and overfit sweep use
SEQUENCE_BATCH = 2  # the examples they use when each example holds many targets
MANY_TARGETS = 16  # targets per example (labels or mask elements) from which 2 examples are a real fit
SWEEP_CHUNK = 5  # a large model's sweep checks for its early exit every 5 steps (not 25: each step costs seconds)
TELEMETRY_SAMPLES = 4  # a large model's run samples gradient telemetry (one more forward and backward, on
# few_examples) on 4 steps: the fewest the run's checks judge (the gradient's growth compares two windows of two
# samples)
EVAL_EVERY = 10  # and evaluates every 10th step, on as many eval examples as a train batch has
MIN_LEAVES = 4  # the gradient check never samples fewer leaves
FLOAT64_FACTOR = 2.0  # float64 over float32 arithmetic on a CPU
FORWARD_SHARE = 1 / 3  # a loss evaluation's share of a training step (forward + backward + update)
COMPILE_SECONDS_PER_EQUATION = 2e-3  # a rough XLA:CPU compile rate, for time budgets only


@dataclasses.dataclass(frozen=True)
class StepCost:
    """The user's step on the first batch: flops, jaxpr size (what its compile grows with), examples, the
    bytes of one training state and the targets each example holds (0 when unknown)."""

    flops: float
    equations: int
    examples: int
    state_bytes: int
    targets_per_example: int = 0

    def steps(self, flops: float) -> float:
        """``flops`` in user steps."""
        return flops / max(self.flops, 1.0)


@dataclasses.dataclass
class StagePlan:
    """What doctor planned: per-stage options (only those it changed), the sweep's flop and memory limits, the
    lines of the summary, and each stage's estimated seconds (time budgets only)."""

    cost: StepCost | None
    changes: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    overfit_budget_flops: float | None = None
    sweep_memory_bytes: float | None = None
    sweep_chunk: int | None = None
    lines: list[str] = dataclasses.field(default_factory=list)
    estimates: dict[str, float] = dataclasses.field(default_factory=dict)
    large: bool = False

    def summary(self) -> dict[str, Any]:
        """The plan as JSON: the summary lines, the changed options, the limits and the estimates."""
        return {
            "lines": list(self.lines),
            "changes": {k: dict(v) for k, v in self.changes.items() if v},
            "overfit_budget_flops": self.overfit_budget_flops,
            "sweep_memory_bytes": self.sweep_memory_bytes,
            "sweep_chunk": self.sweep_chunk,
            "step_flops": None if self.cost is None else self.cost.flops,
            "estimates": {k: round(v, 2) for k, v in self.estimates.items()},
            "large": self.large,
        }

    def apply(self, opts: dict[str, Any]) -> dict[str, Any]:
        """``opts`` (stage -> options dataclass) with the planned changes."""
        return {
            stage: dataclasses.replace(o, **self.changes[stage]) if self.changes.get(stage) else o
            for stage, o in opts.items()
        }


def step_cost(adapted: PureExperiment, batch: Any) -> StepCost | None:
    """The :class:`StepCost` of the user's step on ``batch`` (traced, not run); None when it cannot be traced
    (the stages then report why). Not jit-safe."""
    try:
        state = adapted.example_state
        jaxpr = jax.make_jaxpr(adapted.step)(state, batch)
        cost = program_cost(jaxpr)
        try:
            examples = int(count_examples(adapted.experiment, batch))
        except Exception:  # rows are not examples (a graph batch): no per-example scaling
            examples = 0
        nbytes = sum(
            int(np.size(x)) * np.dtype(x.dtype).itemsize
            for x in jax.tree_util.tree_leaves(state)
            if hasattr(x, "dtype") and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)
        )
        return StepCost(float(cost.flops), int(cost.equations), examples, nbytes, targets_per_example(adapted, batch))
    except Exception:
        return None


def targets_per_example(adapted: PureExperiment, batch: Any) -> int:
    """How many targets one example of ``batch`` holds: the elements per example of its labels (Experiment.labels
    or a label key) or, without labels, of its padding mask (a sequence model's targets are its positions); 0 when
    neither is found. Not jit-safe."""
    exp = adapted.experiment
    for find in (get_labels, get_mask):
        try:
            leaves = [x for x in jax.tree_util.tree_leaves(find(exp, batch)) if np.ndim(x) >= 1]
        except Exception:  # no labels in this batch: try the mask
            continue
        if leaves:
            return int(max(_targets_in(x) for x in leaves))
    return 0


def _targets_in(leaf: Any) -> int:
    """Targets per example in one labels leaf: its elements per example, the last axis counted once where it is
    a distribution (one-hot or soft class labels: non-negative, summing to 1), which is one target."""
    shape = np.shape(leaf)
    n = math.prod(shape[1:])
    if len(shape) < 2 or shape[-1] < 2 or not np.issubdtype(np.dtype(leaf.dtype), np.floating):
        return n
    try:
        x = np.asarray(leaf)
    except Exception:  # not all on this host (a multi-host array): its elements, as they are
        return n
    if x.size and np.all(x >= 0) and np.allclose(x.sum(axis=-1), 1.0, atol=1e-3):
        return n // shape[-1]
    return n


def few_examples(cost: StepCost) -> int:
    """Examples a large step's overfit sweep fits, its gradient check differentiates and its run's telemetry
    samples the gradient on: :data:`SEQUENCE_BATCH` when each example holds at least :data:`MANY_TARGETS` targets
    (a sequence of tokens, a dense mask: two already hold more targets than four classifier examples), else
    :data:`SMALL_BATCH`."""
    return SEQUENCE_BATCH if cost.targets_per_example >= MANY_TARGETS else SMALL_BATCH


def flops_per_second() -> float:
    """This machine's rate on a float32 matrix product (compiled, then timed): the time budget's exchange rate."""
    n = 384
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x @ x)
    f(a).block_until_ready()
    start = time.perf_counter()
    for _ in range(5):
        f(a).block_until_ready()
    return 5 * 4 * n**3 / max(time.perf_counter() - start, 1e-6)


def _fraction(cost: StepCost, examples: int) -> float:
    """The share of the user's batch that ``examples`` are (1 when rows are not examples)."""
    return 1.0 if cost.examples <= 0 else min(1.0, examples / cost.examples)


def grads_steps(cost: StepCost, opts: GradsOptions, leaves: int) -> float:
    """The gradient check in user steps: two evaluations per leaf plus the derivatives, in float64 (also the
    bound of a float32 check, ``grads_float64=False``, which runs in float64 again only when a leaf fails)."""
    per_eval = FORWARD_SHARE * FLOAT64_FACTOR * _fraction(cost, opts.grads_batch_size)
    return per_eval * (2 * leaves + 1 + 3 / FORWARD_SHARE / 2)


def overfit_steps(cost: StepCost, opts: OverfitOptions, configs: int) -> float:
    """The overfit sweep in user steps, when no configuration exits early."""
    return configs * opts.overfit_steps * _fraction(cost, opts.overfit_batch_size)


def plan_stages(
    adapted: PureExperiment | None,
    batch: Any,
    opts: dict[str, Any],
    explicit: set[str],
    *,
    time_budget: float | None = None,
    backend: str | None = None,
    rate: float | None = None,
) -> StagePlan:
    """The :class:`StagePlan` of one doctor run (see the module docstring). ``explicit``: the option names the
    user set, which stay as given. Not jit-safe."""
    cost = step_cost(adapted, batch) if adapted is not None else None
    plan = StagePlan(cost)
    if cost is None:
        return plan
    backend = backend or jax.default_backend()
    where = "cpu" if backend == "cpu" else "other"
    plan.large = large = cost.flops >= LARGE_STEP_FLOPS[where] or cost.state_bytes >= LARGE_STATE_BYTES[where]
    if large:
        evaluates = adapted is not None and adapted.experiment.eval is not None
        has_loss = adapted is not None and adapted.loss_fn is not None
        has_apply = adapted is not None and adapted.apply_fn is not None
        _per_stage_rules(plan, cost, opts, explicit, evaluates=evaluates, has_loss=has_loss, has_apply=has_apply)
    if time_budget is not None:
        _fit_time_budget(plan, cost, opts, explicit, time_budget, rate or flops_per_second())
    return plan


def _change(plan: StagePlan, opts: dict[str, Any], explicit: set[str], stage: str, name: str, value: Any) -> bool:
    """Plan ``name = value`` unless the user set it or it already is; True when planned."""
    current = plan.changes.get(stage, {}).get(name, getattr(opts[stage], name))
    if name in explicit or current == value:
        return False
    plan.changes.setdefault(stage, {})[name] = value
    return True


def _planned(plan: StagePlan, opts: dict[str, Any], stage: str) -> Any:
    return dataclasses.replace(opts[stage], **plan.changes.get(stage, {}))


def _leaves_within(cost: StepCost, grads: GradsOptions, steps: float) -> int:
    per_leaf = grads_steps(cost, grads, 1) - grads_steps(cost, grads, 0)
    return max(MIN_LEAVES, int((steps - grads_steps(cost, grads, 0)) / per_leaf))


def _per_stage_rules(
    plan: StagePlan,
    cost: StepCost,
    opts: dict[str, Any],
    explicit: set[str],
    *,
    evaluates: bool,
    has_loss: bool,
    has_apply: bool,
) -> None:
    """The rules for a large step: the gradient check and the sweep in a fixed number of the user's steps, the
    run's telemetry sampled; ``evaluates``: the run computes eval losses (the Experiment has eval data);
    ``has_loss``: there is a gradient check (Experiment.loss); ``has_apply``: the run may sample dead ReLUs."""
    said = _grads_rules(plan, cost, opts, explicit) if has_loss else []
    overfit: OverfitOptions = opts["overfit"]
    examples = few_examples(cost)
    if cost.examples > examples and overfit.overfit_batch_size > examples:
        if _change(plan, opts, explicit, "overfit", "overfit_batch_size", examples):
            said.append(f"overfit sweep on {examples} examples")
    every = telemetry_every(_planned(plan, opts, "run").run_steps)
    if every > opts["run"].run_telemetry_every and _change(plan, opts, explicit, "run", "run_telemetry_every", every):
        said.append(f"the run's telemetry every {every} steps (its loss every step)")
    if has_loss and cost.examples > examples:  # one more forward and backward each: on the gradient check's examples
        if _change(plan, opts, explicit, "run", "run_telemetry_examples", examples):
            said.append(f"its gradient on {examples} of the batch's examples")
    dead_every = opts["run"].run_dead_every
    if has_apply and 0 < dead_every < every and _change(plan, opts, explicit, "run", "run_dead_every", every):
        said.append("dead ReLUs on the same steps")  # a dead-ReLU step samples the telemetry too
    if evaluates and cost.examples > 0 and _change(plan, opts, explicit, "run", "run_eval_examples", cost.examples):
        said.append(f"eval losses on {cost.examples} eval examples (the train batch's size)")
    if evaluates and 0 < opts["run"].run_eval_every < EVAL_EVERY:
        if _change(plan, opts, explicit, "run", "run_eval_every", EVAL_EVERY):
            said.append(f"eval losses every {EVAL_EVERY} steps")
    plan.overfit_budget_flops = OVERFIT_STEPS * cost.flops
    plan.sweep_memory_bytes = SWEEP_STATES * cost.state_bytes
    plan.sweep_chunk = SWEEP_CHUNK
    plan.lines.append(
        f"plan: the step is large ({cost.flops / 1e9:.3g} GFLOP on {cost.examples or 'its'} examples, a "
        f"{cost.state_bytes / 2**20:.0f} MiB training state), so "
        + ", ".join(
            said
            + [
                f"the sweep within {OVERFIT_STEPS:g} steps' flops and {SWEEP_STATES:g} training states at once "
                f"({cost.state_bytes / 2**20:.0f} MiB each), stopping within {SWEEP_CHUNK} steps of a fit"
            ]
        )
        + (f"; the gradient check costs about {GRADS_STEPS:g} of the user's steps" if has_loss else "")
    )


def sweep_time_limit(
    step_seconds: float | None, *, large: bool, init_seconds: float = 0.0, first_step_seconds: float = 0.0
) -> float | None:
    """The overfit sweep's time guard in seconds (None when the user's step was not timed): its runs, the retry
    with scaled updates included, take at most :data:`SWEEP_TIME_STEPS` of the user's steps and never less than
    :data:`MIN_SWEEP_SECONDS` on a small step; on a large one, :data:`SWEEP_COLD_SHARE` of the user's own cold
    run as doctor measured its parts (``init_seconds``: the first batch and the user's init;
    ``first_step_seconds``: the step's first call, its compile included; then :data:`COLD_RUN_STEPS` steps of
    ``step_seconds``), at least :data:`MIN_LARGE_SWEEP_SECONDS`, so that doctor stays within about twice the
    user's run.

    The flop plan sizes the sweep from the flops of a step on fewer examples, but a model bound by a sequential
    loop (an LSTM's time steps) or by reading its weights costs about as much a step on 2 examples as on 16: a
    7M-parameter LSTM LM on 2 cores took 490 s of sweep with no guard next to the user's 31 s cold run, and its
    ~300 steps to a fit, with a fixed 30 s guard, 54 s of doctor next to the user's 17 s on a fast day. A sweep cut
    before any fit is not judged (``overfit.budget``, ``doctor.skipped``). Not jit-safe (host arithmetic)."""
    if step_seconds is None:
        return None
    if large:
        cold = init_seconds + first_step_seconds + COLD_RUN_STEPS * step_seconds
        return max(SWEEP_COLD_SHARE * cold, MIN_LARGE_SWEEP_SECONDS)
    return max(SWEEP_TIME_STEPS * step_seconds, MIN_SWEEP_SECONDS)


def sweep_seconds(
    option: float | None, artifacts: dict[str, Any], retime: Callable[[], float | None] = lambda: None
) -> float | None:
    """The overfit sweep's time limit in doctor: ``overfit_seconds`` as set (0: none), else
    :func:`sweep_time_limit` of the user's own costs as doctor timed them (``artifacts["user_seconds"]``: its
    init, the step's first call and its fastest); None when the step was not timed. On a large step the step is
    timed once more (``retime()``), as the sweep starts: the step stage times it while doctor's background threads
    compile and check gradients beside it (a 7M LSTM LM's step: 0.89 s there, 0.36 s alone), and the faster of the
    two is the user's. Not jit-safe."""
    if option is not None:
        return float(option) or None
    timed = artifacts.get("user_seconds", {})
    large = bool((artifacts.get("plan") or {}).get("large"))
    step = timed.get("step")
    if large and step is not None:
        try:
            again = retime()
        except Exception:  # noqa: BLE001 - the step ran in the step stage; a timing is never worth a crash here
            again = None
        step = step if again is None else min(step, again)
    return sweep_time_limit(
        step, large=large, init_seconds=timed.get("init", 0.0), first_step_seconds=timed.get("first_step", 0.0)
    )


def data_seconds(option: float | None, artifacts: dict[str, Any]) -> float:
    """The data stage's time for reading each stream: ``data_max_seconds`` as set, else :data:`DATA_SECONDS`, cut on
    a program whose own cold run is short to :data:`DATA_SHARE` of it (its init, the step's first call and
    :data:`COLD_RUN_STEPS` steps, as doctor timed them; the data stage runs after the step stage), at least
    :data:`MIN_DATA_SECONDS`. A two-tower recommender whose cold run takes 7 s read its endless sampler for 3.7 s
    of doctor's 15. Not jit-safe."""
    if option is not None:
        return float(option)
    timed = artifacts.get("user_seconds", {})
    if timed.get("step") is None:
        return DATA_SECONDS
    cold = timed.get("init", 0.0) + timed.get("first_step", 0.0) + COLD_RUN_STEPS * timed["step"]
    return min(DATA_SECONDS, max(MIN_DATA_SECONDS, DATA_SHARE * cold))


def telemetry_every(run_steps: int) -> int:
    """The telemetry interval that samples :data:`TELEMETRY_SAMPLES` steps of a run of ``run_steps``."""
    return max(1, math.ceil(run_steps / TELEMETRY_SAMPLES))


def _grads_rules(plan: StagePlan, cost: StepCost, opts: dict[str, Any], explicit: set[str]) -> list[str]:
    """The gradient check's rules on a large step; returns what they changed, said for the summary."""
    said = []
    grads: GradsOptions = opts["grads"]
    examples = few_examples(cost)  # the run's telemetry takes its gradient on the same ones (one program)
    if cost.examples > examples and grads.grads_batch_size > examples:
        _change(plan, opts, explicit, "grads", "grads_batch_size", examples)
    if "fwd" in grads.grads_modes and _change(plan, opts, explicit, "grads", "grads_modes", ("rev",)):
        said.append("gradients checked in reverse mode only (a custom_jvp rule is checked through its transpose)")
    if _change(plan, opts, explicit, "grads", "grads_float64", False):
        said.append("gradients checked in float32, a failing leaf again in float64")
    if _change(plan, opts, explicit, "grads", "grads_trust_autodiff", True):
        said.append(
            "finite differences only where autodiff can be wrong (a derivative rule not JAX's own, a stop_gradient "
            "of the user's, a zero gradient)"
        )
    if _change(plan, opts, explicit, "grads", "grads_replay_examples", 1):
        said.append("the gradient's replay for latent NaNs on 1 example")
    grads = _planned(plan, opts, "grads")
    leaves = _leaves_within(cost, grads, GRADS_STEPS)
    if (grads.grads_max_leaves == 0 or leaves < grads.grads_max_leaves) and _change(
        plan, opts, explicit, "grads", "grads_max_leaves", leaves
    ):
        said.append(f"gradient check on {grads.grads_batch_size} examples and at most {leaves} sampled leaves")
    return said


def _estimate(plan: StagePlan, cost: StepCost, opts: dict[str, Any], rate: float) -> dict[str, float]:
    """Seconds per stage: the flops at ``rate`` plus a compile of about the step's size per program."""
    step_s = cost.flops / rate
    compile_s = cost.equations * COMPILE_SECONDS_PER_EQUATION
    grads, overfit, run = (_planned(plan, opts, s) for s in ("grads", "overfit", "run"))
    configs = _configs(plan, cost, overfit)
    leaves = grads.grads_max_leaves or 128
    return {
        "init": 0.5 * compile_s + 2 * step_s,
        "grads": 2 * compile_s + grads_steps(cost, grads, leaves) * step_s,
        "step": compile_s + _planned(plan, opts, "step").step_calls * step_s,
        "batch": 0.5 * compile_s + 2 * step_s,
        "overfit": 1.5 * compile_s + overfit_steps(cost, overfit, configs) * step_s,
        "run": compile_s + run.run_steps * step_s,
    }


def _configs(plan: StagePlan, cost: StepCost, overfit: OverfitOptions) -> int:
    """Configurations the sweep will run (with its baseline) under the planned flop budget."""
    if plan.overfit_budget_flops is None:
        return 7
    one = overfit_steps(cost, overfit, 1) * cost.flops
    return max(2, min(7, int(plan.overfit_budget_flops // max(one, 1.0))))


def _fit_time_budget(
    plan: StagePlan, cost: StepCost, opts: dict[str, Any], explicit: set[str], budget: float, rate: float
) -> None:
    """Reduce the sweep, the gradient check and the run, in that order, until the estimate fits ``budget``."""
    step_s = cost.flops / rate
    estimates = _estimate(plan, cost, opts, rate)
    before = sum(estimates.values())
    reduced = []
    if before > budget:  # the sweep: fewer examples, then as many configurations as its share affords
        examples = few_examples(cost)
        if cost.examples > examples and _change(plan, opts, explicit, "overfit", "overfit_batch_size", examples):
            reduced.append(f"overfit sweep on {examples} examples")
        share = max(0.0, budget - sum(v for k, v in _estimate(plan, cost, opts, rate).items() if k != "overfit"))
        plan.overfit_budget_flops = min(plan.overfit_budget_flops or math.inf, share / 2 * rate)
        reduced.append(f"overfit sweep within {plan.overfit_budget_flops / 1e12:.2g} TFLOP")
    estimates = _estimate(plan, cost, opts, rate)
    if sum(estimates.values()) > budget:  # the gradient check: fewer sampled leaves
        grads = _planned(plan, opts, "grads")
        spare = budget - sum(v for k, v in estimates.items() if k != "grads") - 2 * cost.equations * 2e-3
        leaves = _leaves_within(cost, grads, max(0.0, spare) / max(step_s, 1e-9))
        if leaves < (grads.grads_max_leaves or 128) and _change(
            plan, opts, explicit, "grads", "grads_max_leaves", leaves
        ):
            reduced.append(f"gradient check on at most {leaves} sampled leaves")
    estimates = _estimate(plan, cost, opts, rate)
    run: RunOptions = _planned(plan, opts, "run")
    if sum(estimates.values()) > budget and run.run_steps > 10:  # the run: fewer steps, never below 10
        over = sum(estimates.values()) - budget
        steps = max(10, run.run_steps - math.ceil(over / max(step_s, 1e-9)))
        if _change(plan, opts, explicit, "run", "run_steps", steps):
            reduced.append(f"run of {steps} steps")
            for name in ("run_telemetry_every", "run_dead_every"):  # still sampled on as many steps
                if name in plan.changes["run"]:
                    plan.changes["run"][name] = telemetry_every(steps)
    plan.estimates = _estimate(plan, cost, opts, rate)
    after = sum(plan.estimates.values())
    head = (
        f"budget {budget:g} s: the stages were estimated at {before:.0f} s (a step {step_s * 1e3:.3g} ms at "
        f"{rate / 1e9:.3g} GFLOP/s, compiles from the step's {cost.equations} equations)"
    )
    if not reduced:
        plan.lines.append(head + "; nothing reduced")
    else:
        plan.lines.append(
            head
            + "; reduced: "
            + ", ".join(reduced)
            + f"; now estimated at {after:.0f} s"
            + ("" if after <= budget else " (still above: the remaining work is the checks' minimum)")
        )
