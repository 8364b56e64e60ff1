"""doctor never traces the user's code from two threads at once (issue 29): its background threads and its
stages take one lock around every call into the user's functions (``_core/user_code.py``)."""

import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsane
from jaxsane._experiment.contract import PureExperiment

tx = optax.adam(1e-3)


class OverlapProbe:
    """Counts the threads inside the user's code; each of the first ``waits`` entries waits (up to 1 s) for a
    second thread to come in, so an unserialised second trace is caught for sure, not by luck."""

    def __init__(self, waits=4):
        self.inside = {}  # thread id -> depth (the step calls the loss: one thread, two levels)
        self.most = 0
        self.waits = waits
        self.lock = threading.Lock()
        self.second = threading.Event()

    def enter(self):
        me = threading.get_ident()
        with self.lock:
            self.inside[me] = self.inside.get(me, 0) + 1
            self.most = max(self.most, len(self.inside))
            if len(self.inside) > 1:
                self.second.set()
            wait = self.waits > 0
            self.waits -= 1
        if wait:
            self.second.wait(1.0)

    def leave(self):
        me = threading.get_ident()
        with self.lock:
            self.inside[me] -= 1
            if not self.inside[me]:
                del self.inside[me]


def _probed_experiment(probe):
    def loss(params, batch):
        probe.enter()
        try:
            return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
        finally:
            probe.leave()

    def init(key):
        params = {"w": jax.random.normal(key, (4, 2)) * 0.1}
        return params, tx.init(params)

    def step(state, batch):
        probe.enter()
        try:
            params, opt = state
            value, grads = jax.value_and_grad(loss)(params, batch)
            updates, opt = tx.update(grads, opt, params)
            return (optax.apply_updates(params, updates), opt), {"loss": value}
        finally:
            probe.leave()

    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(8, 4)).astype(np.float32), "y": rng.normal(size=(8, 2)).astype(np.float32)}
    return jaxsane.Experiment(init=init, step=step, train=[batch], loss=loss)


def test_two_threads_never_run_the_users_step_and_loss_at_once():
    probe = OverlapProbe()
    adapted = PureExperiment(_probed_experiment(probe))
    state = adapted.init(jax.random.key(0))
    batch = adapted.experiment.train[0]
    errors = []

    def run(fn):
        try:
            fn()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    jobs = [
        lambda: jax.jit(adapted.loss_fn).lower(adapted.params(state), batch),
        lambda: jax.eval_shape(adapted.step, state, batch),
        lambda: jax.jit(jax.grad(adapted.loss_fn)).lower(adapted.params(state), batch),
    ]
    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert probe.most == 1, "the user's code was traced from two threads at once"


