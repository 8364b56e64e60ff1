"""doctor: the explicit pipeline, validated options, honest verdicts on crashing programs, stage timings."""

import dataclasses
import inspect
import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _programs import optax_step_of

import jaxsane
from jaxsane._core.errors import DoctorOptionError, JaxsaneError
from jaxsane._doctor import options as _options, pipeline as _pipeline
from jaxsane._doctor.doctor import DoctorDiagnosis, user_crash

X = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
TRAIN = {"x": X, "y": (np.arange(16) % 2).astype(np.int32)}
FAST = dict(stages=["data", "step", "run"], run_steps=3, progress=False)


def _loss(p, b):
    return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


def _good_step(p, b):
    loss, g = jax.value_and_grad(_loss)(p, b)
    return jax.tree_util.tree_map(lambda a, d: a - 0.1 * d, p, g), {"loss": loss}


def _experiment(step=_good_step, init=None, **kw):
    init = init or (lambda key: {"w": jnp.zeros((4,))})
    kw.setdefault("params", lambda s: s)
    return jaxsane.Experiment(init=init, step=step, train=TRAIN, name="tiny", **kw)


def _line_of(fn, needle):
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, text in enumerate(lines) if needle in text)


# ----------------------------------------------------------------------------- honest verdicts

@pytest.mark.slow
def test_healthy_program_passes_and_every_stage_ran():
    d = jaxsane.doctor(_experiment(), **FAST)
    assert isinstance(d, DoctorDiagnosis)
    assert not d.by_code("doctor"), d
    assert [s["name"] for s in d.stages] == ["data", "step", "run"]
    assert all(s["status"] == "ran" for s in d.stages) and d.complete and d.passed


def test_stages_prepared_ahead_run_last_in_the_order_their_work_was_queued(monkeypatch):
    """The main thread runs the stages it does all the work of (the step stage, compiling the user's step, among
    them) while the background thread works ahead, the data stage after the step stage (it reads a stream for a share
    of the user's cold run, which the step stage times); then the prepared stages, in the order their work was
    queued, each finding it done. The report keeps the checklist's order."""
    from jaxsane._doctor import doctor as doctor_module

    ran = []
    real = doctor_module._run_stage
    monkeypatch.setattr(doctor_module, "_run_stage", lambda plan, stage: ran.append(stage.name) or real(plan, stage))
    d = jaxsane.doctor(_experiment(loss=_loss), run_steps=3, overfit_steps=20, progress=False)
    assert ran == ["init", "step", "data", "batch", *_pipeline.PREPARE]
    assert list(_pipeline.PREPARE) == ["overfit", "grads", "run"]
    assert [s["name"] for s in d.stages] == [s.name for s in _pipeline.STAGES]


def _crashing_step(p, b):
    raise ValueError("boom in the step")


def test_step_that_raises_is_an_error_naming_the_exception_and_line():
    d = jaxsane.doctor(_experiment(_crashing_step), **FAST)
    crashed = d.by_code("doctor.user_code_crashed")
    assert len(crashed) == 1, d  # one crash, reported once although two stages needed the step
    f = crashed[0]
    assert f.severity == "error" and not d.ok and not d.passed
    assert "ValueError" in f.message and "boom in the step" in f.message
    assert f.file == __file__ and f.line == _line_of(_crashing_step, "raise ValueError")
    status = {s["name"]: s["status"] for s in d.stages}
    assert status == {"data": "ran", "step": "crashed", "run": "crashed"}
    assert not d.by_code("doctor.skipped")


def _metrics_only_step(p, b):
    return {"loss": _loss(p, b)}


def test_step_that_returns_only_metrics_is_an_error_not_a_skip():
    d = jaxsane.doctor(_experiment(_metrics_only_step), **FAST)
    assert d.codes == ["doctor.step_output"] and d[0].severity == "error", d
    assert "structure" in d[0].message and not d.passed
    assert {s["name"]: s["status"] for s in d.stages} == {"data": "ran", "step": "skipped", "run": "skipped"}


