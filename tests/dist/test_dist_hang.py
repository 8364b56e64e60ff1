"""dist.hang: guard(step, hang_timeout=...) names the process that stopped entering the step.

Real processes on 127.0.0.1 (jax.distributed, gloo CPU collectives, 1 CPU device each): one process
sleeps before step 5, or dies there; every live process must report ``dist.hang`` naming it, its last
step 4 and where it is, and every process must be gone within the timeout plus a few seconds. Each
test starts its own processes, has a hard timeout, and kills only those processes. The rest are
single-process tests of the argument check, the no-op, and the pure detection and report functions.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import pytest

import jaxsane
from jaxsane._dist.hang import EXIT_CODE, detect, hang_finding

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HANG_TIMEOUT = 6.0   # above the lag between processes that a loaded 2-core box causes in a healthy job
HEALTHY_TIMEOUT = 60.0  # a healthy job must not trip the watch: a timeout no scheduling delay reaches
SLACK_S = 30.0       # detection, stack exchange and exit (a few seconds) with room for a loaded box: a safety net
HARD_TIMEOUT_S = 240  # the whole run, jax start-up of every process included

CHILD = textwrap.dedent('''
    import json, os, sys, time
    import numpy as np
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    pid, n, port, scenario, timeout = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], float(sys.argv[5])
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid, initialization_timeout=120)
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxsane

    def emit(**kw):
        print("REPORT " + json.dumps(kw, default=str), flush=True)

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    rows, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

    @jax.jit
    def step(w, batch):
        return w + jnp.mean(batch), {"loss": jnp.sum(batch)}  # the mean is an all-reduce over processes

    guarded = jaxsane.guard(step, hang_timeout=timeout)
    w = jax.make_array_from_process_local_data(rep, np.zeros((), np.float32))
    try:
        for i in range(40):
            if pid == 1 and i == 5 and scenario != "healthy":
                emit(kind="stuck", t=time.time())
                if scenario == "sleep":
                    time.sleep(120)  # STUCK HERE
                elif scenario == "sysexit":
                    sys.exit(3)      # a clean exit: atexit runs, jax.distributed's shutdown waits for the others
                else:  # die once the record of step 4 is published (a condition: the publisher may lag under load)
                    watch, until = guarded._hang, time.time() + 60
                    while watch._dir("rec/").get(pid, {}).get("finished") != 4 and time.time() < until:
                        time.sleep(0.05)
                    os._exit(3)
            w, _ = guarded(w, jax.make_array_from_process_local_data(rows, np.ones((2,), np.float32)))
        guarded.flush()
        emit(kind="finished")
    except jaxsane.DistHangError as e:
        f = e.finding
        emit(kind="raised", code=f.code, step=f.step, missing=f.extra["missing"], file=f.file, line=f.line,
             processes={p: {k: v for k, v in d.items() if k != "stacks"} for p, d in f.extra["processes"].items()},
             cause=str(e.__cause__)[:200], in_failures=f in guarded.failures, t=time.time())
''')


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(tmp_path, n: int, scenario: str) -> list[dict]:
    """Start ``n`` processes; wait for all to exit (killing only these after HARD_TIMEOUT_S); return, per
    process, its exit code, exit time, stderr and reports."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    port = _free_port()
    logs = [(open(tmp_path / f"out{i}.txt", "w+"), open(tmp_path / f"err{i}.txt", "w+")) for i in range(n)]
    timeout = HEALTHY_TIMEOUT if scenario == "healthy" else HANG_TIMEOUT
    procs = [subprocess.Popen([sys.executable, str(script), str(i), str(n), str(port), scenario, str(timeout)],
                              env=env, stdout=out, stderr=err, cwd=str(tmp_path)) for i, (out, err) in enumerate(logs)]
    ended: dict[int, float] = {}
    deadline = time.monotonic() + HARD_TIMEOUT_S
    try:
        while len(ended) < n and time.monotonic() < deadline:
            for i, p in enumerate(procs):
                if i not in ended and p.poll() is not None:
                    ended[i] = time.time()
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait(timeout=30)
    results = []
    for i, (p, (out, err)) in enumerate(zip(procs, logs)):
        out.seek(0), err.seek(0)
        text, errors = out.read(), err.read()
        out.close(), err.close()
        reports = [json.loads(line[len("REPORT "):]) for line in text.splitlines() if line.startswith("REPORT ")]
        results.append({"rc": p.returncode, "ended": ended.get(i), "stderr": errors,
                        "reports": {r["kind"]: r for r in reports}})
    left = [i for i in range(n) if i not in ended]
    assert not left, f"processes {left} of the {scenario!r} job were still running after {HARD_TIMEOUT_S}s " \
                     f"(killed):\n" + "\n".join(r["stderr"][-3000:] for r in results)
    return results


