"""The CLI's exit codes (0 healthy, 1 error findings, 2 usage errors), run as a subprocess."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

FAST = ["--stages", "data", "init", "run", "-o", "run_steps=6"]


def run_cli(*args, cwd=None, timeout=300):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "jaxsane.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


@pytest.mark.subprocess
@pytest.mark.slow
def test_healthy_example_exits_0(tmp_path):
    out = tmp_path / "d.json"
    proc = run_cli("doctor", "jaxsane.examples.digits_linen:experiment", *FAST, "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    payload = json.loads(out.read_text())
    assert payload["ok"] is True and payload["name"] == "digits_linen"


@pytest.mark.subprocess
@pytest.mark.slow
def test_planted_bug_exits_1_and_names_it(tmp_path):
    out = tmp_path / "d.json"
    proc = run_cli("doctor", "jaxsane.examples.where_nan:experiment", *FAST, "--json", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    codes = {f["code"] for f in json.loads(out.read_text())["findings"]}
    assert codes & {"nonfinite.backward", "nonfinite.update"}, codes
    assert "nonfinite" in proc.stdout


@pytest.mark.subprocess
@pytest.mark.slow
def test_file_target(tmp_path):
    script = tmp_path / "my_exp.py"
    script.write_text(textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np, jaxsane
        def step(state, batch):
            return state - 0.1 * jnp.mean(batch["x"]), {"loss": jnp.mean((state - batch["x"]) ** 2)}
        EXP = jaxsane.Experiment(init=lambda key: jnp.zeros(()), step=step, params=lambda state: state,
                                 train={"x": np.ones((4,), np.float32), "y": np.zeros(4, np.int32)})
    """))
    # params= lets the run stage find the parameters; without it the run stage cannot run, and a stage that
    # did not run no longer passes the gate (issue 20) -- see test_skipped_stage_does_not_pass_the_gate
    proc = run_cli("doctor", f"{script}:EXP", "--stages", "data", "run", "-o", "run_steps=3", "-q")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == ""


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("args,needle", [
    (("doctor", "no_such_module_xyz:exp"), "cannot import"),
    (("doctor", "jaxsane.examples:EXAMPLES"), "not a jaxsane.Experiment"),
    (("doctor", "missing_colon"), "MODULE:ATTR"),
    (("doctor", "jaxsane.examples.digits_linen:experiment", "--stages", "nope"), "unknown doctor stage"),
    (("frobnicate",), "invalid choice"),
])
def test_usage_errors_exit_2(args, needle):
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert needle in proc.stderr


# ----------------------------------------------------------------------------- arguments, options, targets

BAD_BEFORE_JAX = [
    (["doctor", "jaxsane.examples.digits_linen:experiment", "-o", "badformat"], "must look like NAME=VALUE"),
    (["doctor", "jaxsane.examples.digits_linen:experiment", "-o", "run_stepz=5"], "did you mean 'run_steps'"),
    (["doctor", "jaxsane.examples.digits_linen:experiment", "-o", "run_steps=abc"], "run_steps must be int"),
    (["doctor", "jaxsane.examples.digits_linen:experiment", "-o", "overfit_learning_rates=1e-3,x"],
     "overfit_learning_rates must be tuple[float, ...] | None"),
    (["doctor", "jaxsane.examples.digits_linen:experiment", "--stages", "nope"], "unknown doctor stage"),
    (["doctor", "no_such_module_xyz:exp"], "cannot import"),
    (["doctor", "missing/file.py:exp"], "no such file"),
    (["doctor", "missing_colon"], "MODULE:ATTR"),
    (["doctor", "jaxsane.examples.digits_linen:experiment", "--json", "/no/such/dir/d.json"], "does not exist"),
    (["doctor", "jaxsane.examples.digits_linen:experiment", "--html", "/no/such/dir/r.html"], "does not exist"),
]