def test_init_that_raises_is_an_error_and_data_still_runs():
    def init(key):
        return {"w": jnp.zeros((4,))} / 0  # BUG: a dict divided by 0 raises TypeError

    d = jaxsane.doctor(_experiment(init=init), **FAST)
    f = d.by_code("doctor.user_code_crashed")
    assert len(f) == 1 and "TypeError" in f[0].message and f[0].line == _line_of(init, "BUG")
    assert {s["name"]: s["status"] for s in d.stages} == {"data": "ran", "step": "crashed", "run": "crashed"}


def test_loss_that_raises_is_an_error_in_the_grads_stage():
    def loss(p, b):
        return jnp.mean(p["w"] @ b["missing"])  # BUG: no such key

    d = jaxsane.doctor(_experiment(loss=loss), stages=["grads"], progress=False)
    f = d.by_code("doctor.user_code_crashed")
    assert len(f) == 1 and "KeyError" in f[0].message and f[0].line == _line_of(loss, "BUG"), d
    assert d.stages[0]["status"] == "crashed" and not d.passed


def test_crash_inside_jaxsane_is_a_warning_that_says_jaxsane_bug(monkeypatch):
    monkeypatch.setattr(_pipeline, "timed_check_step", dict)  # a library-only crash: dict() gets bad arguments
    d = jaxsane.doctor(_experiment(), stages=["step"], progress=False)
    assert d.codes == ["doctor.skipped"] and d[0].severity == "warning", d
    assert "jaxsane bug" in d[0].message and d.stages[0]["status"] == "failed"
    assert d.ok and not d.complete and not d.passed


def test_missing_handle_is_skipped_with_its_reason_and_does_not_pass():
    d = jaxsane.doctor(_experiment(), stages=["grads"], progress=False)
    assert d.codes == ["doctor.skipped"] and d[0].severity == "info"
    assert d.stages == [dict(d.stages[0], status="not applicable")] and "Experiment.loss" in d.stages[0]["reason"]
    assert d.ok and not d.complete and not d.passed  # asked for by name: not running it cannot pass
    assert "stage grads not applicable" in str(d) and "incomplete" in str(d)


def test_missing_handle_under_the_default_stages_is_listed_but_passes():
    d = jaxsane.doctor(_experiment(), skip=["overfit", "run", "init", "batch", "step"], progress=False)
    assert [(s["name"], s["status"]) for s in d.stages] == [("data", "ran"), ("grads", "not applicable")]
    assert d.ok and d.complete and d.passed, d
    assert "stage grads not applicable" in str(d) and "incomplete" not in str(d)


def test_user_crash_finds_the_user_frame_through_a_jaxsane_wrapper():
    def user():
        raise RuntimeError("inner")

    try:
        try:
            user()
        except RuntimeError as e:
            raise JaxsaneError("wrapped") from e
    except JaxsaneError as outer:
        exc, file, line = user_crash(outer)
    assert isinstance(exc, RuntimeError) and file == __file__ and line == _line_of(user, "raise RuntimeError")


# ----------------------------------------------------------------------------- options

def test_unknown_option_names_the_valid_ones_before_any_work():
    calls = []

    def init(key):
        calls.append(key)
        return {"w": jnp.zeros((4,))}

    with pytest.raises(DoctorOptionError) as info:
        jaxsane.doctor(_experiment(init=init), run_stepz=5)
    text = str(info.value)
    assert text.startswith("[jaxsane]") and "run_stepz" in text and "did you mean 'run_steps'" in text
    assert "run_steps: int = 30" in text and "overfit_learning_rates: tuple[float, ...] | None = None" in text
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    assert calls == []


