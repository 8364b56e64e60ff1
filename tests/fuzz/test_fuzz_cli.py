"""Fuzzed command lines: random ``-o NAME=VALUE`` strings, output paths, stage names, targets and dump
directories, run through ``jaxsane.cli.main`` in this process. Every one exits 0, 1 or 2, a usage error
with one ``[jaxsane]`` line, and nothing prints a traceback."""

import atexit
import contextlib
import functools
import io
import json
import os
import re
import shutil
import sys
import tempfile
import textwrap

import numpy as np
import pytest
from _fuzz import Hang, fuzz_settings, time_limit
from hypothesis import event, given
from hypothesis import strategies as st

import jaxsane
from jaxsane import cli
from jaxsane._doctor.options import OPTIONS, STAGE_NAMES

pytestmark = pytest.mark.slow

_PROGRAM = """
import jax.numpy as jnp, numpy as np, jaxsane
def step(state, batch):
    return state - 0.1 * jnp.mean(batch["x"]), {"loss": jnp.mean((state - batch["x"]) ** 2)}
EXP = jaxsane.Experiment(init=lambda key: jnp.zeros(()), step=step, params=lambda s: s,
                         train={"x": np.ones((4,), np.float32), "y": np.zeros(4, np.int32)})
BAD = jaxsane.Experiment(init=lambda key: jnp.zeros(()), step=step, params=lambda s: s,
                         train={"x": np.array([1.0, np.nan, 1.0, 1.0], np.float32), "y": np.zeros(4, np.int32)})
def make():
    return EXP
def needs_args(n_layers):
    return EXP
def raises():
    raise RuntimeError("no data here")
NOT_AN_EXPERIMENT = 3
"""


@functools.cache
def _workspace() -> str:
    """A directory with the target programs, broken ones, a dump and a file that is no program."""
    root = tempfile.mkdtemp(prefix="jaxsane-fuzz-cli-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    files = {
        "fuzz_prog.py": _PROGRAM,
        "fuzz_syntax.py": "x = 1\ndef broken(:\n    pass\n",
        "fuzz_raises.py": "raise RuntimeError('at import')\n",
        "notes.txt": "not a program\n",
    }
    for name, source in files.items():
        with open(os.path.join(root, name), "w") as fh:
            fh.write(textwrap.dedent(source))
    os.mkdir(os.path.join(root, "a_dir"))
    jaxsane.save_dump(os.path.join(root, "dump"), (np.float32(0.0), {"x": np.ones(4, np.float32)}))
    jaxsane.save_dump(os.path.join(root, "nan_dump"), (np.float32(np.nan), {"x": np.ones(4, np.float32)}))
    os.mkdir(os.path.join(root, "damaged"))
    with open(os.path.join(root, "damaged", "tree.json"), "w") as fh:
        fh.write("{")
    return root


SAFE_TEXT = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=30
)  # what a shell can pass: no NUL, no lone surrogates


def _targets(root: str):
    prog = os.path.join(root, "fuzz_prog.py")
    crafted = [
        f"{prog}:EXP", f"{prog}:make", f"{prog}:needs_args", f"{prog}:raises", f"{prog}:NOT_AN_EXPERIMENT",
        f"{prog}:missing", f"{os.path.join(root, 'fuzz_syntax.py')}:EXP", f"{os.path.join(root, 'fuzz_raises.py')}:EXP",
        f"{os.path.join(root, 'notes.txt')}:EXP", f"{os.path.join(root, 'a_dir')}:EXP", f"{root}/nope.py:EXP",
        "fuzz_prog:EXP", "zz_fuzz_missing_module:EXP", "jaxsane.examples:EXAMPLES", "jaxsane..x:y", ".rel:x",
        "no_colon", ":", "a:", ":b", "os.path:sep", "jaxsane:__version__",
    ]
    good = st.sampled_from([f"{prog}:EXP", f"{prog}:make", "fuzz_prog:EXP"])
    odd = SAFE_TEXT.map(lambda t: "zz_fuzz_" + t if ":" in t and "/" not in t else t)
    return st.one_of(good, good, good, st.sampled_from(crafted), odd)


def _option_values():
    number = st.one_of(st.integers(-(10**30), 10**30).map(str), st.floats().map(repr),
                       st.sampled_from(["nan", "inf", "-inf", "1e400", "0x10", "1_000", "", " ", "none", "null",
                                        "true", "False", "yes", "0", "-1", "1,2", "[1,2]", "(3,)", "[]", "1,,2",
                                        "plateau_rel:0.02", "a:b:c", "{}", '{"a": 1}', '{"a": {"b": 1}}', "[1",
                                        "{" * 5000, '{"a":' + "[" * 30000 + "1" + "]" * 30000 + "}", "1e-3,1e-2",
                                        "[" * 30000]))
    return st.one_of(number, SAFE_TEXT)