@pytest.mark.subprocess
def test_argument_errors_are_reported_before_jax_is_imported():
    # one interpreter for all cases: each must exit 2 with one [jaxsane] line, and jax must stay unimported
    code = textwrap.dedent(f"""
        import contextlib, io, sys
        import jaxsane.cli as cli
        for argv, needle in {BAD_BEFORE_JAX!r}:
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                rc = cli.main(argv)
            lines = err.getvalue().splitlines()
            assert rc == 2, (argv, rc, err.getvalue())
            assert len(lines) == 1 and lines[0].startswith("[jaxsane]") and needle in lines[0], (argv, lines)
            assert "jax" not in sys.modules, ("jax imported", argv)
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_option_values_are_parsed_per_type():
    from jaxsane.cli import UsageError, _parse_options
    opts = _parse_options(["overfit_learning_rates=1e-3,1e-2", "run_steps=7", "data_max_batches=none"])
    assert opts == {"overfit_learning_rates": (0.001, 0.01), "run_steps": 7, "data_max_batches": None}
    with pytest.raises(UsageError, match="NAME=VALUE"):
        _parse_options(["=3"])


def _write(tmp_path, name, source):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


@pytest.mark.parametrize("source,attr,needles", [
    ("x = 1\ndef broken(:\n    pass\n", "EXP", ["SyntaxError", "bad_syntax.py:2"]),
    ("import os\nraise RuntimeError('no data here')\n", "EXP", ["RuntimeError: no data here", "bad_syntax.py:2"]),
    ("def make(n_layers):\n    return None\n", "make", ["needs arguments ['n_layers']"]),
    ("def make():\n    return {}['missing']\n", "make", ["KeyError", "bad_syntax.py:2"]),
])
def test_broken_targets_exit_2_with_the_users_error_and_line(tmp_path, capsys, source, attr, needles):
    from jaxsane.cli import main
    path = _write(tmp_path, "bad_syntax.py", source)
    assert main(["doctor", f"{path}:{attr}", "-q"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[jaxsane] usage error:"), captured.err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "Traceback" not in captured.err + captured.out


def test_crashing_step_exits_1_with_the_crash_named(tmp_path):
    path = _write(tmp_path, "crashing.py", """
        import jax.numpy as jnp, numpy as np, jaxsane
        def step(state, batch):
            raise ValueError("the step is broken")
        EXP = jaxsane.Experiment(init=lambda key: jnp.zeros(()), step=step,
                                 train={"x": np.ones((4,), np.float32), "y": np.zeros(4, np.int32)})
    """)
    out = tmp_path / "d.json"
    from jaxsane.cli import main
    assert main(["doctor", f"{path}:EXP", "--stages", "data", "run", "-q", "--json", str(out)]) == 1
    payload = json.loads(out.read_text())
    crash = [f for f in payload["findings"] if f["code"] == "doctor.user_code_crashed"]
    assert len(crash) == 1 and "the step is broken" in crash[0]["message"] and crash[0]["line"] == 4
    assert payload["complete"] is False and [s["status"] for s in payload["stages"]] == ["ran", "crashed"]
    assert set(payload["timings"]) == {"data", "run"}


def test_skipped_stage_does_not_pass_the_gate(tmp_path):
    path = _write(tmp_path, "no_loss.py", """
        import jax.numpy as jnp, numpy as np, jaxsane
        def step(state, batch):
            return state - 0.1 * jnp.mean(batch["x"]), {"loss": jnp.mean((state - batch["x"]) ** 2)}
        EXP = jaxsane.Experiment(init=lambda key: jnp.zeros(()), step=step,
                                 train={"x": np.ones((4,), np.float32), "y": np.zeros(4, np.int32)})
    """)
    from jaxsane.cli import main
    assert main(["doctor", f"{path}:EXP", "--stages", "data", "grads", "-q"]) == 1  # grads needs Experiment.loss
    assert main(["doctor", f"{path}:EXP", "--stages", "data", "-q"]) == 0


# ---- jaxsane replay on a guarded NNX step's dump (in process: the dump is written by the same test)

_EXPERIMENT = '''
import jaxsane
EXP = jaxsane.Experiment(init=lambda key: make_objects(), step=train_step, train=batch())
'''


@pytest.mark.parametrize("form", ["like", "module_experiment", "experiment_function", "step_experiment"])
def test_replay_of_an_nnx_dump_finds_the_live_origin(tmp_path, capsys, form):
    from _programs import nnx_log_dump

    from jaxsane import cli
    extra = {"like": "", "module_experiment": _EXPERIMENT, "step_experiment": _EXPERIMENT,
             "experiment_function": _EXPERIMENT.replace("EXP = ", "def experiment():\n    return ")}[form]
    module, err = nnx_log_dump(tmp_path, extra)
    origin = err.located.origins[0]
    file = os.path.join(str(tmp_path), "user_nnx_step.py")
    args = ["replay", err.dump_path, "--step", f"{file}:{'EXP' if form == 'step_experiment' else 'train_step'}"]
    if form == "like":
        args += ["--like", f"{file}:make_objects"]
    assert cli.main(args) == 1
    out = capsys.readouterr().out
    assert f"log (forward) at user_nnx_step.py:{origin.line}" in out, out


def test_replay_of_an_nnx_dump_with_nothing_to_rebuild_the_objects_exits_2_saying_how(tmp_path, capsys):
    from _programs import nnx_log_dump

    from jaxsane import cli
    module, err = nnx_log_dump(tmp_path)
    file = os.path.join(str(tmp_path), "user_nnx_step.py")
    assert cli.main(["replay", err.dump_path, "--step", f"{file}:train_step"]) == 2
    err_text = capsys.readouterr().err
    assert err_text.startswith(
        f"[jaxsane] the dump at {err.dump_path} holds NNX objects (args[0]: user_nnx_step.LogMLP, args[1]: "
        "flax.nnx.Optimizer); their classes cannot be rebuilt from data (a dump never imports a class). Pass "
        "like=(model, optimizer, batch) built as in your training script to jaxsane.load_dump, or replay with "
        "--step module:experiment, or --like module:make_objects"), err_text
    assert "Traceback" not in err_text


_FACTORIES = """
def make_seeded(seed=0, *extra, **options):
    return make_objects()

def make_broken(seed=0):
    raise ValueError("no checkpoint at /nowhere")  # BROKEN_LIKE

def experiment_broken():
    return {}["missing"]  # BROKEN_STEP
"""


def _line_of(file, tag):
    with open(file) as fh:
        return next(i + 1 for i, text in enumerate(fh) if text.rstrip().endswith(f"# {tag}"))


def test_replay_calls_a_like_factory_whose_parameters_all_have_defaults(tmp_path, capsys):
    from _programs import nnx_log_dump

    from jaxsane import cli
    module, err = nnx_log_dump(tmp_path, _FACTORIES)
    file = os.path.join(str(tmp_path), "user_nnx_step.py")
    assert cli.main(["replay", err.dump_path, "--step", f"{file}:train_step", "--like", f"{file}:make_seeded"]) == 1
    out = capsys.readouterr().out
    assert f"log (forward) at user_nnx_step.py:{err.located.origins[0].line}" in out, out


@pytest.mark.parametrize("flag", ["--like", "--step"])
def test_replay_whose_factory_raises_names_the_users_exception_and_line_and_exits_2(tmp_path, capsys, flag):
    from _programs import nnx_log_dump

    from jaxsane import cli
    module, err = nnx_log_dump(tmp_path, _FACTORIES)
    file = os.path.join(str(tmp_path), "user_nnx_step.py")
    if flag == "--like":
        args, kind, text, tag = ["--step", f"{file}:train_step", "--like", f"{file}:make_broken"], "ValueError", \
            "no checkpoint at /nowhere", "BROKEN_LIKE"
    else:
        args, kind, text, tag = ["--step", f"{file}:experiment_broken"], "KeyError", "'missing'", "BROKEN_STEP"
    assert cli.main(["replay", err.dump_path, *args]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and f"replay: your {flag} factory" in lines[0], captured.err
    assert f"{kind}: {text} at {file}:{_line_of(file, tag)}" in lines[0], lines[0]
    assert "Traceback" not in captured.err + captured.out and "[jaxsane] [jaxsane]" not in lines[0]


@pytest.mark.slow
def test_the_init_scale_sweep_runs_only_for_the_html_report_that_draws_it(tmp_path, monkeypatch):
    from jaxsane import cli
    from jaxsane._doctor import pipeline as _pipeline
    calls = []
    real = _pipeline.plan_init_scale_sweep

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(_pipeline, "plan_init_scale_sweep", spy)
    target = "jaxsane.examples.digits_optax:experiment"
    common = ["doctor", target, "--stages", "overfit", "-o", "overfit_steps=25", "-q", "--no-cache"]
    assert cli.main([*common, "--json", str(tmp_path / "d.json")]) == 0
    assert calls == []  # nothing would have drawn it
    page = tmp_path / "r.html"
    assert cli.main([*common, "--html", str(page)]) == 0
    assert calls and 'class="plot init-scales"' in page.read_text()


# ---- found by the fuzz tier (tests/fuzz/test_fuzz_cli.py): each is one [jaxsane] line and exit 2, no traceback

def test_argparse_errors_are_jaxsane_usage_errors(capsys):
    from jaxsane.cli import main
    assert main(["doctor", "--bogus"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "[jaxsane] usage error: unrecognized arguments: --bogus", err


@pytest.mark.parametrize("pair, needle", [
    ("run_thresholds={\"a\":" + "[" * 30000 + "1" + "]" * 30000 + "}", "run_thresholds must be dict"),
    ("init_loss_rtol=nan", "init_loss_rtol must be a number, got nan"),
    ("overfit_learning_rates=1e-3,nan", "must be a number, got nan"),
])
def test_option_values_no_parser_can_read_are_usage_errors(pair, needle):
    from jaxsane.cli import UsageError, _parse_options
    with pytest.raises(UsageError, match=needle):
        _parse_options([pair])


def test_an_output_name_over_the_file_system_limit_is_refused_before_the_run(tmp_path, capsys):
    from jaxsane.cli import main
    long = str(tmp_path / ("x" * 300 + ".json"))
    assert main(["doctor", "no_such_module_xyz:exp", "--json", long]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("[jaxsane] usage error: --json: the file name xxxx") and "over this file system's limit" in err
