"""fit under ``jax.distributed`` (two real processes on 127.0.0.1, gloo): a SIGTERM or Ctrl-C on one process,
or on both, stops both at the same step (JAX's preemption sync point), with one checkpoint there.

Each test starts its own two children, waits for a line they print (never a fixed sleep), has a timeout and
kills only its own processes."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from jaxsane._core.errors import EXIT_PREEMPTED

pytestmark = [pytest.mark.multiprocess, pytest.mark.subprocess, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 300

CHILD = textwrap.dedent('''
    import json, sys, time
    import numpy as np
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    pid, port, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=120)
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxsane

    def emit(**kw):
        print("REPORT " + json.dumps(kw, default=str), flush=True)

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    tx = optax.sgd(0.05)

    def loss(params, batch):
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

    @jax.jit
    def step(state, batch):
        params, opt = state
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), {"loss": value}

    def init(key):
        params = {"w": jax.make_array_from_process_local_data(rep, np.asarray(jax.random.normal(key, (3, 2))))}
        opt = jax.tree.map(lambda a: jax.make_array_from_process_local_data(rep, np.asarray(a)), tx.init(params))
        return params, opt

    class Data:
        def __iter__(self):
            for i in range(200):
                rng = np.random.default_rng(100 * i + pid)
                x, y = rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(4, 2)).astype(np.float32)
                time.sleep(0.02)
                print(f"batch {i}", flush=True)
                yield {"x": jax.make_array_from_process_local_data(rows, x),
                       "y": jax.make_array_from_process_local_data(rows, y)}

    exp = jaxsane.Experiment(init=init, step=step, train=Data(), loss=loss, name="dist")
    try:
        result = jaxsane.fit(exp, steps=200, checkpoint_dir=ckpt, checkpoint_every=50, eval_every=0,
                             progress=False, telemetry_every=5, dead_every=0, log_every=5)
        emit(kind="finished", step=result.step)
        code = 0
    except jaxsane.Preempted as e:
        emit(kind="preempted", step=e.step, signal=e.signal, checkpoint=e.checkpoint)
        code = e.exit_code
    jax.distributed.shutdown()
    sys.exit(code)
''')


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Lines:
    """A child's stdout lines, collected in a thread; :meth:`wait_for` waits for a line with a prefix."""

    def __init__(self, pipe):
        self.lines, self.cond = [], threading.Condition()
        self.thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self.thread.start()

    def _read(self, pipe):
        for line in pipe:
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_for(self, prefix, timeout):
        def seen():
            return any(line.startswith(prefix) for line in self.lines) or not self.thread.is_alive()

        with self.cond:
            self.cond.wait_for(seen, timeout)
            return any(line.startswith(prefix) for line in self.lines)


def _run_and_signal(tmp_path, signals: dict[int, int], **extra_env: str) -> list[dict]:
    """Start two processes, send ``signals[pid]`` to each listed process once both have trained a few
    steps, and return each process's ``(returncode, preempted report, stderr)``."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra_env}
    port, ckpt = _free_port(), str(tmp_path / "ckpt")
    procs = [subprocess.Popen([sys.executable, str(script), str(i), str(port), ckpt], env=env, cwd=str(tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for i in range(2)]
    deadline = time.monotonic() + TIMEOUT_S
    results = []
    try:
        readers = [_Lines(p.stdout) for p in procs]
        errors = [_Lines(p.stderr) for p in procs]
        for r in readers:
            assert r.wait_for("batch 8", TIMEOUT_S), "a child did not start training"
        for pid, sig in signals.items():
            os.kill(procs[pid].pid, sig)
        for p, r, e in zip(procs, readers, errors):
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
            r.thread.join(30)
            e.thread.join(30)
            err = "".join(e.lines)
            reports = [json.loads(line[len("REPORT "):]) for line in r.lines if line.startswith("REPORT ")]
            results.append({"rc": p.returncode, "reports": reports, "stderr": err})
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # only the processes this test started
                p.wait(timeout=30)
    return results


def _assert_same_stop(results, ckpt):
    for res in results:
        assert res["rc"] == EXIT_PREEMPTED, (res["rc"], res["stderr"][-3000:])
    stops = [next(r for r in res["reports"] if r["kind"] == "preempted") for res in results]
    assert stops[0]["step"] == stops[1]["step"] and stops[0]["step"] < 200, stops
    step = stops[0]["step"]
    assert os.path.isdir(os.path.join(ckpt, str(step)))
    return stops


def test_sigint_on_one_process_stops_both_at_the_same_step(tmp_path):
    results = _run_and_signal(tmp_path, {1: signal.SIGINT})
    stops = _assert_same_stop(results, str(tmp_path / "ckpt"))
    assert stops[1]["signal"] == "SIGINT" and stops[0]["signal"] == "preemption notice"


def test_sigterm_on_both_processes_stops_both_at_the_same_step(tmp_path):
    results = _run_and_signal(tmp_path, {0: signal.SIGTERM, 1: signal.SIGTERM})
    _assert_same_stop(results, str(tmp_path / "ckpt"))


def test_without_jax_preemption_service_an_all_gathered_flag_stops_both_at_the_same_step(tmp_path):
    """``jax_enable_preemption_service`` off: fit installs its own SIGTERM handler and all-gathers the flag
    every ``SYNC_EVERY`` steps, so both stop at the same multiple of it."""
    results = _run_and_signal(tmp_path, {0: signal.SIGTERM}, JAX_ENABLE_PREEMPTION_SERVICE="false")
    stops = _assert_same_stop(results, str(tmp_path / "ckpt"))
    assert stops[0]["signal"] == "SIGTERM" and stops[1]["signal"] == "preemption notice"
    assert stops[0]["step"] % 10 == 0
