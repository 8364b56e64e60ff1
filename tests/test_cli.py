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


def test_healthy_example_exits_0(tmp_path):
    out = tmp_path / "d.json"
    proc = run_cli("doctor", "jaxsane.examples.digits_linen:experiment", *FAST, "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    payload = json.loads(out.read_text())
    assert payload["ok"] is True and payload["name"] == "digits_linen"


def test_planted_bug_exits_1_and_names_it(tmp_path):
    out = tmp_path / "d.json"
    proc = run_cli("doctor", "jaxsane.examples.where_nan:experiment", *FAST, "--json", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    codes = {f["code"] for f in json.loads(out.read_text())["findings"]}
    assert codes & {"nonfinite.backward", "nonfinite.update"}, codes
    assert "nonfinite" in proc.stdout


def test_file_target(tmp_path):
    script = tmp_path / "my_exp.py"
    script.write_text(textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np, jaxsane
        def step(state, batch):
            return state - 0.1 * jnp.mean(batch["x"]), {"loss": jnp.mean((state - batch["x"]) ** 2)}
        EXP = jaxsane.Experiment(init=lambda key: jnp.zeros(()), step=step,
                                 train={"x": np.ones((4,), np.float32), "y": np.zeros(4, np.int32)})
    """))
    proc = run_cli("doctor", f"{script}:EXP", "--stages", "data", "run", "-o", "run_steps=3", "-q")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == ""


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
