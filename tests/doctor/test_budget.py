"""doctor's stage plan: per-stage rules on a large step, a time budget, and the user's options left alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsane
from jaxsane._core.errors import DoctorOptionError
from jaxsane._doctor import budget as _budget, grads_stage as _grads_stage
from jaxsane._doctor.options import resolve
from jaxsane._experiment.contract import PureExperiment

TRAIN = {"x": np.random.default_rng(0).normal(size=(16, 64)).astype(np.float32), "y": np.arange(16) % 3}


def _loss(p, b):
    logits = jnp.tanh(b["x"] @ p["w1"]) @ p["w2"]
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(b["y"].shape[0]), b["y"]])


def _step(p, b):
    loss, g = jax.value_and_grad(_loss)(p, b)
    return jax.tree_util.tree_map(lambda a, d: a - 0.1 * d, p, g), {"loss": loss}


def _experiment():
    def init(key):
        k1, k2 = jax.random.split(key)
        return {"w1": jax.random.normal(k1, (64, 256)) * 0.1, "w2": jax.random.normal(k2, (256, 3)) * 0.1}

    return jaxsane.Experiment(init=init, step=_step, train=TRAIN, loss=_loss, params=lambda s: s, name="mlp")


def _plan(options=None, **kw):
    exp = _experiment()
    adapted = PureExperiment(exp, key=jax.random.key(0))
    batch = {k: v for k, v in TRAIN.items()}
    options = options or {}
    return _budget.plan_stages(adapted, batch, resolve(options), set(options), **kw)


def test_step_cost_counts_the_matrix_products_of_the_step():
    cost = _plan().cost
    assert cost.examples == 16 and cost.state_bytes == (64 * 256 + 256 * 3) * 4
    # forward and backward: at least 2 x (2 x 16 x (64 x 256 + 256 x 3)) flops of matrix products
    assert 2 * 2 * 16 * (64 * 256 + 256 * 3) <= cost.flops < 4 * 2 * 16 * (64 * 256 + 256 * 3)


def test_a_small_step_runs_every_check_in_full():
    plan = _plan()
    assert plan.changes == {} and plan.lines == [] and plan.overfit_budget_flops is None and plan.sweep_chunk is None


def test_a_large_step_samples_leaves_cuts_examples_and_bounds_the_sweep(monkeypatch):
    monkeypatch.setitem(_budget.LARGE_STEP_FLOPS, "cpu", 1.0)  # this MLP's step counts as large
    plan = _plan()
    assert plan.changes["grads"]["grads_batch_size"] == _budget.SMALL_BATCH
    assert plan.changes["grads"]["grads_max_leaves"] >= _budget.MIN_LEAVES
    assert plan.changes["overfit"]["overfit_batch_size"] == _budget.SMALL_BATCH
    assert plan.overfit_budget_flops == _budget.OVERFIT_STEPS * plan.cost.flops
    assert plan.sweep_memory_bytes == _budget.SWEEP_STATES * plan.cost.state_bytes
    assert plan.sweep_chunk == _budget.SWEEP_CHUNK
    assert plan.lines and plan.lines[0].startswith("plan: the step is large")
    cost = plan.cost
    grads = plan.apply(resolve({}))["grads"]
    assert _budget.grads_steps(cost, grads, grads.grads_max_leaves) <= _budget.GRADS_STEPS + 1e-9


def test_a_large_training_state_makes_a_step_of_few_flops_large(monkeypatch):
    """A recommender's embedding tables: few flops a step, but a state the update reads and writes whole every
    step; the per-stage rules apply, and the plan says the state's size."""
    small = _plan()
    assert not small.large and small.cost.state_bytes < _budget.LARGE_STATE_BYTES["cpu"]
    monkeypatch.setitem(_budget.LARGE_STATE_BYTES, "cpu", small.cost.state_bytes)  # this MLP's state counts as large
    plan = _plan()
    assert plan.large and plan.cost.flops < _budget.LARGE_STEP_FLOPS["cpu"]
    assert plan.changes["overfit"]["overfit_batch_size"] == _budget.SMALL_BATCH
    assert f"a {plan.cost.state_bytes / 2**20:.0f} MiB training state" in plan.lines[0]


