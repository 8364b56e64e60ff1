"""The post-mortem debugger at a NaN's origin (issue 19): ``jaxsane.post_mortem`` / ``debug_origin``, the
CLI's ``replay --pdb`` and ``JAXSANE_ON_NONFINITE=breakpoint`` in ``guard``, driven with scripted pdb input
(in this process through ``stdin=``/``stdout=``, and end to end in subprocesses reading a real stdin)."""

import io
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxsane

HERE = os.path.abspath(__file__)


def session(report, commands: str, **kw) -> tuple[bool, str]:
    out = io.StringIO()
    opened = jaxsane.post_mortem(report, stdin=io.StringIO(commands), stdout=out, **kw)
    return opened, out.getvalue()


def answers(text: str) -> list[str]:
    """What pdb printed after each prompt."""
    return [part.strip() for part in text.split("(Pdb) ")[1:]]


def frame_files(text: str) -> set[str]:
    """The files of the frames pdb showed (``> file(line)name()`` and ``where``'s ``  file(line)name()``)."""
    return set(re.findall(r"^[> ] (\S+?)\(\d+\)\S+\(\)$", text, flags=re.M))


def line_of(text: str) -> int:
    with open(HERE) as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


# ----------------------------------------------------------------------------- programs (their lines are asserted)

def _inner(x):
    return jnp.log(x)                                   # forward origin: log(0)


def _forward_step(x, scale):
    y = x * scale
    return _inner(y) * 2


def _loss(w, x):
    e = jnp.sum(x * w)
    return jnp.where(e > 0, jnp.sqrt(e), 0.0)           # backward origin: the double-where trap


@jax.jit
def _backward_step(w, x):
    return jax.grad(_loss)(w, x)


def _scan_step(c, xs):
    def body(c, x):
        return c + jnp.log(x), None                     # inside a scan body
    return jax.lax.scan(body, c, xs)[0]


_tx = optax.adam(1e-3, eps=0.0)


def _update_step(params, opt_state):
    grads = jax.tree.map(jnp.zeros_like, params)
    updates, opt_state = _tx.update(grads, opt_state, params)   # update origin: 0 / (sqrt(0) + 0)
    return optax.apply_updates(params, updates), opt_state


# ----------------------------------------------------------------------------- in this process

def test_forward_origin_stops_in_the_users_line_with_the_operands():
    report = jaxsane.locate(_forward_step, jnp.zeros(3), jnp.float32(2.0))
    opened, text = session(report, "p x\np in0\np result\np primitive, phase\nwhere\nup\np scale\nl\nc\n")
    assert opened
    line = line_of("return jnp.log(x)  ")
    assert f"> {HERE}({line})_inner()\n-> return jnp.log(x)" in text
    got = answers(text)
    assert got[0] == got[1] == "array([0., 0., 0.], dtype=float32)"           # the operand that made -inf
    assert got[2] == "array([-inf, -inf, -inf], dtype=float32)"
    assert got[3] == "('log', 'forward')"
    where = got[4]
    assert f"{HERE}({line_of('return _inner(y) * 2')})_forward_step()" in where
    assert f"{HERE}({line})_inner()" in where
    assert frame_files(text) == {HERE}                                          # the user's frames, no jax file
    assert got[6] == "array(2., dtype=float32)"                               # up: the step's own argument
    assert "->\t    return _inner(y) * 2" in got[7]                            # l: the user's source


def test_backward_origin_holds_the_primal_that_blew_up():
    report = jaxsane.locate(_backward_step, jnp.ones(3), jnp.zeros(3))
    assert report.origins[0].phase == "backward"
    opened, text = session(report, "p e\np primal_primitive\np primal_operands\np phase\nwhere\nc\n")
    got = answers(text)
    line = line_of("return jnp.where(e > 0, jnp.sqrt(e), 0.0)")
    assert opened and f"> {HERE}({line})_loss()" in text
    assert got[:4] == ["array(0., dtype=float32)", "'sqrt'", "[array(0., dtype=float32)]", "'backward'"]
    assert f"{HERE}({line_of('return jax.grad(_loss)(w, x)')})_backward_step()" in got[4]
    assert frame_files(text) == {HERE}