def _stuck_line() -> int:
    return next(i for i, line in enumerate(CHILD.splitlines(), 1) if "# STUCK HERE" in line)


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 4])
def test_a_process_that_stops_entering_the_step_is_named_by_every_process(tmp_path, n):
    results = run_job(tmp_path, n, "sleep")
    stuck_at = results[1]["reports"]["stuck"]["t"]
    for pid, r in enumerate(results):
        err = r["stderr"]
        assert r["rc"] == EXIT_CODE, f"process {pid}: rc={r['rc']}\n{err[-3000:]}"
        assert "[jaxsane] dist.hang (step 5, " in err, err[-3000:]
        assert f"process(es) 1 did not enter step 5 within hang_timeout={HANG_TIMEOUT:g}s" in err
        assert "process 1 (missing): last entered step 4 at " in err and "finished step 4" in err
        # the sleeping process's own stack, posted by its watchdog: the line of its sleep
        assert f"main thread at {tmp_path / 'child.py'}:{_stuck_line()} in <module>: time.sleep(120)" in err
        assert f'File "{tmp_path / "child.py"}", line {_stuck_line()}, in <module>' in err
        for other in set(range(n)) - {1}:
            assert f"process {other}: last entered step " in err  # not missing: waiting in the step
        assert r["ended"] - stuck_at < HANG_TIMEOUT + SLACK_S, f"process {pid} took {r['ended'] - stuck_at:.1f}s"
    assert all("finished" not in r["reports"] for r in results)


@pytest.mark.multiprocess
def test_a_process_that_dies_is_named_by_the_others(tmp_path):
    results = run_job(tmp_path, 2, "exit")
    assert results[1]["rc"] == 3
    died_at = results[1]["ended"]
    r = results[0]
    assert r["rc"] == EXIT_CODE, r["stderr"][-3000:]
    assert "process(es) 1 did not enter step 5" in r["stderr"]
    assert "process 1 (missing): last entered step 4 at " in r["stderr"]
    assert "it did not answer the stack request" in r["stderr"]
    assert r["ended"] - died_at < HANG_TIMEOUT + SLACK_S
    raised = r["reports"].get("raised")
    if raised is not None:  # gloo failed the collective at once: the step raised, as a dist.hang
        assert raised["code"] == "dist.hang" and raised["step"] == 5 and raised["missing"] == [1]
        assert raised["processes"]["1"]["entered"] == 4 and not raised["processes"]["1"]["answered"]
        assert raised["in_failures"] and raised["cause"]


# ---------------------------------------------------------------------------- one process
def _step(w, b):
    return w + b, {"loss": jnp.sum(b)}


def test_hang_timeout_is_a_no_op_in_one_process():
    plain = jaxsane.guard(_step, sync=True)
    watched = jaxsane.guard(jax.jit(_step), sync=True, hang_timeout=0.05)
    w = jnp.zeros(3)
    for _ in range(3):
        time.sleep(0.1)  # longer than the timeout, between steps
        w, _ = watched(w, jnp.ones(3))
    assert jnp.array_equal(w, plain(jnp.zeros(3), 3 * jnp.ones(3))[0])
    assert watched.failures == [] and watched.hang is None
    assert not [t for t in threading.enumerate() if t.name == "jaxsane-hang-watch"]


@pytest.mark.parametrize("bad", [0, -1.0, "600", True, float("nan"), float("inf"), [3]])
def test_a_bad_hang_timeout_is_a_clear_argument_error(bad):
    with pytest.raises(jaxsane.GuardConfigError, match=r"^\[jaxsane\] jaxsane.guard\(hang_timeout=...\) must be "
                                                         r"None \(off\) or a number of seconds > 0"):
        jaxsane.guard(_step, hang_timeout=bad)


def test_fit_checks_hang_timeout_before_any_work():
    from jaxsane.examples import load
    with pytest.raises(jaxsane.FitArgumentError, match=r"fit\(hang_timeout=...\)"):
        jaxsane.fit(load("digits_optax"), steps=1, hang_timeout=-5, progress=False)


