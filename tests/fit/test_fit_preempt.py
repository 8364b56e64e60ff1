"""fit under SIGTERM and Ctrl-C (real signals, in a child process): stop at a step boundary, one verified
checkpoint, exit code 82 (Preempted), and a resume that equals an uninterrupted run bit for bit.

Every test waits for a line the child prints (never a fixed sleep) and kills only the process it started."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest
import test_fit as T

import jaxsane
from jaxsane._core.errors import EXIT_PREEMPTED
from jaxsane._fit import checkpoint as _ckpt, preempt


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
STEPS, EVERY = 30, 5
FIT = dict(steps=STEPS, checkpoint_every=EVERY, eval_every=0, **T.FIT)

CHILD = textwrap.dedent('''
    import json, os, signal, sys, threading, time
    sys.path.insert(0, {here!r})
    import test_fit as T, jaxsane
    from jaxsane._fit import checkpoint as _ckpt, preempt
    ckpt, mode = {ckpt!r}, {mode!r}

    if mode == "in_write":  # the signal arrives while the checkpoint of step 10 is being written
        real_save = _ckpt.Checkpoints.save
        def save(self, step, state, meta):
            real_save(self, step, state, meta)  # orbax writes on in its background thread
            if step == 10:
                os.kill(os.getpid(), signal.SIGTERM)
                print("SIGNALLED IN WRITE", flush=True)
        _ckpt.Checkpoints.save = save
    if mode == "twice":  # hold the graceful stop until the second Ctrl-C arrives
        real_stop = preempt.StopRequests.stop_here
        def stop_here(self, position):
            if not real_stop(self, position):
                return False
            print("STOPPING", flush=True)
            end = time.monotonic() + 120
            while time.monotonic() < end:
                threading.Event().wait(0.05)
            return True
        preempt.StopRequests.stop_here = stop_here
    try:
        result = jaxsane.fit(T.experiment(n={steps}, delay=0.1, announce=True), checkpoint_dir=ckpt,
                             report=os.path.join(os.path.dirname(ckpt), "report.html"), **{fit!r})
        print("finished", flush=True)
    except jaxsane.Preempted as e:
        print("PREEMPTED " + json.dumps(dict(step=e.step, checkpoint=e.checkpoint, signal=e.signal,
                                             losses=e.result.losses)), flush=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
        sys.exit(130)
''')


def _start(tmp_path, mode):
    ckpt = str(tmp_path / "ckpt")
    script = tmp_path / "train.py"
    fit = {k: v for k, v in FIT.items()}
    script.write_text(CHILD.format(here=HERE, ckpt=ckpt, mode=mode, steps=STEPS, fit=fit))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    return proc, ckpt


def _wait_for(proc, prefix, deadline_s=240):
    """Read the child's stdout until a line starting with ``prefix``; returns (that line, lines read)."""
    deadline = time.monotonic() + deadline_s
    lines = []
    for line in proc.stdout:
        lines.append(line)
        assert not line.startswith("finished"), "the run ended before the signal"
        if line.startswith(prefix):
            return line, lines
        assert time.monotonic() < deadline, f"no {prefix!r} line in time"
    raise AssertionError(f"the child exited before printing {prefix!r}: {lines[-5:]}")


def _finish(proc, timeout=120):
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)  # only the process this test started
            proc.wait(timeout=30)
    return out, err


def _uninterrupted():
    return jaxsane.fit(T.experiment(n=STEPS), **FIT)