@pytest.mark.parametrize("options,needle", [
    ({"run_steps": "5"}, "run_steps must be int"),
    ({"run_steps": 2.5}, "run_steps must be int"),
    ({"run_steps": True}, "run_steps must be int"),
    ({"run_steps": 0}, "must be >= 1"),
    ({"grads_modes": ("fwd", "sideways")}, "must be one of ['fwd', 'rev']"),
    ({"overfit_learning_rates": "1e-3"}, "tuple[float, ...] | None"),
    ({"run_thresholds": {"no_such_threshold": 1.0}}, "check_training"),
])
def test_ill_typed_options_raise(options, needle):
    with pytest.raises(DoctorOptionError, match=r"^\[jaxsane\]") as info:
        jaxsane.doctor(_experiment(), **options)
    assert needle in str(info.value)


@pytest.mark.parametrize("stages,skip,needle", [(["nope"], (), "unknown doctor stage"), (["run"], ["run"], "no doctor stage left"),
                                                ([], (), "no doctor stage left")])
def test_stage_selection_is_checked(stages, skip, needle):
    with pytest.raises(DoctorOptionError, match=needle):
        jaxsane.doctor(_experiment(), stages=stages, skip=skip)
    assert _options.select_stages("run") == ["run"] and _options.select_stages(None, "data")[0] == "init"


def test_options_are_coerced_to_their_declared_types():
    opts = _options.resolve({"overfit_learning_rates": [1e-3, 1e-2], "init_loss_rtol": 1, "overfit_seeds": [0, 1]})
    assert opts["overfit"].overfit_learning_rates == (0.001, 0.01)
    assert opts["init"].init_loss_rtol == 1.0 and isinstance(opts["init"].init_loss_rtol, float)
    assert opts["overfit"].overfit_seeds == (0, 1) and opts["run"].run_steps == 30


def test_every_option_a_stage_reads_is_declared_and_every_declared_one_is_read():
    for stage in _pipeline.STAGES:
        own_module = stage.run.__module__ != _pipeline.__name__  # a stage in a module of its own reads there
        code = inspect.getsource(inspect.getmodule(stage.run) if own_module else stage.run)
        read = set(re.findall(r"(?:opts|ctx\.options)\.([a-z_0-9]+)", code))
        assert read == {f.name for f in dataclasses.fields(stage.options)}, stage.name


def test_the_option_names_of_earlier_releases_still_work():
    earlier = ["data_max_batches", "data_max_seconds", "init_loss_rtol", "init_loss_factor", "init_scale_ratio", "init_per_layer_factor",
               "init_max_saturated", "init_symmetric_tol", "grads_order", "grads_modes", "grads_batch_size",
               "grads_max_leaves",
               "step_calls", "batch_probes", "overfit_seeds", "overfit_steps", "overfit_learning_rates",
               "overfit_init_scales", "overfit_batch_size", "init_scales", "run_steps", "run_eval_every",
               "run_dead_every", "run_thresholds"]
    added = ["grads_float64", "grads_replay_examples", "run_eval_examples", "run_telemetry_every",
             "run_telemetry_examples", "overfit_seconds", "grads_trust_autodiff"]  # doctor at scale
    assert sorted(_options.OPTIONS) == sorted(earlier + added)


def test_pipeline_lists_functions_and_frozen_documented_options():
    assert [s.name for s in _pipeline.STAGES] == ["data", "init", "grads", "step", "batch", "overfit", "run"]
    for stage in _pipeline.STAGES:
        assert inspect.isfunction(stage.run) and stage.run.__module__ in ("jaxsane._doctor.pipeline", "jaxsane._doctor.run_stage", "jaxsane._doctor.grads_stage")
        assert dataclasses.is_dataclass(stage.options) and stage.options.__dataclass_params__.frozen
        for f in dataclasses.fields(stage.options):
            assert f.metadata["doc"], f.name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(stage.options(), dataclasses.fields(stage.options)[0].name, None)
    assert dataclasses.is_dataclass(_pipeline.StageContext)