def test_detect_fires_only_after_the_timeout_and_names_the_lagging_process():
    recs = {0: {"entered": 7, "entered_at": 100.0}, 1: {"entered": 4, "entered_at": 98.0},
            2: {"entered": 7, "entered_at": 100.5}}
    assert detect(recs, 3, timeout=3.0, now=102.0) is None          # 2 s since step 7 was entered
    request = detect(recs, 3, timeout=3.0, now=103.5)
    assert request["step"] == 7 and request["missing"] == [1]
    assert detect(recs, 4, timeout=3.0, now=103.5)["missing"] == [1, 3]  # process 3 has no record
    level = {p: {"entered": 7, "entered_at": 0.0} for p in range(3)}
    assert detect(level, 3, timeout=3.0, now=1e9) is None            # nobody behind: the local rule's job


def test_the_finding_names_the_first_step_not_entered_and_where_the_missing_process_is():
    recs = {0: {"entered": 7, "entered_at": 10.0, "finished": 6, "in_call": True},
            1: {"entered": 4, "entered_at": 5.0, "finished": 4, "in_call": False},
            2: {"entered": 6, "entered_at": 10.0, "finished": 6, "in_call": True}}
    frames = [["/x/jax/_src/api.py", 1, "f", "g()"], ["/home/u/train.py", 41, "<module>", "load()"],
              ["/home/u/loader.py", 9, "load", "q.get()"]]
    stacks = {0: {"threads": [{"name": "MainThread", "main": True, "frames": frames[1:2]}]},
              1: {"threads": [{"name": "MainThread", "main": True, "frames": frames},
                              {"name": "reader", "main": False, "frames": frames[2:]}]}}
    f = hang_finding({"step": 7, "by": 0}, recs, stacks, 3, timeout=3.0, now=12.0)
    assert f.code == "dist.hang" and f.severity == "error" and f.step == 5 and f.extra["missing"] == [1]
    assert (f.file, f.line) == ("/home/u/loader.py", 9)
    report = f.extra["report"]
    assert "process 1 (missing): last entered step 4 at " in report and "(7.0s ago), finished step 4" in report
    assert "main thread at /home/u/loader.py:9 in load: q.get()" in report and "thread reader of process 1" in report
    assert "process 2: last entered step 6" in report and "did not answer the stack request" in report
    assert f.extra["processes"][2]["answered"] is False and f.extra["processes"][1]["stacks"]
    level = hang_finding({"step": 3}, {p: {"entered": 3, "entered_at": 1.0} for p in range(2)}, {}, 2, 3.0, 9.0)
    assert level.step == 3 and level.extra["missing"] == [] and "every process entered it" in level.message


class _Stop(Exception):
    pass


@pytest.mark.parametrize("processes, given, expected", [(2, "auto", 600.0), (1, "auto", None), (2, None, None),
                                                        (2, 30, 30.0)])
def test_fit_turns_the_watch_on_under_jax_distributed(monkeypatch, processes, given, expected):
    from jaxsane._fit import loop as _fit
    from jaxsane.examples import load

    class Jax:  # jax as _fit sees it, with this many processes
        def __getattr__(self, name):
            return (lambda: processes) if name == "process_count" else getattr(jax, name)

    seen = {}

    def spy(step, **kwargs):
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(_fit, "jax", Jax())
    monkeypatch.setattr(_fit, "Guarded", spy)  # fit builds its guard with Guarded (not the env-switched guard())
    with pytest.raises(_Stop):
        jaxsane.fit(load("digits_optax"), steps=1, eval_every=0, progress=False, hang_timeout=given)
    assert seen["hang_timeout"] == expected


@pytest.mark.multiprocess
def test_a_process_that_exits_cleanly_is_named_and_every_process_ends(tmp_path):
    results = run_job(tmp_path, 2, "sysexit")
    left_at = results[1]["reports"]["stuck"]["t"]
    r = results[0]
    assert r["rc"] == EXIT_CODE, r["stderr"][-3000:]
    assert "process(es) 1 did not enter step 5 within hang_timeout=" in r["stderr"]
    assert "process 1 (missing): last entered step 4 at " in r["stderr"] and "has exited" in r["stderr"]
    for pid, res in enumerate(results):
        assert res["ended"] - left_at < HANG_TIMEOUT + SLACK_S, f"process {pid} took {res['ended'] - left_at:.1f}s"


@pytest.mark.multiprocess
def test_a_healthy_job_runs_to_its_end_with_the_watch_on(tmp_path):
    results = run_job(tmp_path, 2, "healthy")
    for pid, r in enumerate(results):
        assert r["rc"] == 0 and "finished" in r["reports"], f"process {pid}: rc={r['rc']}\n{r['stderr'][-3000:]}"
        assert "dist.hang" not in r["stderr"]