def _assert_bitwise(resumed, whole):
    assert resumed.step == whole.step == STEPS
    assert resumed.history.steps == list(range(STEPS))
    assert resumed.losses == whole.losses  # the same floats, not close ones
    for a, b in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(whole.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _preempted_line(out):
    line = next(line for line in out.splitlines() if line.startswith("PREEMPTED "))
    return json.loads(line.removeprefix("PREEMPTED "))


@pytest.mark.subprocess
@pytest.mark.slow
def test_sigterm_mid_run_saves_a_verified_checkpoint_exits_82_and_resumes_bitwise(tmp_path):
    proc, ckpt = _start(tmp_path, "plain")
    _wait_for(proc, "batch 7")
    os.kill(proc.pid, signal.SIGTERM)
    out, err = _finish(proc)
    assert proc.returncode == EXIT_PREEMPTED == 82, (proc.returncode, err[-2000:])
    info = _preempted_line(out)
    step = info["step"]
    assert info["signal"] == "SIGTERM" and 8 <= step < STEPS
    assert info["checkpoint"] == os.path.join(ckpt, str(step)) and os.path.isdir(info["checkpoint"])
    assert f"SIGTERM: stopping after step {step}" in err
    assert "SIGTERM after step" in (tmp_path / "report.html").read_text()
    # the checkpoint of the stop step is intact, and the metrics file holds every step up to it once
    like = T.experiment(n=1)
    from jaxsane._experiment.contract import PureExperiment
    state = PureExperiment(like, key=jax.random.key(0)).init(jax.random.key(0))
    checkpoints = _ckpt.Checkpoints(ckpt, 3, state)
    try:
        assert not isinstance(checkpoints.verify(step), str)
    finally:
        checkpoints.close()
    logged = [json.loads(l)["step"] for l in open(os.path.join(ckpt, "metrics.jsonl")) if '"train"' in l]
    assert logged == list(range(step))
    resumed = jaxsane.fit(T.experiment(n=STEPS), checkpoint_dir=ckpt, **FIT)
    assert resumed.resumed_from == step and resumed.skipped_checkpoints == []
    whole = _uninterrupted()
    assert info["losses"] == whole.losses[:step]
    _assert_bitwise(resumed, whole)


@pytest.mark.subprocess
@pytest.mark.slow
def test_sigterm_while_a_checkpoint_is_written_stops_cleanly_and_resumes_bitwise(tmp_path):
    proc, ckpt = _start(tmp_path, "in_write")
    _wait_for(proc, "SIGNALLED IN WRITE")
    out, err = _finish(proc)
    assert proc.returncode == EXIT_PREEMPTED, (proc.returncode, err[-2000:])
    step = _preempted_line(out)["step"]
    assert step in (10, 11)  # the step whose checkpoint was being written, or the one after it
    resumed = jaxsane.fit(T.experiment(n=STEPS), checkpoint_dir=ckpt, **FIT)
    assert resumed.resumed_from == step and resumed.skipped_checkpoints == []
    _assert_bitwise(resumed, _uninterrupted())


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_and_the_newest_intact_checkpoint_resumes(tmp_path):
    proc, ckpt = _start(tmp_path, "twice")
    _wait_for(proc, "batch 7")
    os.kill(proc.pid, signal.SIGINT)
    _wait_for(proc, "STOPPING")  # the first Ctrl-C was seen; the child now holds the graceful stop
    sent = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)
    out, err = _finish(proc)
    assert proc.returncode == 130 and "INTERRUPTED" in out, (proc.returncode, err[-2000:])
    assert time.monotonic() - sent < 20  # at once: no further step, no stop checkpoint
    saved = sorted(int(d) for d in os.listdir(ckpt) if d.isdigit())
    assert saved and saved[-1] <= 10
    resumed = jaxsane.fit(T.experiment(n=STEPS), checkpoint_dir=ckpt, **FIT)
    assert resumed.resumed_from == saved[-1] and resumed.skipped_checkpoints == []
    _assert_bitwise(resumed, _uninterrupted())


def test_handlers_are_installed_only_while_fit_runs_and_restored_after(tmp_path):
    def mine(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        seen = []
        real = preempt.StopRequests.stop_here

        def spy(self, position):
            seen.append(signal.getsignal(signal.SIGTERM))
            return real(self, position)

        preempt.StopRequests.stop_here = spy
        try:
            jaxsane.fit(T.experiment(n=3), steps=3, eval_every=0, **T.FIT)
        finally:
            preempt.StopRequests.stop_here = real
        assert seen and all(h is not mine and callable(h) for h in seen)
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)
