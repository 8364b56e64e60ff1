"""fit: guarded, monitored training with checkpoints, early stopping, rollback, resume after SIGKILL."""

import json
import os
import signal
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsane
from jaxsane import ExperimentError, NonFiniteError

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


class Batches:
    """A deterministic, re-iterable stream of {"x", "y", "poison"} batches; ``delay`` slows it, ``announce``
    prints each batch index (for the SIGKILL test)."""

    def __init__(self, n=40, size=16, seed=0, poison_at=(), delay=0.0, announce=False):
        self.n, self.size, self.seed, self.poison_at = n, size, seed, set(poison_at)
        self.delay, self.announce = delay, announce

    def __iter__(self):
        rng = np.random.default_rng(self.seed)
        w = np.random.default_rng(99).normal(size=(8, 4))
        for i in range(self.n):
            x = rng.normal(size=(self.size, 8)).astype(np.float32)
            y = np.argmax(x @ w, -1).astype(np.int32)
            if self.delay:
                time.sleep(self.delay)
            if self.announce:
                print(f"batch {i}", flush=True)
            yield {"x": x, "y": y, "poison": np.float32(i in self.poison_at)}


tx = optax.adam(1e-2)


def init(key):
    k1, k2 = jax.random.split(key)
    params = {"h": {"w": jax.random.normal(k1, (8, 16)) * 0.35, "b": jnp.zeros(16)},
              "out": {"w": jax.random.normal(k2, (16, 4)) * 0.25, "b": jnp.zeros(4)}}
    return params, tx.init(params)


def apply(params, x):
    return jax.nn.relu(x @ params["h"]["w"] + params["h"]["b"]) @ params["out"]["w"] + params["out"]["b"]


def loss(params, batch):
    return optax.softmax_cross_entropy_with_integer_labels(apply(params, batch["x"]), batch["y"]).mean()


@jax.jit
def step(state, batch):
    params, opt_state = state
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    # a planted fault: a "poison" batch writes NaN into the parameters (a blown-up update)
    params = jax.tree.map(lambda p: p + jnp.where(batch["poison"] > 0, jnp.nan, 0.0), params)
    return (params, opt_state), {"loss": value}


def experiment(train=None, eval_=None, **kw):
    eval_ = eval_ if eval_ is not None else next(iter(Batches(n=1, size=64, seed=7)))
    return jaxsane.Experiment(init=init, step=step, train=train or Batches(**kw), eval=eval_, loss=loss,
                              apply=apply, num_classes=4, name="tiny")


FIT = dict(telemetry_every=5, dead_every=0, log_every=5, progress=False)

_SCRIPT = """
import sys
sys.path.insert(0, {here!r})
import test_fit as T, jaxsane
jaxsane.fit(T.experiment(n=30, delay=0.3, announce=True), steps=30, checkpoint_dir={ckpt!r}, checkpoint_every=5,
            eval_every=0, **T.FIT)
print("finished", flush=True)
"""


def _committed_steps(ckpt):
    """The checkpoint steps orbax finished writing under ``ckpt`` (their metadata file is written last)."""
    try:
        names = os.listdir(ckpt)
    except OSError:
        return []
    return sorted(int(d) for d in names if d.isdigit() and os.path.exists(os.path.join(ckpt, d, "_CHECKPOINT_METADATA")))


