"""Two real processes on 127.0.0.1 (jax.distributed, gloo CPU collectives, 2 CPU devices each).

Every test starts its own child processes, gives them a timeout, and kills only those processes
if they do not finish. The child script prints one JSON line per report; the test compares the
reports of the two processes.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.multiprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 240  # generous for a loaded 2-core CI box; a healthy run takes a few seconds per process

CHILD = textwrap.dedent('''
    import json, os, sys, time
    import numpy as np
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    pid, port, scenario = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                               initialization_timeout=120)
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxsane

    def emit(**kw):
        print("REPORT " + json.dumps(kw, default=str), flush=True)

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    rep = NamedSharding(mesh, P())
    rows = NamedSharding(mesh, P("data"))
    tx = optax.sgd(0.1)
    N_LOCAL = 4                                   # rows per process; 2 per device

    def loss_fn(params, batch):
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

    @jax.jit
    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

    def local_batch(i, nan=False):
        rng = np.random.default_rng(100 * i + pid)
        x = rng.normal(size=(N_LOCAL, 3)).astype(np.float32)
        if nan:
            x[1, 2] = np.nan                      # process-local row 1
        y = rng.normal(size=(N_LOCAL, 2)).astype(np.float32)
        return {"x": jax.make_array_from_process_local_data(rows, x),
                "y": jax.make_array_from_process_local_data(rows, y)}

    def init(seed):
        w = np.asarray(jax.random.normal(jax.random.key(seed), (3, 2)))
        params = {"w": jax.make_array_from_process_local_data(rep, w)}
        opt = jax.tree.map(lambda a: jax.make_array_from_process_local_data(rep, np.asarray(a)), tx.init(params))
        return params, opt

    emit(kind="devices", devices=[d.id for d in jax.devices()], local=[d.id for d in jax.local_devices()])
    if scenario == "nan":
        state = init(0)
        guarded = jaxsane.guard(step, max_lag=2)
        stopped = None
        start = time.time()
        try:
            for i in range(12):
                state, metrics = guarded(state, local_batch(i, nan=(pid == 1 and i == 3)))
            guarded.flush()
        except jaxsane.NonFiniteError as e:
            stopped = i
            shard = [f for f in guarded.failures if f.code == "dist.nonfinite_shard"]
            emit(kind="nonfinite", code=e.finding.code, step=e.finding.step, message=str(e), stopped=stopped,
                 shard=shard[0].extra if shard else None, seconds=time.time() - start)
        # a finite batch whose row makes log() NaN on process 1: the mean spreads it to every device, and
        # the guard replays the step once per batch shard (the same global programs on both processes)
        @jax.jit
        def log_step(w, batch):
            loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.log(batch["x"]) @ w))(w)
            return w - 0.1 * g, {"loss": loss}

        guarded = jaxsane.guard(log_step, max_lag=1)
        w = jax.make_array_from_process_local_data(rep, np.ones((3,), np.float32))
        try:
            for i in range(6):
                local_x = np.abs(np.random.default_rng(i).normal(size=(N_LOCAL, 3))).astype(np.float32) + 0.5
                if pid == 1 and i == 2:
                    local_x[2, 0] = -1.0          # process-local row 2 = global row 6
                w, _ = guarded(w, {"x": jax.make_array_from_process_local_data(rows, local_x)})
            guarded.flush()
        except jaxsane.NonFiniteError as e:
            shard = [f for f in guarded.failures if f.code == "dist.nonfinite_shard"]
            emit(kind="forward", code=e.finding.code, step=e.finding.step, stopped=i,
                 shard=shard[0].extra if shard else None)
        # the same global program still runs on both processes afterwards: nobody is stuck in a collective
        total = jax.jit(lambda x: jnp.sum(x), out_shardings=rep)(local_batch(0)["x"])
        emit(kind="after", total=float(total))
    elif scenario == "replicas":
        same, diff = init(0), init(pid)           # diff: each process initialises with its own seed
        emit(kind="check_same", findings=[f.code for f in jaxsane.check_replicas(same, root="state")])
        found = jaxsane.check_replicas(diff, root="state")
        emit(kind="check_diff", findings=[{"code": f.code, "path": f.path, **f.extra} for f in found])
        host = jaxsane.check_replicas({"lr": np.float32(0.1 * (1 + pid)), "same": np.ones(2)})
        emit(kind="check_host", findings=[{"path": f.path, **f.extra} for f in host])
        guarded = jaxsane.guard(step, check_replicas=True, sync=True)
        guarded(same, local_batch(0))
        emit(kind="guard_same", failures=[f.code for f in guarded.failures])
        try:
            guarded(diff, local_batch(1))
            emit(kind="guard_diff", raised=False)
        except jaxsane.ReplicaDivergenceError as e:
            emit(kind="guard_diff", raised=True, paths=sorted(f.path for f in e.findings), message=str(e))
    jax.distributed.shutdown()
    emit(kind="shutdown")
''')


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two(tmp_path, scenario: str) -> list[list[dict]]:
    """Start 2 processes; return each one's reports. Kills only these processes on timeout."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(i), str(port), scenario], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path))
             for i in range(2)]
    deadline = time.monotonic() + TIMEOUT_S
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait(timeout=30)
        pytest.fail(f"2-process run {scenario!r} did not finish within {TIMEOUT_S}s (a hang in a collective?)")
    for rc, out, err in outs:
        assert rc == 0, f"child failed (rc={rc}):\n{out}\n{err[-4000:]}"
    return [[json.loads(line[len("REPORT "):]) for line in out.splitlines() if line.startswith("REPORT ")]
            for _, out, _ in outs]