def test_a_large_steps_sweep_stops_within_its_chunk_of_a_fit(monkeypatch):
    small = jaxsane.doctor(_experiment(), stages=["overfit"], progress=False, compile_cache=False)
    monkeypatch.setitem(_budget.LARGE_STEP_FLOPS, "cpu", 1.0)  # this MLP's step counts as large
    large = jaxsane.doctor(_experiment(), stages=["overfit"], progress=False, compile_cache=False)
    steps = {}
    for name, d in (("small", small), ("large", large)):
        result = d.artifacts["overfit"]
        fit_at = int(min(s for s in result.reached_at if s >= 0))  # every configuration fits this MLP
        steps[name] = (fit_at, result.losses.shape[1])
    assert steps["small"][1] % 25 == 0 and steps["large"][1] - steps["large"][0] <= _budget.SWEEP_CHUNK
    assert steps["large"][1] < steps["small"][1], steps


def test_a_large_step_samples_the_runs_telemetry_checks_reverse_mode_and_cuts_eval(monkeypatch):
    monkeypatch.setitem(_budget.LARGE_STEP_FLOPS, "cpu", 1.0)
    plan = _plan()
    grads = plan.changes["grads"]
    assert grads["grads_modes"] == ("rev",) and grads["grads_float64"] is False and grads["grads_replay_examples"] == 1
    assert grads["grads_trust_autodiff"] is True and "finite differences only where autodiff can be wrong" in plan.lines[0]
    assert plan.changes["run"] == {  # no eval data: eval untouched
        "run_telemetry_every": _budget.telemetry_every(30),
        "run_telemetry_examples": _budget.SMALL_BATCH,
    }
    assert "telemetry every 8 steps" in plan.lines[0] and "reverse mode only" in plan.lines[0]
    assert f"its gradient on {_budget.SMALL_BATCH} of the batch's examples" in plan.lines[0]
    assert "float32, a failing leaf again in float64" in plan.lines[0]
    with_eval = jaxsane.Experiment(
        init=_experiment().init, step=_step, train=TRAIN, eval=TRAIN, loss=_loss, params=lambda s: s
    )
    adapted = PureExperiment(with_eval, key=jax.random.key(0))
    planned = _budget.plan_stages(adapted, dict(TRAIN), resolve({}), set())
    assert planned.changes["run"]["run_eval_examples"] == 16 and planned.changes["run"]["run_eval_every"] == 10
    kept = _budget.plan_stages(
        adapted,
        dict(TRAIN),
        resolve({"grads_modes": ("fwd", "rev"), "run_telemetry_every": 1}),
        {"grads_modes", "run_telemetry_every"},
    )
    assert "grads_modes" not in kept.changes["grads"] and "run_telemetry_every" not in kept.changes["run"]


def test_the_users_own_options_are_never_changed(monkeypatch):
    monkeypatch.setitem(_budget.LARGE_STEP_FLOPS, "cpu", 1.0)
    plan = _plan({"grads_max_leaves": 0, "overfit_batch_size": 16})
    assert "grads_max_leaves" not in plan.changes.get("grads", {})
    assert "overfit_batch_size" not in plan.changes.get("overfit", {})


def test_a_tight_time_budget_reduces_the_stages_and_says_what():
    rate = 1e6  # a slow machine: the step takes tens of milliseconds, the run's 30 steps seconds
    tight = _plan(time_budget=1.0, rate=rate)
    assert tight.changes["run"]["run_steps"] < 30 and tight.changes["run"]["run_steps"] >= 10
    assert tight.overfit_budget_flops is not None
    line = tight.lines[-1]
    assert line.startswith("budget 1 s") and "reduced:" in line and "run of" in line
    roomy = _plan(time_budget=1e6, rate=rate)
    assert roomy.changes == {} and roomy.lines[-1].endswith("nothing reduced")
    assert set(roomy.estimates) == {"init", "grads", "step", "batch", "overfit", "run"}