@pytest.mark.parametrize("name,text,value", [
    ("overfit_learning_rates", "1e-3,1e-2", (0.001, 0.01)),
    ("overfit_learning_rates", "[1e-3, 1e-2]", (0.001, 0.01)),
    ("overfit_learning_rates", "none", None),
    ("overfit_seeds", "3", 3),
    ("overfit_seeds", "0,1", (0, 1)),
    ("grads_modes", "rev", ("rev",)),
    ("data_max_batches", "7", 7),
    ("init_loss_rtol", "0.25", 0.25),
    ("run_thresholds", "plateau_rel:0.02,min_steps:5", {"plateau_rel": 0.02, "min_steps": 5}),
    ("run_thresholds", '{"plateau_rel": 0.02}', {"plateau_rel": 0.02}),
])
def test_command_line_values_are_read_per_declared_type(name, text, value):
    assert _options.parse_text(name, text) == value


@pytest.mark.parametrize("name,text", [("run_steps", "abc"), ("run_steps", "1.5"), ("overfit_learning_rates", "1e-3,,"),
                                       ("overfit_learning_rates", "fast"), ("run_thresholds", "plateau_rel")])
def test_command_line_values_of_the_wrong_type_are_refused(name, text):
    with pytest.raises(DoctorOptionError, match=name):
        _options.parse_text(name, text)


# ----------------------------------------------------------------------------- reports and progress

def test_stages_and_timings_in_json_and_terminal_summary():
    d = jaxsane.doctor(_experiment(), stages=["data", "grads"], progress=False)
    payload = json.loads(d.to_json())
    assert payload["complete"] is False
    assert [(s["name"], s["status"]) for s in payload["stages"]] == [("data", "ran"), ("grads", "not applicable")]
    assert set(payload["timings"]) == {"data", "grads"} and all(t >= 0 for t in payload["timings"].values())
    text = str(d)
    assert "stages run: data" in text and " s (total " in text and "stage grads not applicable" in text



def test_free_host_memory_goes_back_to_the_os_after_every_stage(monkeypatch):
    import jaxsane._doctor.doctor as doctor_module

    ran, released_after = [], []  # the stages run so far, and how many had run at each release
    real_run_stage = doctor_module._run_stage

    def run_stage(plan, stage):
        out = real_run_stage(plan, stage)
        ran.append(stage.name)
        return out

    from jaxsane._core import host_memory

    monkeypatch.setattr(doctor_module, "_run_stage", run_stage)
    monkeypatch.setattr(host_memory, "release_free_memory", lambda: released_after.append(len(ran)) or True)
    grown = iter(range(0, 10**6 * host_memory.GROWTH, host_memory.GROWTH))  # every stage grew the process
    monkeypatch.setattr(host_memory, "resident_bytes", lambda: next(grown))
    d = jaxsane.doctor(_experiment(_crashing_step), stages=["data", "grads", "step"], progress=False)
    assert [s["name"] for s in d.stages] == ["data", "grads", "step"] and d.stages[2]["status"] == "crashed"
    assert released_after == [1, 2, 3]  # once after each stage, the crashed one too

def test_html_report_lists_the_stages(tmp_path):
    d = jaxsane.doctor(_experiment(_crashing_step), stages=["data", "step"], progress=False)
    page = open(jaxsane.write_html(str(tmp_path / "r.html"), [d])).read()
    assert 'data-stage="data"' in page and 'data-stage="step"' in page and "crashed" in page


def test_plain_progress_lines_when_stderr_is_not_a_terminal(capsys):
    jaxsane.doctor(_experiment(), stages=["data", "grads"], progress=True)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("[jaxsane] tiny: data ...") and err[0].endswith(" s")
    assert err[1].startswith("[jaxsane] tiny: grads ... not applicable (")
    jaxsane.doctor(_experiment(), stages=["data"], progress=False)
    assert capsys.readouterr().err == ""


# ----------------------------------------------------------------------------- a light package import