@pytest.mark.slow
def test_doctor_on_an_equinox_loss_with_an_inner_filter_jit_reports_no_crash():
    """The program of issue 29: its loss calls an ``eqx.filter_jit`` function, which the background compile
    thread and the step stage traced at once (``StoreException: Store occupied`` reported as the user's crash)."""

    @eqx.filter_jit
    def logits_of(model, x):
        return jax.vmap(model)(x)

    def loss(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(logits_of(model, batch["x"]), batch["y"]).mean()

    def init(key):
        model = eqx.nn.MLP(16, 4, width_size=32, depth=2, activation=jax.nn.relu, key=key)
        return model, tx.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(state, batch):
        model, opt = state
        value, grads = eqx.filter_value_and_grad(loss)(model, batch)
        updates, opt = tx.update(grads, opt, eqx.filter(model, eqx.is_array))
        return (eqx.apply_updates(model, updates), opt), {"loss": value}

    rng = np.random.default_rng(0)
    w = rng.normal(size=(16, 4))
    data = []
    for _ in range(22):
        x = rng.normal(size=(32, 16)).astype(np.float32)
        data.append({"x": x, "y": (x @ w).argmax(-1).astype(np.int32)})
    exp = jaxsane.Experiment(init=init, step=step, train=data[:20], eval=data[20:], loss=loss,
                             apply=lambda m, x: logits_of(m, x), num_classes=4, name="eqx_inner_filter_jit")
    diagnosis = jaxsane.doctor(exp, progress=False, compile_cache=False, run_steps=10, overfit_steps=30)
    crashes = [f for f in diagnosis if f.code == "doctor.user_code_crashed"]
    assert not crashes, crashes
    assert all(s["status"] == "ran" for s in diagnosis.stages), diagnosis.stages


def test_doctor_joins_its_background_threads_before_it_returns():
    # a daemon thread still ending while the interpreter finalizes aborts the process inside XLA ("terminate called
    # after throwing an instance of '' / FATAL: exception not rethrown"): `jaxsane doctor -q` exited 134
    from jaxsane.examples import load

    jaxsane.doctor(load("digits_optax"), stages=["init", "grads", "run"], run_steps=3, progress=False,
                   compile_cache=False)
    assert [t.name for t in threading.enumerate() if t.name.startswith("jaxsane-precompile")] == []


@pytest.mark.slow
def test_the_cli_doctor_exits_cleanly(tmp_path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, JAXSANE_CACHE_DIR=str(tmp_path / "cache"))
    for _ in range(2):  # a first run and one from the cache
        proc = subprocess.run([sys.executable, "-m", "jaxsane", "doctor", "jaxsane.examples.digits_optax:experiment",
                               "-q"], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("cores, workers", [(1, 1), (2, 1), (4, 2), (64, 2)])
def test_doctor_works_ahead_in_one_background_thread_on_two_cores(monkeypatch, cores, workers):
    # on two cores the main thread's compile and one background compile take both; a third at once only adds memory
    from jaxsane._doctor import doctor as _doctor

    monkeypatch.setattr(_doctor.os, "cpu_count", lambda: cores)
    assert _doctor._background_workers() == workers
    started = []
    real = _doctor.BackgroundPool.__init__

    def spy(self, n, name):
        started.append(n)
        real(self, n, name)

    monkeypatch.setattr(_doctor.BackgroundPool, "__init__", spy)
    exp = jaxsane.Experiment(
        init=lambda key: {"w": jnp.ones((3,))}, step=lambda s, b: ({"w": s["w"] - 0.1 * b["x"].mean(0)}, {}),
        train={"x": np.ones((4, 3), np.float32)}, params=lambda s: s,
    )
    jaxsane.doctor(exp, stages=["step"], progress=False, compile_cache=False)
    assert started == [workers]


def test_a_stage_waiting_for_work_ahead_runs_the_queued_jobs_itself():
    """The waiting thread runs the awaited job when it is still queued, and the oldest queued job while the awaited
    one runs in the pool's thread; a job it runs counts as background work (its compiles are not its stage's)."""
    from jaxsane._doctor.background import BackgroundPool, in_background

    pool = BackgroundPool(1, "jaxsane-precompile-test")
    release, busy = threading.Event(), threading.Event()

    def blocker():
        busy.set()
        release.wait(10)
        return threading.current_thread().name

    def where():
        return threading.current_thread().name, in_background()

    try:
        first = pool.submit(blocker)
        assert busy.wait(10)
        queued = pool.submit(where)
        assert queued.result(timeout=10) == (threading.current_thread().name, True)  # run here, not waited for
        assert not in_background()
        other = pool.submit(where)
        waited = pool.submit(lambda: "late")

        def release_soon():
            other_done = other.done()
            release.set()
            return other_done

        # the awaited job (waited) is queued behind `other`: both run here, the awaited one first
        assert waited.result(timeout=10) == "late" and not other.done()
        assert other.result(timeout=10)[0] == threading.current_thread().name
        assert pool.submit(release_soon).result(timeout=10) is True
        assert first.result(timeout=10).startswith("jaxsane-precompile-test")
    finally:
        release.set()
        pool.shutdown(wait=True, cancel_futures=True)


def test_a_ctrl_c_in_a_job_the_main_thread_runs_stops_the_main_thread():
    from jaxsane._doctor.background import BackgroundPool

    pool = BackgroundPool(1, "jaxsane-precompile-test")
    release = threading.Event()
    try:
        pool.submit(release.wait, 10)  # keeps the pool's thread busy

        def interrupted():
            raise KeyboardInterrupt

        job = pool.submit(interrupted)
        with pytest.raises(KeyboardInterrupt):
            job.result(timeout=10)
    finally:
        release.set()
        pool.shutdown(wait=True, cancel_futures=True)


def test_jobs_submitted_while_the_pool_is_held_start_only_when_it_is_released():
    """doctor prepares every stage with the pool held, so a job that reads what a later preparation makes (the
    gradient check takes the run's telemetry program) never starts before it is made."""
    import time as _time

    from jaxsane._doctor.background import BackgroundPool

    pool, started = BackgroundPool(1, "held-test"), []
    try:
        with pool.held():
            future = pool.submit(lambda: started.append(_time.perf_counter()))
            _time.sleep(0.2)
            assert not started, "a held pool starts nothing"
            released = _time.perf_counter()
        future.result(timeout=10)
        assert started and started[0] >= released
    finally:
        pool.shutdown(wait=True)
