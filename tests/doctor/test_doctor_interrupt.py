"""Ctrl-C during ``python -m jaxsane doctor``: exit 130 within seconds (no wait for background compiles),
printing what doctor found so far and the stage it interrupted. The test waits for the stage's start line
(never a fixed sleep) and kills only the process it started."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from jaxsane._doctor.background import BackgroundPool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _default_sigint():
    """The child's Ctrl-C as a terminal's foreground program has it: a test run started in the background by a
    shell without job control inherits SIGINT ignored, and Python then never turns it into KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class _Reader:
    """Collects a pipe's bytes in a thread; :meth:`wait_for` waits for a regex in what arrived so far."""

    def __init__(self, pipe):
        self.text, self.cond = "", threading.Condition()
        self.thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self.thread.start()

    def _read(self, pipe):
        while True:
            chunk = os.read(pipe.fileno(), 4096)
            if not chunk:
                break
            with self.cond:
                self.text += chunk.decode(errors="replace")
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_for(self, pattern, timeout):
        with self.cond:
            ok = self.cond.wait_for(lambda: re.search(pattern, self.text) or not self.thread.is_alive(), timeout)
            return re.search(pattern, self.text) if ok else None


@pytest.mark.subprocess
@pytest.mark.slow
def test_ctrl_c_during_a_stage_exits_130_at_once_naming_the_stage():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    target = "jaxsane.examples.digits_optax:experiment"
    proc = subprocess.Popen([sys.executable, "-m", "jaxsane", "doctor", target, "--no-cache"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=_default_sigint)
    out, err = _Reader(proc.stdout), _Reader(proc.stderr)
    try:
        # the grads stage waits for its background work; the step stage compiles: both leave time to interrupt
        started = err.wait_for(r"digits_optax: (grads|step|batch|overfit) \.\.\.", timeout=240)
        assert started, err.text[-2000:]
        sent = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)  # only the process this test started
            proc.wait(timeout=30)
    out.thread.join(10)
    err.thread.join(10)
    assert code == 130, (code, err.text[-2000:])
    assert took < 5.0, f"Ctrl-C took {took:.1f} s to end doctor"
    # during the stage it names, or just after it when the Ctrl-C lands between two stages
    named = re.search(r"interrupted \(Ctrl-C\) (?:during|after) stage '(\w+)' of 'digits_optax'", err.text)
    assert named, err.text[-2000:]
    assert f"digits_optax: {named.group(1)} ..." in err.text  # the stage it names had started
    assert "Traceback" not in err.text and "ImportError" not in err.text


def test_background_pool_threads_are_daemons_and_shutdown_cancels_queued_work():
    gate, started = threading.Event(), threading.Event()
    pool = BackgroundPool(1, "jaxsane-precompile")

    def job():
        started.set()
        return gate.wait(30)

    try:
        running = pool.submit(job)
        assert started.wait(30)
        queued = pool.submit(lambda: "never")
        assert all(t.daemon and t.name.startswith("jaxsane-precompile") for t in pool._threads)
        pool.shutdown(wait=False, cancel_futures=True)
        assert queued.cancelled()
        with pytest.raises(RuntimeError):
            pool.submit(lambda: None)
    finally:
        gate.set()
    assert running.result(timeout=30) is True
    failing = BackgroundPool(1, "jaxsane-precompile")
    try:
        with pytest.raises(ZeroDivisionError):
            failing.submit(lambda: 1 / 0).result(timeout=30)
    finally:
        failing.shutdown(wait=True)


_INTERRUPTING = '''
import jax.numpy as jnp
import numpy as np
import jaxsane

def init(key):
    return {"params": {"w": jnp.zeros((3, 2))}}

calls = [0]
LIMIT = None  # the calls before the stages (doctor's setup and planning trace the step, to cost it)

def step(state, batch):
    calls[0] += 1
    if LIMIT is not None and calls[0] > LIMIT:
        raise KeyboardInterrupt  # as a Ctrl-C lands while doctor's step stage traces the step
    w = state["params"]["w"] - 0.1 * batch["x"][:, :2].mean()
    return {"params": {"w": w}}, {"loss": jnp.sum(w**2)}

def experiment():
    batch = {"x": np.ones((4, 3), np.float32), "y": np.zeros(4, np.int32)}
    return jaxsane.Experiment(init=init, step=step, train=[batch], name="stopped")
'''


def test_an_interrupted_doctor_keeps_what_it_found_and_the_cli_returns_130(tmp_path, capsys):
    import jaxsane
    from jaxsane.cli import EXIT_INTERRUPTED, main

    namespace: dict = {}
    exec(compile(_INTERRUPTING, "counting.py", "exec"), namespace)
    jaxsane.doctor(namespace["experiment"](), stages=["init"], progress=False, compile_cache=False)
    source = _INTERRUPTING.replace("LIMIT = None", f"LIMIT = {namespace['calls'][0]}")  # interrupt the step stage
    path = tmp_path / "interrupting.py"
    path.write_text(source)
    namespace = {}
    exec(compile(source, str(path), "exec"), namespace)
    with pytest.raises(KeyboardInterrupt) as info:
        jaxsane.doctor(namespace["experiment"](), stages=["init", "step"], progress=False, compile_cache=False)
    diagnosis = info.value.diagnosis
    (init, step) = [(s["name"], s["status"], s["reason"]) for s in diagnosis.stages]
    assert init[:2] == ("init", "not applicable") and step == ("step", "failed", "interrupted by Ctrl-C")
    assert "during stage 'step' of 'stopped'" in "\n".join(info.value.__notes__)
    code = main(["doctor", f"{path}:experiment", "--stages", "init", "step", "--no-cache", "-q"])
    assert code == EXIT_INTERRUPTED == 130
    err = capsys.readouterr().err
    assert "interrupted (Ctrl-C) during stage 'step' of 'stopped'" in err
    assert "stage step did not finish: interrupted by Ctrl-C" in err


@pytest.mark.subprocess
def test_the_ctrl_c_watcher_ends_the_process_even_when_the_report_cannot_be_printed():
    # the main thread never raises (a KeyboardInterrupt swallowed where Python cannot pass it on, e.g. in a
    # finalizer) and the report changes while the watcher reads it: the watcher still names the stage and exits 130
    code = (
        "import os, signal, time\n"
        "import jaxsane.cli as cli\n"
        "import jaxsane._doctor.doctor as d\n"
        "class Changing:\n"
        "    name, artifacts, stages = 'prog', {'current_stage': 'step'}, []\n"
        "    def __str__(self):\n"
        "        raise RuntimeError('dictionary changed size during iteration')\n"
        "d._RUNNING.append(Changing())\n"
        "with cli._InterruptWatch():\n"
        "    start, sent = time.monotonic(), False\n"
        "    while time.monotonic() - start < 20:\n"
        "        try:\n"
        "            if not sent:\n"
        "                sent = True\n"
        "                os.kill(os.getpid(), signal.SIGINT)\n"
        "            time.sleep(0.05)\n"
        "        except KeyboardInterrupt:\n"
        "            pass\n"
        "print('survived the Ctrl-C')\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                          preexec_fn=_default_sigint)
    assert proc.returncode == 130, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "survived" not in proc.stdout
    assert "interrupted (Ctrl-C) during stage 'step' of 'prog'" in proc.stderr
