"""Compile once, reuse everywhere: the persistent compilation cache in doctor (and off in the suite),
compile counts that see cache hits, programs shared through PureExperiment, one compiled step in the run stage."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _programs import nnx_init, nnx_loss, nnx_step, optax_experiment

import jaxsane
from jaxsane._checks.step import count_compilations
from jaxsane._experiment.contract import PureExperiment
from jaxsane._jaxpr import compile_cache as _compile_cache
from jaxsane._jaxpr.compile_level import _quick_compiles, quick_jit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_suite_runs_with_the_cache_off():
    assert _compile_cache.cache_disabled_by_env()
    assert _compile_cache.enable_compilation_cache() is None
    home = os.path.join(os.path.expanduser("~"), ".cache")
    assert not os.environ["JAXSANE_CACHE_DIR"].startswith(home)


@pytest.fixture
def persistent_cache(tmp_path):
    """The persistent cache on, in tmp_path, for one test; JAX's settings restored afterwards."""
    from jax._src import compilation_cache
    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs,
              jax.config.jax_persistent_cache_min_entry_size_bytes)
    path = _compile_cache.enable_compilation_cache(str(tmp_path / "xla"))
    assert path == str(tmp_path / "xla")
    try:
        yield path
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", before[2])
        _compile_cache._ENABLED_BY_JAXSANE.remove(path)
        compilation_cache.reset_cache()


def test_a_program_loaded_from_the_persistent_cache_counts_as_one_compilation(persistent_cache):
    def f(x):
        return jnp.tanh(x) * 3.0 + 1.0

    x = jnp.ones(5)
    with count_compilations() as first:
        jax.jit(f)(x)
    assert first.compiles == 1
    assert os.listdir(persistent_cache)  # written to disk
    jax.clear_caches()  # forget the in-memory executable: the next call loads it from disk
    with count_compilations() as second:
        jax.jit(f)(x)
    assert second.compiles == 1
    with count_compilations() as third:  # served from memory: no compilation at all
        jax.jit(f)(x)
    assert third.compiles == 0


def test_compile_counter_counts_a_cache_hit_once_whatever_jax_records():
    from jaxsane._checks.step import _CACHE_HIT_EVENT, _COMPILE_EVENT, CompileCounter
    counter = CompileCounter()
    counter.active = True
    counter._listener(_CACHE_HIT_EVENT, 0.1)  # a hit followed by jax's backend-compile event: one
    counter._listener(_COMPILE_EVENT, 0.1)
    counter._listener(_CACHE_HIT_EVENT, 0.1)  # a hit alone (jax versions that record only this): one
    counter._listener("/jax/core/compile/jaxpr_to_mlir_module_duration", 0.1)  # the next program's lowering
    counter._listener(_COMPILE_EVENT, 0.1)  # and its real compile: one more
    assert counter.compiles == 3


def test_doctor_rejects_a_bad_compile_cache_value():
    with pytest.raises(jaxsane.DoctorOptionError, match=r"\[jaxsane\].*compile_cache"):
        jaxsane.doctor(optax_experiment(), compile_cache=3, progress=False)


@pytest.mark.slow
def test_adapted_nnx_loss_and_apply_are_one_object_and_compile_once():
    exp = jaxsane.Experiment(init=nnx_init, step=nnx_step, train={"x": np.ones((4, 4), np.float32),
                             "y": np.zeros(4, np.int32)}, loss=nnx_loss, apply=lambda m, x: m(x))
    adapted = PureExperiment(exp)
    assert adapted.loss_fn is adapted.loss_fn and adapted.apply_fn is adapted.apply_fn
    assert adapted.jitted("loss") is adapted.jitted("loss")
    params = adapted.params(adapted.example_state)
    batch = {"x": jnp.ones((4, 4)), "y": jnp.zeros(4, jnp.int32)}
    _quick_compiles(jax.default_backend())  # the once-per-process check that XLA takes the quick option is a compile of its own
    with count_compilations() as c:
        a = adapted.jitted("loss")(params, batch)
        b = adapted.jitted("loss")(params, batch)
        # another check's jit of the same function, compiled for the same level: shared
        q = quick_jit(adapted.loss_fn, runs=8)(params, batch)
    assert c.compiles == 1 and float(a) == float(b) == float(q)


def test_adapted_jitted_names_its_choices():
    adapted = PureExperiment(optax_experiment())
    with pytest.raises(ValueError, match=r"\[jaxsane\].*'apply', 'loss', 'step'"):
        adapted.jitted("grad")
    assert PureExperiment(jaxsane.Experiment(
        init=lambda k: {"w": jnp.ones(2)}, step=lambda s, b: s, train={"x": np.ones((2, 2))})).jitted("loss") is None