def test_scan_body_origin_has_the_iteration_index():
    report = jaxsane.locate(jax.jit(_scan_step), jnp.float32(1), jnp.array([1.0, 2.0, 0.0, 3.0]))
    opened, text = session(report, "p iteration\np x\nwhere\nup\np xs\np iteration\nc\n")
    got = answers(text)
    assert opened and f"> {HERE}({line_of('return c + jnp.log(x), None')})body()" in text
    assert got[0] == "2" and got[1] == "array(0., dtype=float32)"
    assert f"({line_of('return jax.lax.scan(body, c, xs)[0]')})_scan_step()" in got[2]
    assert got[4] == "array([1., 2., 0., 3.], dtype=float32)" and got[5] == "2"


def test_optimizer_update_origin():
    params = {"w": jnp.ones(2)}
    report = jaxsane.locate(_update_step, params, _tx.init(params))
    opened, text = session(report, "p phase\np primitive\np operands\np inputs[\"params['w']\"]\nwhere\nc\n")
    got = answers(text)
    assert opened and f"> {HERE}({line_of('updates, opt_state = _tx.update(grads')})_update_step()" in text
    assert got[0] == "'update'" and got[1] == "'div'"
    assert got[2] == "[array([0., 0.], dtype=float32), array([0., 0.], dtype=float32)]"
    assert got[3] == "array([1., 1.], dtype=float32)"
    assert frame_files(text) == {HERE}


def test_no_origin_no_debugger():
    opened, text = session(jaxsane.locate(lambda x: x + 1, jnp.ones(2)), "p 1\n")
    assert not opened and "(Pdb)" not in text
    assert text.startswith("[jaxsane] post_mortem: no debugger opened: every output is finite")
    bad = jaxsane.locate(lambda x: x * 2, jnp.array([jnp.nan, 1.0]))         # a NaN input: no line made it
    opened, text = session(bad, "p 1\n")
    assert not opened and "non-finite input" in text and "(Pdb)" not in text
    xla = jaxsane.LocateReport([], [("out", 1, 0)], xla_only=True)
    opened, text = session(xla, "p 1\n")
    assert not opened and "not reproduced outside XLA" in text and "(Pdb)" not in text


def test_bad_arguments_are_jaxsane_errors():
    with pytest.raises(jaxsane.ArgumentError, match=r"\[jaxsane\] jaxsane.post_mortem\(report=...\): expected a "
                                                    r"LocateReport"):
        jaxsane.post_mortem("report.txt")
    report = jaxsane.locate(_forward_step, jnp.zeros(3), jnp.float32(2.0))
    with pytest.raises(jaxsane.ArgumentError, match="origin"):
        jaxsane.post_mortem(report, origin=-1)
    opened, text = session(report, "c\n", origin=5)
    assert not opened and "origin=5 is out of range: the report has 1 origin(s)" in text


def test_source_names_are_never_guessed():
    from jaxsane._locate.debugger import source_names
    assert source_names("return jnp.log(x)", "log", 1) == {"x": 0}
    assert source_names("z = a / b  # ratio", "div", 2) == {"a": 0, "b": 1}
    assert source_names("return jnp.log(a) - jnp.log(b)", "log", 1) == {}          # two spots: no name
    assert source_names("return jnp.log(x + 1)", "log", 1) == {}                  # not a plain name
    assert source_names("y = x ** 2", "integer_pow", 1) == {"x": 0}


def test_breakpoint_is_only_read_from_the_environment():
    with pytest.raises(jaxsane.GuardConfigError, match=r"taken only from the environment, "
                                                       r"JAXSANE_ON_NONFINITE=breakpoint"):
        jaxsane.guard(_forward_step, on_nonfinite="breakpoint")


def test_stdin_alone_is_read_and_the_session_prints_to_stdout(capsys):
    report = jaxsane.locate(_forward_step, jnp.zeros(3), jnp.float32(2.0))
    assert jaxsane.post_mortem(report.origins[0], stdin=io.StringIO("p in0.shape\nc\n"))
    assert "(Pdb) (3,)" in capsys.readouterr().out


class _NoTerminal:
    def readline(self, *a):
        raise OSError("reading from stdin while output is captured")

    def isatty(self):
        return False


def test_breakpoint_without_a_terminal_still_raises(monkeypatch, capsys):
    monkeypatch.setenv("JAXSANE_ON_NONFINITE", "breakpoint")
    monkeypatch.setattr(sys, "stdin", _NoTerminal())
    guarded = jaxsane.guard(_forward_step, sync=True)
    with pytest.raises(jaxsane.NonFiniteError) as e:
        guarded(jnp.ones(3), jnp.float32(0.0))
    assert e.value.finding.extra["policy"] == "breakpoint"
    assert "the debugger could not run (OSError" in capsys.readouterr().out