def _outputs(root: str):
    good = SAFE_TEXT.map(lambda t: os.path.join(root, "f" + t.replace("/", "_")[:60] + ".out"))
    return st.one_of(
        good,
        good,
        st.sampled_from([
            os.path.join(root, "out", "d.json"), os.path.join(root, "a_dir"), os.path.join(root, "notes.txt", "x.json"),
            os.path.join(root, "x" * 300 + ".json"), os.path.join(root, "sp ace é\n.json"), "/", "",
            "/proc/self/nope.json", os.path.join(root, "ok.json"),
        ]),
        SAFE_TEXT.map(lambda t: os.path.join(root, t)),
    )


@st.composite
def doctor_argv(draw):
    """A command line valid but for the parts drawn to be fuzzed (so most reach the doctor run)."""
    root = _workspace()
    fuzzed = set(draw(st.lists(st.sampled_from(["target", "option", "output", "stages", "flag"]), min_size=1,
                               max_size=2)))
    prog = os.path.join(root, "fuzz_prog.py")
    targets = [draw(st.sampled_from([f"{prog}:EXP", f"{prog}:BAD", f"{prog}:make", "fuzz_prog:EXP"]))]
    if "target" in fuzzed:
        targets = draw(st.lists(_targets(root), min_size=1, max_size=2))
    argv = ["doctor", *targets]
    if "option" in fuzzed:
        names = st.one_of(st.sampled_from(sorted(OPTIONS)), st.sampled_from(sorted(OPTIONS)), SAFE_TEXT)
        for _ in range(draw(st.integers(1, 3))):
            raw = draw(st.integers(0, 4)) == 0
            argv += ["-o", draw(SAFE_TEXT) if raw else f"{draw(names)}={draw(_option_values())}"]
    stages = ["data"]
    if "stages" in fuzzed:  # only the data stage runs for real (seconds); other names are there to be refused
        stages = draw(st.lists(st.sampled_from(["data", "nope", "Data", "", "data,init", "-q"]), max_size=2))
    argv += ["--stages", *stages]
    if "stages" in fuzzed and draw(st.booleans()):
        argv += ["--skip", draw(st.sampled_from(["grads", "nope", "data"]))]
    if "output" in fuzzed:
        for flag in draw(st.lists(st.sampled_from(["--json", "--html"]), min_size=1, max_size=2, unique=True)):
            argv += [flag, draw(_outputs(root))]
    if "flag" in fuzzed:
        argv.append(draw(st.sampled_from(["--no-cache", "--bogus", "-o", "--stages", "--json", "-h", "--", "-"])))
    argv.append("-q")
    return argv


@st.composite
def replay_argv(draw):
    root = _workspace()
    dump = draw(st.one_of(
        st.sampled_from([os.path.join(root, n) for n in ("dump", "nan_dump", "damaged", "a_dir", "notes.txt", "missing")] + [""]),
        SAFE_TEXT,
    ))
    argv = ["replay", dump]
    if draw(st.integers(0, 5)):
        # a factory that raises included: replay names the user's exception and exits 2
        targets = _targets(root)
        argv += ["--step", draw(st.one_of(st.just(f"{os.path.join(root, 'fuzz_prog.py')}:step"), targets))]
    return argv


def _run(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(_workspace())
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), time_limit(120):
            try:
                rc = cli.main(argv)
            except SystemExit as e:  # main returns its code; a SystemExit escaping it is a finding too
                rc = f"SystemExit({e.code!r})"
    finally:
        os.chdir(cwd)
        sys.path[:] = [p for p in sys.path if p != _workspace()]
    return rc, out.getvalue(), err.getvalue()


def _check(argv):
    try:
        rc, out, err = _run(argv)
    except Hang as e:
        pytest.fail(f"jaxsane {argv} hung: {e}")
    event(f"exit {rc}")
    if rc == 2:
        last = (err.strip().splitlines() or [""])[-1]
        words = re.sub(r"'[^']*'|\"[^\"]*\"|/\S*", "_", last.removeprefix("[jaxsane] usage error: ")).split()
        event("usage error: " + " ".join(words[:4]))
    assert rc in (0, 1, 2), (argv, rc, err[-2000:])
    assert "Traceback" not in out + err, (argv, err[-3000:])
    if rc == 2:
        lines = [line for line in err.splitlines() if line.strip()]
        assert lines and lines[-1].startswith("[jaxsane]"), (argv, err[-2000:])


@given(argv=doctor_argv())
@fuzz_settings(1000)
def test_random_doctor_command_lines_exit_0_1_or_2_without_a_traceback(argv):
    _check(argv)


@given(argv=replay_argv())
@fuzz_settings(250)
def test_random_replay_command_lines_exit_0_1_or_2_without_a_traceback(argv):
    _check(argv)


def test_the_workspace_dump_is_valid():
    assert json.loads(open(os.path.join(_workspace(), "dump", "tree.json")).read())["format"].startswith("jaxsane")