@pytest.mark.subprocess
@pytest.mark.slow
def test_importing_jaxsane_and_its_cli_does_not_import_jax():
    code = ("import sys, jaxsane, jaxsane.cli; assert 'jax' not in sys.modules, 'jax imported'; "
            "from jaxsane import guard, doctor, Experiment, CODES; import jaxsane as j; "
            "assert all(getattr(j, n) is not None for n in j.__all__); print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_unknown_attribute_of_the_package_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        jaxsane.no_such_name  # noqa: B018


def test_data_that_raises_is_an_error_and_nothing_runs():
    def batches():
        raise OSError("the shard is gone")  # BUG
        yield TRAIN

    exp = jaxsane.Experiment(init=lambda key: {"w": jnp.zeros((4,))}, step=_good_step, train=batches,
                             params=lambda s: s, name="tiny")
    d = jaxsane.doctor(exp, **FAST)
    f = d.by_code("doctor.user_code_crashed")
    assert len(f) == 1 and "OSError" in f[0].message and f[0].line == _line_of(batches, "BUG"), d
    assert [s["status"] for s in d.stages] == ["crashed", "crashed", "crashed"] and not d.passed


def test_a_stage_whose_other_checks_ran_beside_a_skipped_one_ran():
    """A loss that draws its own noise cannot be compared with the best constant prediction (doctor.skipped), but
    the init stage's activation checks ran: the stage ran (asked for by name, it is no incomplete doctor)."""
    import optax

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    batch = {"x": x, "y": (x @ rng.normal(size=(4, 2))).astype(np.float32)}
    tx = optax.adam(1e-2)

    def init(key):
        params = {"w1": jax.random.normal(key, (4, 16)) * 0.5, "w2": jax.random.normal(jax.random.fold_in(key, 1), (16, 2))}
        return params, tx.init(params)

    def apply(params, inputs):
        return jnp.tanh(inputs @ params["w1"]) @ params["w2"]

    def loss(params, b):  # inputs augmented with noise inside the loss
        return jnp.mean((apply(params, b["x"] + 0.1 * jax.random.normal(jax.random.key(1), b["x"].shape)) - b["y"]) ** 2)

    step = optax_step_of(loss, tx)

    exp = jaxsane.Experiment(init=init, step=step, train=[batch], loss=loss, apply=apply, inputs=lambda b: b["x"],
                             labels=lambda b: b["y"])  # fmt: skip
    d = jaxsane.doctor(exp, stages=["init"], progress=False)
    assert [f.code for f in d] == ["doctor.skipped"] and d.stages[0]["status"] == "ran" and d.complete, d.stages
    no_apply = jaxsane.Experiment(init=init, step=step, train=[batch], loss=loss)
    d = jaxsane.doctor(no_apply, stages=["init"], progress=False)
    assert d.stages[0]["status"] == "not applicable", "nothing of the stage could run without apply"


def test_a_hand_written_sgd_whose_state_is_its_list_of_layers():
    """A newcomer's state is the parameters themselves, ``[(W, b), (W, b)]`` with no optimizer state: by default a
    list state reads as ``(params, opt_state)``, and its first layer alone crashed the loss (a false
    user_code_crashed in four stages). The loss decides: the whole list is what it takes."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)

    def init(key):
        k1, k2 = jax.random.split(key)
        return [(jax.random.normal(k1, (4, 16)) * 0.5, jnp.zeros(16)), (jax.random.normal(k2, (16, 2)) * 0.25, jnp.zeros(2))]

    def apply(params, inputs):
        for w, b in params[:-1]:
            inputs = jax.nn.relu(inputs @ w + b)
        w, b = params[-1]
        return inputs @ w + b

    def loss(params, batch):
        logp = jax.nn.log_softmax(apply(params, batch["x"]))
        return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))

    @jax.jit
    def step(params, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), {"loss": value}

    def batches():
        i = 0
        while True:
            idx = np.arange(i, i + 32) % 128
            yield {"x": x[idx], "y": y[idx]}
            i += 32

    exp = jaxsane.Experiment(init=init, step=step, train=batches, loss=loss, apply=apply, num_classes=2,
                             inputs=lambda b: b["x"], labels=lambda b: b["y"])  # fmt: skip
    d = jaxsane.doctor(exp, stages=["init", "grads", "step"], progress=False)
    assert [s["status"] for s in d.stages] == ["ran"] * 3 and d.ok, [str(f) for f in d]