@pytest.mark.subprocess
@pytest.mark.slow
def test_sigkill_mid_run_then_resume_matches_an_uninterrupted_run(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT.format(here=HERE, ckpt=ckpt))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=env, start_new_session=True)
    seen, committed = -1, []
    deadline = time.monotonic() + 240
    try:
        # kill mid-run once the checkpoint of step 15 is committed (a condition, not a duration: under load the
        # asynchronous write lags the batches by a varying time); batch 27 is the last moment to kill at all
        for line in proc.stdout:
            if line.startswith("batch "):
                seen = int(line.split()[1])
            assert not line.startswith("finished"), "the run ended before it was killed"
            committed = _committed_steps(ckpt)
            if (seen >= 17 and committed and committed[-1] >= 15) or seen >= 27 or time.monotonic() > deadline:
                break
    finally:
        os.kill(proc.pid, signal.SIGKILL)     # only the process this test started
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL and seen >= 17 and committed, (proc.returncode, seen, committed)

    resumed = jaxsane.fit(experiment(n=30), steps=30, checkpoint_dir=ckpt, checkpoint_every=5, eval_every=0, **FIT)
    assert resumed.resumed_from is not None and resumed.resumed_from % 5 == 0
    # nothing committed before the kill is lost (a later checkpoint may have committed while it was killed)
    assert resumed.resumed_from >= committed[-1], (resumed.resumed_from, committed)
    whole = jaxsane.fit(experiment(n=30), steps=30, eval_every=0, **FIT)
    assert resumed.step == whole.step == 30
    assert resumed.history.steps == list(range(30))
    np.testing.assert_allclose(resumed.losses, whole.losses, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(whole.state)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # the JSONL log holds each step exactly once, also across the crash
    steps = [json.loads(l)["step"] for l in open(os.path.join(ckpt, "metrics.jsonl")) if '"train"' in l]
    assert steps == list(range(30))


@pytest.mark.slow
def test_checkpoints_from_the_first_step_keep_last_k_and_early_stopping(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    # min_delta larger than any possible improvement: every eval after the first is "bad"
    result = jaxsane.fit(experiment(n=40), steps=40, checkpoint_dir=ckpt, checkpoint_every=4, keep=2, eval_every=2,
                         patience=3, min_delta=100.0, **FIT)
    assert result.stopped_early and result.step == 6 and result.best_step == 0
    assert result.history.eval_steps == [0, 2, 4, 6]
    saved = sorted(int(d) for d in os.listdir(ckpt) if d.isdigit())
    assert saved == [4, 6]                    # 1 was saved first, then pruned to the last 2
    # without min_delta the healthy run improves and trains to the end
    full = jaxsane.fit(experiment(n=40), steps=12, eval_every=3, patience=2, **FIT)
    assert not full.stopped_early and full.step == 12 and full.best_step == 12
    assert full.history.eval_loss[-1] < full.history.eval_loss[0]
    assert "accuracy" in full.history.eval_metrics
    assert not full.diagnosis.by_code("train") and not full.diagnosis.by_code("nonfinite")


@pytest.mark.slow
def test_first_checkpoint_is_the_first_step(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    jaxsane.fit(experiment(n=3), steps=3, checkpoint_dir=ckpt, checkpoint_every=100, eval_every=0, **FIT)
    assert sorted(int(d) for d in os.listdir(ckpt) if d.isdigit()) == [1, 3]


@pytest.mark.slow
def test_nan_rolls_back_to_the_last_good_checkpoint(tmp_path):
    with pytest.warns(jaxsane.JaxsaneWarning, match="rolled back"):
        result = jaxsane.fit(experiment(n=20, poison_at=(7,)), steps=20, checkpoint_every=4, eval_every=0, **FIT)
    assert result.rollbacks == 1 and result.step == 20
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(result.state))
    (failure,) = result.diagnosis.by_code("nonfinite")
    assert failure.step == 7 and failure.severity == "error"
    # skip keeps the previous state in-graph; raise stops
    skipped = jaxsane.fit(experiment(n=12, poison_at=(5,)), steps=12, eval_every=0, on_nonfinite="skip", **FIT)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(skipped.state))
    assert [f.step for f in skipped.diagnosis.by_code("nonfinite")] == [5]
    with pytest.raises(NonFiniteError):
        jaxsane.fit(experiment(n=12, poison_at=(5,)), steps=12, eval_every=0, on_nonfinite="raise", **FIT)


@pytest.mark.slow
def test_nnx_state_resumes_exactly(tmp_path):
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            return self.b(nnx.relu(self.a(x)))

    def nnx_init(key):
        model = Net(nnx.Rngs(params=key))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    def nnx_loss(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()

    @nnx.jit
    def nnx_step(model, optimizer, batch):
        value, grads = nnx.value_and_grad(nnx_loss)(model, batch)
        optimizer.update(model, grads)
        return value

    def exp():
        return jaxsane.Experiment(init=nnx_init, step=nnx_step, train=Batches(n=10), loss=nnx_loss, name="nnx")

    ckpt = str(tmp_path / "ckpt")
    first = jaxsane.fit(exp(), steps=4, checkpoint_dir=ckpt, checkpoint_every=2, **FIT)
    resumed = jaxsane.fit(exp(), steps=8, checkpoint_dir=ckpt, checkpoint_every=2, **FIT)
    whole = jaxsane.fit(exp(), steps=8, **FIT)
    assert first.step == 4 and resumed.resumed_from == 4
    np.testing.assert_allclose(resumed.losses, whole.losses, rtol=1e-6)
    model, _ = resumed.user_state
    assert isinstance(model, Net)


@pytest.mark.slow
def test_report_and_tensorboard_options(tmp_path):
    path = str(tmp_path / "fit.html")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = jaxsane.fit(experiment(n=6), steps=6, eval_every=3, report=path, metrics_path=str(tmp_path / "m.jsonl"),
                             tensorboard_dir=str(tmp_path / "tb"), **FIT)
    # TensorBoard is optional: either a standard writer wrote event files, or fit said why it could not
    tb = tmp_path / "tb"
    assert (tb.exists() and any(tb.rglob("*tfevents*"))) or any("tensorboard" in str(w.message) for w in caught)
    text = open(path).read()
    assert "train and eval loss" in text.lower() and "data:image/png;base64," in text
    kinds = [json.loads(l)["kind"] for l in open(tmp_path / "m.jsonl")]
    assert kinds.count("train") == 6 and kinds.count("eval") == 3 and "grad" in kinds
    assert result.metrics_path == str(tmp_path / "m.jsonl")


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ExperimentError, match="on_nonfinite"):
        jaxsane.fit(experiment(), steps=2, on_nonfinite="ignore")
    with pytest.raises(ExperimentError, match="steps"):
        jaxsane.fit(experiment(), steps=0)
    no_eval = jaxsane.Experiment(init=init, step=step, train=Batches(), loss=loss)
    with pytest.raises(ExperimentError, match="patience"):
        jaxsane.fit(no_eval, steps=2, patience=2)


@pytest.mark.slow
def test_restore_best_returns_the_state_of_the_best_evaluation(tmp_path):
    """Eval labels shuffled: learning the true mapping makes the eval loss worse, so early stopping fires
    and restore_best hands back the state that evaluated best, not the last one."""
    eval_batch = next(iter(Batches(n=1, size=64, seed=7)))
    eval_batch["y"] = np.random.default_rng(3).permutation(eval_batch["y"])
    exp = experiment(eval_=eval_batch, n=60)
    ckpt = str(tmp_path / "ckpt")
    result = jaxsane.fit(exp, steps=60, eval_every=2, patience=3, checkpoint_dir=ckpt, keep=10,
                         restore_best=True, **FIT)
    assert result.stopped_early and result.restored_best and result.state is not result.last_state
    best = float(loss(result.state[0], eval_batch))
    last = float(loss(result.last_state[0], eval_batch))
    assert best == pytest.approx(result.best_eval_loss, rel=1e-5) and last > best
    # resumed after the early stop: the best state comes back from its checkpoint (or init for step 0)
    again = jaxsane.fit(exp, steps=60, eval_every=2, patience=3, checkpoint_dir=ckpt, keep=10,
                        restore_best=True, **FIT)
    assert again.resumed_from is not None and again.best_step == result.best_step
    np.testing.assert_allclose(float(loss(again.state[0], eval_batch)), best, rtol=1e-5)
    # without restore_best the last state is returned, as before
    plain = jaxsane.fit(exp, steps=60, eval_every=2, patience=3, **FIT)
    assert plain.state is plain.last_state and not plain.restored_best


@pytest.mark.slow
def test_fit_records_run_metadata_in_the_report_and_the_json(tmp_path):
    path = str(tmp_path / "fit.html")
    result = jaxsane.fit(experiment(n=6), steps=6, eval_every=3, report=path, checkpoint_dir=str(tmp_path / "ck"),
                         **FIT)
    meta = result.diagnosis.to_dict()["meta"]
    assert meta["steps"] == 6 and meta["steps_requested"] == 6 and meta["wall_seconds"] > 0
    assert meta["checkpoint_dir"] == str(tmp_path / "ck") and meta["best_step"] == result.best_step
    assert "train" in meta["timings"] and "jax" in meta["versions"] and meta["backend"] == jax.default_backend()
    page = open(path).read()
    block = page[page.index('class="metadata"'):]
    assert "wall time" in block and str(tmp_path / "ck") in block and "optax" in block


@pytest.mark.slow
def test_fit_checks_put_the_overfit_and_init_scale_plots_in_the_report(tmp_path):
    path = str(tmp_path / "fit.html")
    result = jaxsane.fit(experiment(n=4), steps=4, eval_every=0, report=path, checks=True, **FIT)
    assert {"overfit", "init_scales"} <= set(result.diagnosis.artifacts)
    assert result.diagnosis.by_code("overfit.best")
    page = open(path).read()
    assert 'class="plot overfit-sweep"' in page and 'class="plot init-scales"' in page
    assert {"overfit", "init_scales", "train"} <= set(result.diagnosis.to_dict()["meta"]["timings"])
    with pytest.raises(jaxsane.FitArgumentError, match="checks"):
        jaxsane.fit(experiment(n=4), steps=4, checks="yes", progress=False)


@pytest.mark.slow
def test_progress_writes_plain_lines_with_rate_and_eta_when_not_a_terminal(capsys):
    jaxsane.fit(experiment(n=12), steps=12, eval_every=0, **dict(FIT, progress=True))
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("[jaxsane] fit tiny:")]
    assert len(lines) >= 2, lines
    assert "step 1/12" in lines[0] and "stopped at step 12/12" in lines[-1]
    assert "steps/s" in lines[-1] and "ETA 0:00:00" in lines[-1] and "-:--:--" not in "".join(lines)


def test_progress_rate_and_eta_follow_the_steps():
    import io

    from jaxsane._render.progress import StepProgress as Progress
    stream = io.StringIO()
    bar = Progress(True, 100, 0, "demo", stream=stream, every_seconds=0.0)
    bar.update(1, "loss 2")
    t0, _ = bar.first
    bar.first = (t0 - 10.0, 1)  # as if the first step ended 10 s ago: 9 steps in 10 s
    bar.update(10, lambda: "loss 1")
    last = stream.getvalue().splitlines()[-1]
    assert "step 10/100 (10%)" in last and "0.9 steps/s" in last and "ETA 0:01:40" in last and "loss 1" in last