def test_run_stage_runs_the_step_the_step_stage_compiled(caplog):
    import logging

    from _programs import optax_step
    step = jax.jit(lambda state, batch: optax_step(state, batch))  # a step no earlier test compiled
    exp = dataclasses.replace(optax_experiment(), step=step)
    jaxsane.doctor(exp, stages=["step"], progress=False, compile_cache=False)  # compiles the user's step
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        d = jaxsane.doctor(exp, stages=["run"], run_steps=6, progress=False, compile_cache=False)
    assert d.complete and len(d.artifacts["run"]["loss"]) == 6
    compiled = re.findall(r"Finished XLA compilation of (\S+)", caplog.text)
    assert compiled, caplog.text
    # only the small telemetry programs: neither the step again nor a guarded, monitored copy of it
    assert not [name for name in compiled if "lambda" in name or "_body" in name], compiled


def test_run_stage_measures_a_step_that_donates_its_state():
    from _programs import optax_step
    exp = dataclasses.replace(optax_experiment(), step=jax.jit(optax_step, donate_argnums=0))
    d = jaxsane.doctor(exp, stages=["run"], run_steps=5, progress=False, compile_cache=False)
    assert d.complete and d.passed, [str(f) for f in d]
    update = np.asarray(d.artifacts["run"]["update_norm"])
    assert update.shape[0] == 5 and np.all(update > 0), update  # the inputs were kept before the step took them



def test_run_stage_samples_dead_units_as_asked_and_reuses_its_programs():
    exp = optax_experiment()
    with count_compilations() as c:
        d = jaxsane.doctor(exp, stages=["run"], run_steps=8, run_dead_every=4, run_eval_every=0, progress=False,
                           compile_cache=False)
    assert d.complete
    run = d.artifacts["run"]
    # the full mode's extra measurement only where it was asked for; the norms at every step
    assert [int(s) for s in run["dead_steps"]] == [0, 4], run["dead_steps"]
    assert [int(s) for s in run["tele_steps"]] == list(range(8)), run["tele_steps"]
    with count_compilations() as again:  # the same run once more: everything reused, nothing compiled twice
        jaxsane.doctor(exp, stages=["run"], run_steps=8, run_dead_every=4, run_eval_every=0, progress=False,
                       compile_cache=False)
    assert again.compiles < c.compiles