def test_doctor_rejects_a_bad_time_budget_before_any_work():
    for bad in (0, -5, "60", True):
        with pytest.raises(DoctorOptionError, match="time_budget"):
            jaxsane.doctor(_experiment(), time_budget=bad, progress=False)


@pytest.mark.slow
def test_doctor_says_its_plan_in_the_summary_and_the_json():
    d = jaxsane.doctor(_experiment(), stages=["step", "run"], progress=False, time_budget=0.01)
    plan = d.to_dict()["plan"]
    assert plan["lines"] and plan["lines"][-1].startswith("budget 0.01 s")
    assert plan["changes"]["run"]["run_steps"] == 10  # never below 10
    assert d.stage_lines()[0] == plan["lines"][0]
    assert [s["status"] for s in d.stages] == ["ran", "ran"] and d.passed


def test_cli_budget_must_be_positive_and_is_passed_to_doctor(monkeypatch, capsys, tmp_path):
    from jaxsane import cli
    from jaxsane._doctor import doctor as _doctor_module

    assert cli.main(["doctor", "jaxsane.examples.digits_optax:experiment", "--budget", "0"]) == cli.EXIT_USAGE
    assert "--budget must be a positive number" in capsys.readouterr().err
    seen = {}

    def fake_doctor(exp, **kw):
        seen.update(kw)
        return _doctor_module.DoctorDiagnosis(name="x")

    monkeypatch.setattr(_doctor_module, "doctor", fake_doctor)
    cli.main(["doctor", "jaxsane.examples.digits_optax:experiment", "--budget", "45", "-q", "--no-cache"])
    assert seen["time_budget"] == 45.0


def test_a_file_target_defining_a_dataclass_loads(tmp_path):
    from jaxsane import cli

    path = tmp_path / "prog.py"
    path.write_text(
        "import dataclasses\n@dataclasses.dataclass\nclass State:\n    step: int = 0\n"
        "def experiment():\n    return State()\n"
    )
    assert cli.load_target(f"{path}:experiment", raw=True)().step == 0


def _step_without_loss(p, b):
    return _step(p, b)[0], {}


@pytest.mark.parametrize("reports_loss", [True, False])
def test_the_run_samples_telemetry_but_records_every_loss_and_cuts_the_eval_batch(reports_loss):
    exp = jaxsane.Experiment(
        init=_experiment().init,
        step=_step if reports_loss else _step_without_loss,
        train=TRAIN,
        eval={"x": np.concatenate([TRAIN["x"], -TRAIN["x"]]), "y": np.concatenate([TRAIN["y"], (TRAIN["y"] + 1) % 3])},
        loss=_loss,
        params=lambda s: s,
        name="mlp",
    )
    d = jaxsane.doctor(
        exp,
        stages=["run"],
        run_steps=9,
        run_telemetry_every=3,
        run_eval_every=3,
        run_eval_examples=16,
        progress=False,
        compile_cache=False,
    )
    run = d.artifacts["run"]
    assert run["steps"] == list(range(9)) and all(np.isfinite(run["loss"]))  # the loss of every step
    # gradient telemetry every 3rd step when the step reports its loss; every step when the loss is the telemetry's
    assert run["tele_steps"] == (list(range(0, 9, 3)) if reports_loss else list(range(9)))
    assert run["eval_steps"] == [0, 3, 6, 9]
    full = jaxsane.doctor(exp, stages=["run"], run_steps=1, run_eval_every=1, progress=False, compile_cache=False)
    cut_loss = _loss(exp.init(jax.random.key(0)), TRAIN)  # the first 16 eval examples are TRAIN
    assert run["eval_loss"][0] == pytest.approx(float(cut_loss), rel=1e-5)
    assert full.artifacts["run"]["eval_loss"][0] != pytest.approx(float(cut_loss), rel=1e-3)  # all 32: another loss


