"""The pytest plugin (issue 17), run on a throwaway project in a subprocess, as a user's suite runs it."""

import os
import pathlib
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

PROJECT = '''
import jax
import jax.numpy as jnp
import pytest

import jaxsane


def test_devices():
    assert len(jax.devices()) == 8


@pytest.mark.jaxsane_devices(16)
def test_needs_more_devices():
    raise AssertionError("must be skipped")


def test_check_fixture(jaxsane_check):
    jaxsane_check.assert_grads_match(lambda p, x: jnp.sum(jnp.sin(x @ p)), jnp.ones((3, 2)), jnp.ones((4, 3)))


def test_guard_fixture(jaxsane_guard):
    guarded = jaxsane_guard(lambda s, b: (s * b, {"loss": jnp.sum(s)}), locate=False)
    with pytest.raises(jaxsane.NonFiniteError):
        guarded(jnp.ones(2), jnp.array([1.0, jnp.nan]))
'''


def run_pytest(project: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # this suite's conftest set 8 devices
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    # loaded once, by -p, whether or not the installed package's pytest11 entry point would also load it
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "jaxsane.pytest_plugin", "-p", "no:cacheprovider",
                           "-q", "-rs", *args, str(project)], cwd=project, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.subprocess
@pytest.mark.slow
def test_devices_option_fixtures_and_marker(tmp_path):
    (tmp_path / "test_user.py").write_text(PROJECT)
    r = run_pytest(tmp_path, "--jaxsane-devices=8")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "3 passed, 1 skipped" in out and "run pytest with --jaxsane-devices=16" in out


@pytest.mark.subprocess
def test_without_the_option_nothing_changes(tmp_path):
    (tmp_path / "test_one.py").write_text("import jax, os\n\ndef test_one():\n"
                                          "    assert len(jax.devices()) == 1 and 'XLA_FLAGS' not in os.environ\n")
    r = run_pytest(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.subprocess
def test_too_late_is_a_clear_usage_error(tmp_path):
    (tmp_path / "conftest.py").write_text("import jax\njax.devices()\n")  # initialises the backend, 1 device
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    r = run_pytest(tmp_path, "--jaxsane-devices=8")
    assert r.returncode == 4, r.stdout + r.stderr  # pytest's usage-error exit code
    assert "[jaxsane] --jaxsane-devices=8: jax's CPU backend was already initialised" in r.stderr
    assert "move that into a fixture" in r.stderr


def test_the_entry_point_is_declared():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["pytest11"] == {"jaxsane": "jaxsane.pytest_plugin"}


@pytest.mark.subprocess
def test_loading_the_plugin_does_not_import_jax():
    code = "import sys, jaxsane.pytest_plugin; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