@pytest.mark.parametrize("grows", [True, False])
def test_run_stage_returns_freed_host_memory_every_few_steps_once_it_grew(monkeypatch, grows):
    from jaxsane._core import host_memory
    from jaxsane._doctor import run_stage

    calls = []  # (after the test above, which counts the compiles of a first run of this experiment)
    monkeypatch.setattr(host_memory, "release_free_memory", lambda: calls.append(1) or True)
    resident = iter(range(0, 10**6 * host_memory.GROWTH, host_memory.GROWTH if grows else 1))
    monkeypatch.setattr(host_memory, "resident_bytes", lambda: next(resident))
    d = jaxsane.doctor(optax_experiment(), stages=["run"], run_steps=9, progress=False, compile_cache=False)
    assert d.complete and len(d.artifacts["run"]["loss"]) == 9
    # after steps 3 and 7 while the process grows, else only the first time (nothing new to return); and doctor's
    # own release after the stage (a Releaser of its own: its first)
    assert len(calls) - 1 == (9 // run_stage.RELEASE_EVERY if grows else 1) == (2 if grows else 1), calls

def _cli(tmp_path, *args, **env):
    target = "tests._programs:optax_experiment"
    out = tmp_path / "d.json"
    full_env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": ROOT, **env}
    proc = subprocess.run([sys.executable, "-m", "jaxsane.cli", "doctor", target, "--stages", "step", "-q",
                           "--json", str(out), *args], capture_output=True, text=True, timeout=300, env=full_env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


@pytest.mark.subprocess
@pytest.mark.slow
def test_doctor_cli_fills_the_cache_and_no_cache_leaves_it_alone(tmp_path):
    cache = tmp_path / "cache"
    payload = _cli(tmp_path, JAXSANE_CACHE="1", JAXSANE_CACHE_DIR=str(cache))
    assert payload["compile_cache"] == str(cache) and len(os.listdir(cache)) > 0
    off = tmp_path / "off"
    payload = _cli(tmp_path, "--no-cache", JAXSANE_CACHE="1", JAXSANE_CACHE_DIR=str(off))
    assert payload["compile_cache"] is None and not off.exists()
    payload = _cli(tmp_path, JAXSANE_CACHE="0", JAXSANE_CACHE_DIR=str(off))
    assert payload["compile_cache"] is None and not off.exists()


def test_progress_writes_plain_lines_off_a_terminal_and_nothing_when_off():
    import io

    from jaxsane._render.progress import Progress
    out = io.StringIO()
    with Progress(True, "overfit", stream=out) as p:
        p.say("compiling")
        p.say("done")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("[jaxsane] overfit: compiling (") and lines[1].endswith(" s)")
    quiet = io.StringIO()
    with Progress(False, "overfit", stream=quiet) as p:
        p.say("compiling")
    assert quiet.getvalue() == ""


@pytest.mark.slow
def test_standalone_overfit_and_init_scale_sweep_show_progress(capfd):
    exp = optax_experiment()
    jaxsane.overfit(exp, seeds=1, steps=25, learning_rates=(1e-2,), baseline=False)
    err = capfd.readouterr().err
    assert "[jaxsane] overfit: compiling the sweep program" in err and "configuration(s) fit in" in err
    jaxsane.overfit(exp, seeds=1, steps=25, learning_rates=(1e-2,), baseline=False, progress=False)
    assert "[jaxsane] overfit" not in capfd.readouterr().err
    jaxsane.init_scale_sweep(exp, scales=(0.5, 1.0))
    assert "[jaxsane] init_scale_sweep: compiling" in capfd.readouterr().err
    jaxsane.init_scale_sweep(exp, scales=(0.5, 1.0), progress=False)
    assert "[jaxsane]" not in capfd.readouterr().err
    with pytest.raises(jaxsane.JaxsaneError, match=r"\[jaxsane\].*progress"):
        jaxsane.overfit(exp, progress="yes")


def test_doctor_compiles_the_overfit_sweep_in_the_background_once(monkeypatch):
    import threading

    from jaxsane._doctor import pipeline as _pipeline
    calls = []
    real = _pipeline.plan_overfit

    def spy(*args, **kwargs):
        calls.append(threading.current_thread().name)
        return real(*args, **kwargs)
    monkeypatch.setattr(_pipeline, "plan_overfit", spy)
    d = jaxsane.doctor(optax_experiment(), stages=["step", "overfit"], overfit_steps=25, progress=False,
                       compile_cache=False)
    assert d.complete
    assert len(calls) == 1 and calls[0].startswith("jaxsane-precompile"), calls  # planned once, off the main thread
    assert d.artifacts["overfit"].compiles == 1
    # the step stage counts only its own thread's compilations: the background compiles are not its own
    assert "step.recompiles" not in {f.code for f in d}


def test_doctor_plans_the_sweep_again_when_the_background_plan_failed(monkeypatch):
    from jaxsane._doctor import pipeline as _pipeline
    real, failures = _pipeline.plan_overfit, []

    def flaky(*args, **kwargs):
        if not failures:
            failures.append(1)
            raise RuntimeError("planned in the background and failed")
        return real(*args, **kwargs)
    monkeypatch.setattr(_pipeline, "plan_overfit", flaky)
    d = jaxsane.doctor(optax_experiment(), stages=["overfit"], overfit_steps=25, progress=False, compile_cache=False)
    assert d.complete and failures == [1] and d.artifacts["overfit"].compiles == 1


def test_compiles_per_stage_in_the_json_and_the_summary():
    import dataclasses

    from _programs import optax_step
    def fresh_experiment():  # a step no earlier call compiled
        return dataclasses.replace(optax_experiment(), step=jax.jit(lambda state, b: optax_step(state, b)))

    # once per process, jaxsane probes its compiler options and jax compiles its eager init ops: warm them first,
    # so the counts below are this program's own whatever ran before in this process (the fast tier, alone)
    jaxsane.doctor(fresh_experiment(), stages=["step", "overfit"], overfit_steps=25, progress=False, compile_cache=False)
    exp = fresh_experiment()
    d = jaxsane.doctor(exp, stages=["step", "overfit"], overfit_steps=25, progress=False, compile_cache=False)
    payload = json.loads(d.to_json())
    by_name = {s["name"]: s for s in payload["stages"]}
    assert by_name["step"]["compiles"] >= 1 and by_name["step"]["compile_seconds"] > 0
    # while the step stage ran: the overfit sweep and the init-scale sweep; the check that apply agrees with the
    # step's loss runs in the overfit stage on the step stage's batch, where the user's step is compiled already
    assert payload["compiles"]["background"] == 2, (payload["compiles"], str(d))
    assert "compiles per stage: step " in str(d) and "2 in the background" in str(d)
    step_shapes = exp.step._cache_size()  # the user's step: compiled for the first batch only, not the sweep's
    assert step_shapes == 1, step_shapes
    with count_compilations() as c:  # the accounting sees what a compile counter sees
        again = jaxsane.doctor(exp, stages=["step"], progress=False, compile_cache=False)
    assert sum(s["compiles"] for s in again.stages) + again.artifacts["compiles"]["setup"] == c.compiles


def test_html_stage_table_shows_what_each_stage_compiled():
    from jaxsane._render.html import _stages_table

    class D:
        artifacts = {"stages": [{"name": "step", "status": "ran", "seconds": 1.0, "reason": "", "compiles": 2,
                                 "compile_seconds": 0.5},
                                {"name": "data", "status": "ran", "seconds": 0.1, "reason": "", "compiles": 0}]}
    page = _stages_table(D())
    assert "1.0 s (2 compiled, 0.5 s)" in page and "0.1 s</td>" in page


@pytest.mark.subprocess
@pytest.mark.slow
def test_bundled_digits_read_without_importing_sklearn_match_load_digits():
    code = ("import sys; from jaxsane.examples._digits import load_digits_arrays; d, t = load_digits_arrays(); "
            "print('sklearn' in sys.modules, d.shape, t.shape)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.stdout.split() == ["False", "(1797,", "64)", "(1797,)"], proc.stdout + proc.stderr
    from sklearn.datasets import load_digits

    from jaxsane.examples._digits import load_digits_arrays
    data, target = load_digits_arrays()
    reference = load_digits()
    np.testing.assert_array_equal(data, reference.data)
    np.testing.assert_array_equal(target, reference.target)


def _masked_sequence_experiment(honours_mask: bool):
    """A per-position regression over [B, T] float inputs with a padding mask (the last 3 positions of every row
    are padding); the loss weights by the mask, or (the bug) averages over every position."""
    rng = np.random.default_rng(0)
    mask = np.ones((8, 12), np.float32)
    mask[:, -3:] = 0.0
    batch = {"x": rng.normal(size=(8, 12, 4)).astype(np.float32), "y": rng.normal(size=(8, 12)).astype(np.float32)}
    batch["mask"] = mask

    def loss(p, b):
        err = ((b["x"] @ p["w"])[..., 0] - b["y"]) ** 2
        return (err * b["mask"]).sum() / b["mask"].sum() if honours_mask else err.mean()

    def step(p, b):
        value, g = jax.value_and_grad(loss)(p, b)
        return jax.tree_util.tree_map(lambda a, d: a - 0.1 * d, p, g), {"loss": value}

    return jaxsane.Experiment(
        init=lambda key: {"w": jax.random.normal(key, (4, 1))},
        step=step,
        train=batch,
        loss=loss,
        inputs=lambda b: b["x"],
        labels=lambda b: b["y"],
        mask=lambda b: b["mask"],
        params=lambda s: s,
    )


@pytest.mark.parametrize("honours_mask", [True, False])
def test_the_padding_probe_evaluates_the_loss_program_the_init_stage_compiled(honours_mask):
    exp = _masked_sequence_experiment(honours_mask)
    d = jaxsane.doctor(exp, stages=["init", "batch"], progress=False, compile_cache=False)
    by_name = {s["name"]: s for s in json.loads(d.to_json())["stages"]}
    assert by_name["batch"]["compiles"] == 0, str(d)  # the train batch's shape: the init stage's loss program
    assert ("seq.padding_in_loss" in {f.code for f in d.findings}) is not honours_mask, str(d)


def test_a_float32_reverse_mode_gradient_check_runs_the_run_telemetrys_program(caplog):
    """On a large step's plan (float32, reverse mode, the telemetry's examples) the grads stage takes its gradient
    from the run's telemetry program: the model's backward pass compiles once, not also as the check's own."""
    import logging

    options = dict(grads_modes=("rev",), grads_batch_size=4, run_telemetry_examples=4, run_steps=4,
                   run_eval_every=0, progress=False, compile_cache=False)
    compiled = {}
    for float64 in (False, True):
        caplog.clear()
        # the global flag, not jax.log_compiles (a thread-local context): the check compiles in doctor's background
        # thread or on its main thread, whichever comes to it first
        jax.config.update("jax_log_compiles", True)
        try:
            with caplog.at_level(logging.WARNING, logger="jax"):
                d = jaxsane.doctor(optax_experiment(), stages=["grads", "run"], grads_float64=float64, **options)
        finally:
            jax.config.update("jax_log_compiles", False)
        assert d.complete and d.passed, [str(f) for f in d]
        compiled[float64] = re.findall(r"Finished XLA compilation of jit\((\w+)\)", caplog.text)
    assert compiled[False].count("telemetry") == 1 and "autodiff" not in compiled[False], compiled[False]
    assert "autodiff" in compiled[True], compiled[True]  # a float64 check differentiates on its own arguments