def _wrong_loss():
    @jax.custom_vjp
    def scaled(w):
        return w

    scaled.defvjp(lambda w: (w, None), lambda _, g: (0.5 * g,))  # the backward rule halves the gradient

    def loss(p, b):
        return _loss({"w1": scaled(p["w1"]), "w2": p["w2"]}, b)

    return loss


@pytest.mark.parametrize("wrong", [False, True])
def test_a_float32_gradient_check_confirms_a_failing_leaf_in_float64(wrong, monkeypatch):
    calls = []
    real = _grads_stage.check_grads

    def spy(*args, dtype, **kw):
        calls.append(np.dtype(dtype).name)
        return real(*args, dtype=dtype, **kw)

    monkeypatch.setattr(_grads_stage, "check_grads", spy)
    loss = _wrong_loss() if wrong else _loss
    exp = jaxsane.Experiment(init=_experiment().init, step=_step, train=TRAIN, loss=loss, params=lambda s: s)
    d = jaxsane.doctor(exp, stages=["grads"], grads_float64=False, progress=False, compile_cache=False)
    codes = [f.code for f in d.findings]
    assert calls == (["float32", "float64"] if wrong else ["float32"])
    assert ("grad.mismatch" in codes) == wrong


def test_a_zero_gradient_behind_a_zero_initialised_head_is_not_checked_again_in_float64(monkeypatch):
    # an info, not a failure: the loss is bitwise unchanged when those leaves move, nothing for float64 to confirm
    calls = []
    real = _grads_stage.check_grads

    def spy(*args, dtype, **kw):
        calls.append(np.dtype(dtype).name)
        return real(*args, dtype=dtype, **kw)

    def init(key):
        return {"w1": jax.random.normal(key, (64, 256)) * 0.1, "w2": jnp.zeros((256, 3))}

    monkeypatch.setattr(_grads_stage, "check_grads", spy)
    exp = jaxsane.Experiment(init=init, step=_step, train=TRAIN, loss=_loss, params=lambda s: s)
    d = jaxsane.doctor(exp, stages=["grads"], grads_float64=False, progress=False, compile_cache=False)
    (zeroed,) = [f for f in d.findings if f.code == "grad.missing"]
    assert zeroed.severity == "info" and "w1" in zeroed.path and calls == ["float32"]


@pytest.mark.parametrize("wrong", [False, True])
def test_a_large_steps_gradient_check_trusts_jax_rules_and_still_finds_a_wrong_custom_rule(wrong, monkeypatch):
    monkeypatch.setitem(_budget.LARGE_STEP_FLOPS, "cpu", 1.0)
    trusted = []
    real = _grads_stage.check_grads

    def spy(*args, trust_autodiff, **kw):
        trusted.append(trust_autodiff)
        return real(*args, trust_autodiff=trust_autodiff, **kw)

    monkeypatch.setattr(_grads_stage, "check_grads", spy)
    exp = jaxsane.Experiment(
        init=_experiment().init, step=_step, train=TRAIN, loss=_wrong_loss() if wrong else _loss, params=lambda s: s
    )
    d = jaxsane.doctor(exp, stages=["grads"], progress=False, compile_cache=False)
    assert trusted and all(trusted)
    assert [f.path for f in d.findings if f.code == "grad.mismatch"] == (["params['w1']"] if wrong else [])


def test_a_large_step_without_a_loss_plans_no_gradient_check(monkeypatch):
    monkeypatch.setitem(_budget.LARGE_STEP_FLOPS, "cpu", 1.0)
    exp = jaxsane.Experiment(init=_experiment().init, step=_step, train=TRAIN, params=lambda s: s)
    plan = _budget.plan_stages(PureExperiment(exp, key=jax.random.key(0)), dict(TRAIN), resolve({}), set())
    assert "grads" not in plan.changes and "gradient" not in plan.lines[0] and "run" in plan.changes