# ----------------------------------------------------------------------------- end to end, a real stdin

def run(script: str, commands: str, *argv: str, cwd=None, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv] if argv else [sys.executable, script], input=commands,
                          capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})})


STEP = textwrap.dedent("""
    import jax, jax.numpy as jnp, jaxsane

    def step(w, batch):
        h = batch["x"] * w
        return w - 0.1 * jnp.log(h), {"loss": jnp.sum(h)}

    def fine(w, batch):
        return w, {"loss": jnp.sum(batch["x"])}
""")


@pytest.mark.subprocess
def test_debug_origin_reads_the_terminal(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(STEP + "jaxsane.debug_origin(step, jnp.ones(2), {'x': jnp.array([1.0, 0.0])})\nprint('DONE')\n")
    proc = run(str(script), "p h\np batch\nwhere\nc\n")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"> {script}(6)step()\n-> return w - 0.1 * jnp.log(h)" in out
    assert "(Pdb) array([1., 0.], dtype=float32)" in out and "{'x': array([1., 0.], dtype=float32)}" in out
    assert frame_files(out) == {str(script)} and out.rstrip().endswith("DONE")


@pytest.mark.subprocess
def test_cli_replay_pdb_on_a_guard_dump(tmp_path, monkeypatch, capsys):
    (tmp_path / "mystep.py").write_text(STEP)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    from mystep import step
    guarded = jaxsane.guard(step, dump_dir="dumps", sync=True, locate=False)     # a real dump, written by guard
    with pytest.raises(jaxsane.NonFiniteError) as e:
        guarded(jnp.ones(2), {"x": jnp.array([1.0, 0.0])})
    dump = e.value.dump_path
    proc = run("", "p h\np iteration\nwhere\nc\n", "-m", "jaxsane.cli", "replay", dump, "--step", "mystep:step",
               "--pdb", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "origin: log (forward) at mystep.py:6" in proc.stdout                 # the report first
    assert f"> {tmp_path / 'mystep.py'}(6)step()" in proc.stdout
    assert "(Pdb) array([1., 0.], dtype=float32)\n(Pdb) None" in proc.stdout
    from jaxsane.cli import main
    monkeypatch.setattr(sys, "stdin", _NoTerminal())                            # no debugger may read it
    assert main(["replay", dump, "--step", "mystep:fine", "--pdb"]) == 0
    out = capsys.readouterr().out
    assert "no origin, so no debugger opened" in out and "(Pdb)" not in out


@pytest.mark.subprocess
def test_environment_breakpoint_stops_in_a_guarded_loop_then_raises(tmp_path, monkeypatch, capsys):
    loop = textwrap.dedent("""
        g = jaxsane.guard(step)
        w = jnp.ones(2)
        try:
            for x in ([1.0, 2.0], [3.0, 1.0], [1.0, 0.0], [2.0, 2.0], [1.0, 1.0]):
                w, _ = g(w, {"x": jnp.array(x)})
            g.flush()
        except jaxsane.NonFiniteError as e:
            print("RAISED", e.finding.code, e.finding.step, e.finding.extra["policy"])
    """)
    script = tmp_path / "loop.py"
    script.write_text(STEP + loop)
    proc = run(str(script), "p batch['x']\np float(h[1]), iteration\nwhere\nc\n",
               env={"JAXSANE_ON_NONFINITE": "breakpoint"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert f"> {script}(6)step()" in out and "(Pdb) array([1., 0.], dtype=float32)\n(Pdb) (0.0, None)" in out
    assert frame_files(out) == {str(script)}
    assert out.rstrip().endswith("RAISED nonfinite.forward 2 breakpoint")
    # a NaN in the batch: nothing computed made it, so no debugger (here, in this process: it must not read stdin)
    monkeypatch.setenv("JAXSANE_ON_NONFINITE", "breakpoint")
    monkeypatch.setattr(sys, "stdin", _NoTerminal())
    exec(compile(STEP + loop.replace("[1.0, 0.0]", "[1.0, float('nan')]"), str(tmp_path / "loop2.py"), "exec"), {})
    out = capsys.readouterr().out
    assert "no debugger opened: the step's inputs already hold NaN/Inf" in out and "(Pdb)" not in out
    assert out.rstrip().endswith("RAISED nonfinite.input 2 breakpoint"), out