def by_kind(reports: list[dict]) -> dict[str, dict]:
    return {r["kind"]: r for r in reports}


@pytest.mark.subprocess
def test_nan_on_one_process_stops_both_with_the_same_report(tmp_path):
    r0, r1 = (by_kind(r) for r in run_two(tmp_path, "nan"))
    devices = r0["devices"]["devices"]
    assert r1["devices"]["local"] == [d for d in devices if d >= 2048]   # process 1's devices start at 2048
    a, b = r0["nonfinite"], r1["nonfinite"]
    assert a == {**b, "seconds": a["seconds"]}                             # same report, same stopping call
    # reported at the call where more than max_lag=2 steps are pending: the same call on every process
    assert a["code"] == "nonfinite.input" and a["step"] == 3 and a["stopped"] == 3 + 3
    # global rows 4:8 belong to process 1; its local row 1 is global row 5, on its first device
    assert a["shard"]["processes"] == [1] and a["shard"]["rows"] == [5]
    assert a["shard"]["devices"] == [r1["devices"]["local"][0]] and a["shard"]["rows_held"] == [[4, 6]]
    assert "batch['x']" in a["message"] and "process(es) 1" in a["message"]
    f0, f1 = r0["forward"], r1["forward"]
    assert f0 == f1 and f0["code"] in ("nonfinite.forward", "nonfinite.update") and f0["step"] == 2
    assert f0["shard"]["replayed"] and f0["shard"]["processes"] == [1] and f0["shard"]["rows"] == [6]
    assert f0["shard"]["devices"] == [r1["devices"]["local"][1]] and f0["shard"]["rows_held"] == [[6, 8]]
    assert r0["after"]["total"] == r1["after"]["total"]                  # collectives still work afterwards
    assert "shutdown" in r0 and "shutdown" in r1


@pytest.mark.subprocess
def test_processes_with_different_seeds_are_caught(tmp_path):
    r0, r1 = (by_kind(r) for r in run_two(tmp_path, "replicas"))
    for r in (r0, r1):
        assert r["check_same"]["findings"] == []
        diff = r["check_diff"]["findings"]
        assert {f["path"] for f in diff} == {"state[0]['w']"}
        assert diff[0]["code"] == "dist.replica_divergence" and diff[0]["per_process"]
        assert diff[0]["processes"] == [1] and diff[0]["devices"] == [d for d in r["devices"]["devices"] if d >= 2048]
        assert [f["path"] for f in r["check_host"]["findings"]] == ["['lr']"]
        assert r["guard_same"]["failures"] == []
        assert r["guard_diff"]["raised"] and r["guard_diff"]["paths"] == ["state[0]['w']"]
        assert "shutdown" in r
    assert r0["check_diff"] == r1["check_diff"] and r0["guard_diff"] == r1["guard_diff"]