def _sequence_plan(batch, **experiment):
    def loss(p, b):
        return jnp.mean((b["x"] @ p["w1"] @ p["w2"]) ** 2)

    def step(p, b):
        value, g = jax.value_and_grad(loss)(p, b)
        return jax.tree_util.tree_map(lambda a, d: a - 0.1 * d, p, g), {"loss": value}

    exp = jaxsane.Experiment(
        init=_experiment().init, step=step, train=batch, loss=loss, params=lambda s: s, **experiment
    )
    return _budget.plan_stages(PureExperiment(exp, key=jax.random.key(0)), batch, resolve({}), set())


@pytest.mark.parametrize(
    "targets, examples", [("mask", 2), ("labels", 2), ("classes", 4), ("one_hot", 4), ("one_hot_seq", 2), ("none", 4)]
)
def test_a_large_steps_sweep_gradient_check_and_telemetry_take_two_examples_only_when_each_holds_many_targets(
    monkeypatch, targets, examples
):
    monkeypatch.setitem(_budget.LARGE_STEP_FLOPS, "cpu", 1.0)
    x = np.zeros((16, 64), np.float32)
    batch = {
        "mask": {"x": x, "mask": np.ones((16, 32), bool)},  # a sequence model's padding mask: 32 positions
        "labels": {"x": x, "y": np.zeros((16, 32), np.int32)},  # 32 targets an example (tokens, a dense mask)
        "classes": {"x": x, "y": np.zeros((16,), np.int32)},  # one class an example
        "one_hot": {"x": x, "y": np.eye(100, dtype=np.float32)[np.arange(16)]},  # one class an example, one-hot
        "one_hot_seq": {"x": x, "y": np.eye(100, dtype=np.float32)[np.zeros((16, 32), int)]},  # 32 tokens, one-hot
        "none": {"x": x},
    }[targets]
    plan = _sequence_plan(batch)
    assert (
        plan.cost.targets_per_example
        == {"mask": 32, "labels": 32, "classes": 1, "one_hot": 1, "one_hot_seq": 32, "none": 0}[targets]
    )
    assert plan.changes["overfit"]["overfit_batch_size"] == examples
    assert f"overfit sweep on {examples} examples" in plan.lines[0]
    # the check and the telemetry share one gradient program: on the same examples
    assert plan.changes["grads"]["grads_batch_size"] == plan.changes["run"]["run_telemetry_examples"] == examples
    assert f"gradient check on {examples} examples" in plan.lines[0]
    assert f"its gradient on {examples} of the batch's examples" in plan.lines[0]


def test_a_nan_on_a_step_that_samples_no_telemetry_is_caught_at_that_step():
    def step(s, b):
        new, metrics = _step(s["p"], b)
        bad = s["count"] == 3  # the 4th step (index 3) writes a NaN; telemetry samples steps 0 and 4 only
        return {"p": {**new, "w2": jnp.where(bad, jnp.nan, new["w2"])}, "count": s["count"] + 1}, metrics

    def init(key):
        return {"p": _experiment().init(key), "count": jnp.zeros((), jnp.int32)}

    exp = jaxsane.Experiment(init=init, step=step, train=TRAIN, loss=_loss, params=lambda s: s["p"])
    d = jaxsane.doctor(exp, stages=["run"], run_steps=8, run_telemetry_every=4, progress=False, compile_cache=False)
    found = [f for f in d.findings if f.code.startswith("nonfinite")]
    assert found and found[0].step == 3, [(f.code, f.step, f.message) for f in d.findings]
    assert d.artifacts["run"]["steps"] == [0, 1, 2, 3]


