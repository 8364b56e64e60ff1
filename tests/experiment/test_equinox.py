"""Equinox: eqx.Module states and eqx.filter_jit steps as users write them, through guard, locate, doctor,
fit and dumps (the adapter's partition/combine); interop with eqx.error_if and eqx.debug.assert_max_traces."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsane
from jaxsane._experiment.purify import combine, needs_partition, partition

eqx = pytest.importorskip("equinox")

tx = optax.adam(1e-2)


def batches(n=8, size=32, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.normal(size=(size, 4)).astype(np.float32)
        out.append({"x": x, "y": (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0)})
    return out


def init(key):
    model = eqx.nn.MLP(4, 3, 16, 1, key=key)
    return model, tx.init(eqx.filter(model, eqx.is_array))


def apply(model, x):
    return jax.vmap(model)(x)


def loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(apply(model, batch["x"]), batch["y"]).mean()


@eqx.filter_jit
def step(state, batch):
    model, opt_state = state
    value, grads = eqx.filter_value_and_grad(loss)(model, batch)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return (eqx.apply_updates(model, updates), opt_state), {"loss": value}


@eqx.filter_jit
def make_step(model, opt_state, batch):  # Equinox's README style
    value, grads = eqx.filter_value_and_grad(loss)(model, batch)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, value


def experiment(step_fn=step, **kw):
    kw = {"loss": loss, "apply": apply, **kw}
    return jaxsane.Experiment(init=init, step=step_fn, train=batches(), eval=batches(1, seed=9)[0], num_classes=3,
                              name="eqx", **kw)


@pytest.mark.slow
def test_partition_keeps_equinox_paths_and_round_trips():
    model = init(jax.random.key(0))[0]
    assert needs_partition(model) and not needs_partition({"w": jnp.ones(2), "n": 3})
    arrays, rest = partition(model)
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(arrays))
    paths = [p for p, _ in jaxsane._core.tree.leaves_with_paths(arrays, "model")]
    assert paths[:2] == ["model.layers[0].weight", "model.layers[0].bias"]
    assert rest == partition(init(jax.random.key(1))[0])[1] and hash(rest) == hash(partition(model)[1])
    back = combine(arrays, rest)
    assert back.activation is model.activation and eqx.tree_equal(back, model)
    with pytest.raises(jaxsane.JaxsaneError, match=r"^\[jaxsane\] cannot put 1 arrays back"):
        combine([jnp.ones(2)], rest)


@pytest.mark.subprocess
def test_import_jaxsane_does_not_import_equinox():
    code = "import sys, jaxsane; assert 'equinox' not in sys.modules, 'equinox imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def _sqrt_trap_loss(model, batch):
    logits = apply(model, batch["x"])
    energy = jnp.sum((logits[:, :1] - logits[:, :1]) ** 2, axis=-1)  # exactly 0
    rms = jnp.where(energy > 0, jnp.sqrt(energy), 0.0)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean() + rms.mean()


@pytest.mark.slow
def test_guard_catches_nan_and_names_the_equinox_path(tmp_path):
    @eqx.filter_jit
    def bad_step(model, opt_state, batch):
        value, grads = eqx.filter_value_and_grad(_sqrt_trap_loss)(model, batch)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, value

    model, opt_state = init(jax.random.key(0))
    guarded = jaxsane.guard(make_step, sync=True)
    for batch in batches(3):
        model, opt_state, _ = guarded(model, opt_state, batch)
    assert isinstance(model, eqx.nn.MLP) and model.activation is jax.nn.relu and guarded.compiles == 1
    guarded_bad = jaxsane.guard(bad_step, sync=True, dump_dir=str(tmp_path))
    with pytest.raises(jaxsane.NonFiniteError) as info:
        guarded_bad(model, opt_state, batches(1)[0])
    finding = info.value.finding
    assert finding.code == "nonfinite.backward"
    assert "model.layers[0].weight" in finding.extra["paths"]
    assert "sqrt" in str(info.value) and finding.file.endswith("test_equinox.py")
    # the dump holds the arrays; like= gives the model's functions back
    dump = jaxsane.load_dump(info.value.dump_path, like=(model, opt_state, batches(1)[0]))
    assert isinstance(dump.args[0], eqx.nn.MLP) and dump.args[0].activation is jax.nn.relu
    np.testing.assert_array_equal(dump.args[0].layers[0].weight, model.layers[0].weight)
    assert jaxsane.locate(bad_step, *dump.args).origins[0].code == "nonfinite.backward"


def test_guard_skip_returns_the_input_model():
    model, opt_state = init(jax.random.key(0))
    guarded = jaxsane.guard(step, on_nonfinite="skip", sync=True)
    batch = dict(batches(1)[0])
    batch["x"] = batch["x"].copy()
    batch["x"][0, 0] = np.nan
    (new_model, _), _ = guarded((model, opt_state), batch)
    assert guarded.skipped == 1 and eqx.tree_equal(new_model, model)


@pytest.mark.slow
@pytest.mark.parametrize("step_fn", [step, make_step], ids=["state_metrics", "spread"])
def test_doctor_healthy_equinox_experiment(step_fn):
    d = jaxsane.doctor(experiment(step_fn), overfit_steps=60, run_steps=10, progress=False)
    assert [s["status"] for s in d.stages] == ["ran"] * 7, d.stages
    assert not [f for f in d if f.severity == "error"], [str(f) for f in d]


def test_doctor_finds_an_equinox_step_that_returns_the_old_model():
    @eqx.filter_jit
    def stale(model, opt_state, batch):
        value, grads = eqx.filter_value_and_grad(loss)(model, batch)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return model, opt_state, value

    d = jaxsane.doctor(experiment(stale), stages=["step"], progress=False)
    assert [f.code for f in d.root_causes if f.severity == "error"] == ["step.no_update"]


@pytest.mark.slow
def test_doctor_and_guard_with_error_if_and_assert_max_traces():
    def checked_loss(model, batch):
        logits = eqx.error_if(apply(model, batch["x"]), ~jnp.isfinite(batch["x"]).all(), "non-finite inputs")
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    @eqx.filter_jit
    @eqx.debug.assert_max_traces(max_traces=1)
    def counted(state, batch):
        model, opt_state = state
        value, grads = eqx.filter_value_and_grad(checked_loss)(model, batch)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return (eqx.apply_updates(model, updates), opt_state), {"loss": value}

    d = jaxsane.doctor(experiment(counted), stages=["step", "batch", "run"], run_steps=5, progress=False)
    assert [s["status"] for s in d.stages] == ["ran"] * 3 and d.ok, [str(f) for f in d]
    guarded = jaxsane.guard(counted, sync=True)
    state = init(jax.random.key(0))
    for batch in batches(3):
        state, _ = guarded(state, batch)
    assert not guarded.failures and eqx.debug.get_num_traces(counted.__wrapped__) == 1


def test_error_if_that_fires_is_the_users_crash():
    def strict_loss(model, batch):
        logits = eqx.error_if(apply(model, batch["x"]), jnp.abs(apply(model, batch["x"])).max() < 1e6,
                              "logits must be huge")
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    d = jaxsane.doctor(experiment(loss=strict_loss), stages=["grads"], progress=False)
    crashed = [f for f in d if f.code == "doctor.user_code_crashed"]
    assert crashed and "EquinoxRuntimeError: logits must be huge" in crashed[0].message
    assert d.stages[0]["status"] == "crashed" and "jaxsane bug" not in str([str(f) for f in d])


@pytest.mark.slow
def test_fit_checkpoints_and_resumes_an_equinox_state(tmp_path):
    fit = dict(telemetry_every=5, dead_every=0, log_every=5, progress=False, eval_every=0)
    ckpt = str(tmp_path / "ckpt")
    first = jaxsane.fit(experiment(make_step), steps=4, checkpoint_dir=ckpt, checkpoint_every=2, **fit)
    resumed = jaxsane.fit(experiment(make_step), steps=8, checkpoint_dir=ckpt, checkpoint_every=2, **fit)
    whole = jaxsane.fit(experiment(make_step), steps=8, **fit)
    assert first.step == 4 and resumed.resumed_from == 4
    np.testing.assert_allclose(resumed.losses, whole.losses, rtol=1e-6)
    model, _ = resumed.user_state
    assert isinstance(model, eqx.nn.MLP) and model.activation is jax.nn.relu


def test_experiment_rejects_other_non_array_leaves_clearly():
    exp = jaxsane.Experiment(init=lambda key: {"w": jnp.ones(2), "name": "x"}, step=lambda s, b: s,
                             train={"x": np.ones((4, 2))})
    with pytest.raises(jaxsane.ExperimentError, match=r"^\[jaxsane\] the train state has a non-array leaf"):
        jaxsane.PureExperiment(exp)


class _Counted(eqx.Module):
    mlp: eqx.nn.MLP
    order: jax.Array  # int32 [3]: an integer array field, never differentiated
    calls: int = 0  # a Python int field: static to eqx.filter_jit

    def __call__(self, x):
        return self.mlp(x)[self.order]


def _counted_init(key):
    model = _Counted(eqx.nn.MLP(4, 3, 16, 1, key=key), jnp.arange(3, dtype=jnp.int32))
    return model, tx.init(eqx.filter(model, eqx.is_inexact_array))


def _counted_step(bump_calls):
    @eqx.filter_jit
    def counted_step(model, opt_state, batch):
        value, grads = eqx.filter_value_and_grad(loss)(model, batch)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        model = eqx.apply_updates(model, updates)
        if bump_calls:  # the fault: a Python int that changes every step recompiles the step every step
            model = eqx.tree_at(lambda m: m.calls, model, model.calls + 1)
        return model, opt_state, value

    return counted_step


def _counted_experiment(bump_calls):
    return jaxsane.Experiment(init=_counted_init, step=_counted_step(bump_calls), train=batches(),
                              eval=batches(1, seed=9)[0], loss=loss, apply=apply, num_classes=3, name="counted")


def test_adapter_lets_a_python_int_field_flow_from_step_to_step():
    adapted = jaxsane.PureExperiment(_counted_experiment(True))
    state = adapted.init(jax.random.key(0))
    for _ in range(3):
        state, _ = adapted.step(state, batches(1)[0])
    model = adapted.user_state(state)[0]
    assert isinstance(model, _Counted) and model.calls == 3 and model.mlp.activation is jax.nn.relu


@pytest.mark.parametrize("bump_calls", [False, True], ids=["correct", "python_int_counter"])
def test_step_recompiles_is_found_on_an_equinox_python_int_field(bump_calls):
    d = jaxsane.doctor(_counted_experiment(bump_calls), stages=["step"], progress=False)
    found = [f for f in d if f.code == "step.recompiles"]
    if not bump_calls:
        assert not found and d.ok, [str(f) for f in d]
        return
    assert found and "state[0].calls: 0 -> 1" in found[0].message and found[0].path == "state[0].calls"


@pytest.mark.slow
def test_doctor_runs_an_equinox_model_with_an_int32_array_field():
    d = jaxsane.doctor(_counted_experiment(False), overfit_steps=60, run_steps=10, progress=False)
    assert [s["status"] for s in d.stages] == ["ran"] * 7, d.stages
    assert not [f for f in d if f.severity == "error" or f.code == "doctor.skipped" and "jaxsane bug" in f.message], [
        str(f) for f in d
    ]
