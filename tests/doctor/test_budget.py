"""doctor's stage plan: per-stage rules on a large step, a time budget, and the user's options left alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsane
from jaxsane._core.errors import DoctorOptionError
from jaxsane._doctor import budget as _budget
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
    assert plan.changes == {} and plan.lines == [] and plan.overfit_budget_flops is None


def test_a_large_step_samples_leaves_cuts_examples_and_bounds_the_sweep(monkeypatch):
    monkeypatch.setitem(_budget.LARGE_STEP_FLOPS, "cpu", 1.0)  # this MLP's step counts as large
    plan = _plan()
    assert plan.changes["grads"]["grads_batch_size"] == _budget.SMALL_BATCH
    assert plan.changes["grads"]["grads_max_leaves"] >= _budget.MIN_LEAVES
    assert plan.changes["overfit"]["overfit_batch_size"] == _budget.SMALL_BATCH
    assert plan.overfit_budget_flops == _budget.OVERFIT_STEPS * plan.cost.flops
    assert plan.sweep_memory_bytes == _budget.SWEEP_STATES * plan.cost.state_bytes
    assert plan.lines and plan.lines[0].startswith("plan: the step is large")
    cost = plan.cost
    grads = plan.apply(resolve({}))["grads"]
    assert _budget.grads_steps(cost, grads, grads.grads_max_leaves) <= _budget.GRADS_STEPS + 1e-9


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