def test_the_run_reads_each_steps_flag_one_step_late_and_records_what_a_step_by_step_loop_records():
    """The run dispatches step i + 1 before it reads step i's finiteness. A NaN at step 3: the history ends at
    step 3, the evaluation due after it is not made, and a step 4 that fails on the NaN state it was given (an
    error_if on its inputs) leaves the finding at step 3 rather than crashing the stage."""
    import equinox as eqx

    ran = []

    def step(s, b):
        jax.debug.callback(lambda c: ran.append(int(c)), s["count"])
        p = eqx.error_if(s["p"], jnp.isnan(s["p"]["w2"]).any(), "the step was given NaN weights")
        new, metrics = _step(p, b)
        bad = s["count"] == 3
        return {"p": {**new, "w2": jnp.where(bad, jnp.nan, new["w2"])}, "count": s["count"] + 1}, metrics

    def init(key):
        return {"p": _experiment().init(key), "count": jnp.zeros((), jnp.int32)}

    exp = jaxsane.Experiment(
        init=init, step=jax.jit(step), train=TRAIN, eval=TRAIN, loss=_loss, params=lambda s: s["p"]
    )
    d = jaxsane.doctor(exp, stages=["run"], run_steps=8, run_eval_every=2, progress=False, compile_cache=False)
    found = [f for f in d.findings if f.code.startswith("nonfinite")]
    assert found and found[0].step == 3, [(f.code, f.step, f.message) for f in d.findings]
    assert d.artifacts["run"]["steps"] == [0, 1, 2, 3]
    assert d.artifacts["run"]["eval_steps"] == [0, 2]
    assert "doctor.user_code_crashed" not in {f.code for f in d.findings}
    assert sorted(set(ran))[-1] == 4  # step 4 was dispatched before step 3's flag was read, and discarded
    clean = jaxsane.Experiment(
        init=_experiment().init, step=_step, train=TRAIN, eval=TRAIN, loss=_loss, params=lambda s: s
    )
    d = jaxsane.doctor(clean, stages=["run"], run_steps=5, run_eval_every=2, progress=False, compile_cache=False)
    assert d.artifacts["run"]["steps"] == [0, 1, 2, 3, 4] and d.artifacts["run"]["eval_steps"] == [0, 2, 4]


@pytest.mark.parametrize("reports_loss", [True, False])
def test_the_runs_gradient_telemetry_is_taken_on_the_first_examples_only_when_the_step_reports_its_loss(reports_loss):
    exp = jaxsane.Experiment(
        init=_experiment().init,
        step=_step if reports_loss else _step_without_loss,
        train=TRAIN,
        loss=_loss,
        params=lambda s: s,
    )
    d = jaxsane.doctor(exp, stages=["run"], run_steps=1, run_telemetry_examples=4, progress=False, compile_cache=False)
    run = d.artifacts["run"]
    params = exp.init(jax.random.key(0))
    first4 = {k: v[:4] for k, v in TRAIN.items()}
    # a step without its own loss: the run's loss is the telemetry's, so it takes the whole batch
    taken_on = first4 if reports_loss else TRAIN
    grads = jax.grad(_loss)(params, taken_on)
    norms = [float(jnp.linalg.norm(grads[k])) for k in sorted(grads)]
    assert run["grad_norm"][0] == pytest.approx(norms, rel=1e-4), (run["grad_norm"][0], norms)
    assert run["loss"][0] == pytest.approx(float(_loss(params, TRAIN)), rel=1e-5)  # the loss of the whole batch


def test_the_data_stage_reads_a_stream_for_a_share_of_a_short_cold_run():
    assert _budget.data_seconds(None, {}) == _budget.DATA_SECONDS  # the step not timed (the data stage alone)
    short = {"user_seconds": {"init": 0.8, "first_step": 1.5, "step": 0.1}}  # a cold run of 5.3 s
    assert _budget.data_seconds(None, short) == _budget.MIN_DATA_SECONDS
    middle = {"user_seconds": {"init": 2.0, "first_step": 3.0, "step": 0.5}}  # 20 s
    assert _budget.data_seconds(None, middle) == pytest.approx(2.0)
    long = {"user_seconds": {"init": 5.0, "first_step": 10.0, "step": 2.0}}  # 75 s
    assert _budget.data_seconds(None, long) == _budget.DATA_SECONDS
    assert _budget.data_seconds(7.5, short) == 7.5  # as the user set it
