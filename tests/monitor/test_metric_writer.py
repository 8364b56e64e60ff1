"""Metric writers (issue 17): fit and Monitor send scalars to any object with clu's write_scalars/flush."""

import itertools
import json

import jax
import numpy as np
import pytest
import test_fit as T

import jaxsane


class FakeWriter:
    """clu's MetricWriter protocol, recorded."""

    def __init__(self):
        self.calls, self.flushes = [], 0

    def write_scalars(self, step, scalars):
        assert isinstance(step, int) and all(isinstance(v, float) for v in scalars.values())
        self.calls.append((step, dict(scalars)))

    def flush(self):
        self.flushes += 1


def test_fit_sends_train_eval_and_grad_scalars_and_keeps_jsonl(tmp_path):
    w = FakeWriter()
    r = jaxsane.fit(T.experiment(n=10), steps=10, eval_every=5, checkpoint_dir=str(tmp_path / "ck"), writer=w,
                    **T.FIT)
    train = {s: d["train/loss"] for s, d in w.calls if "train/loss" in d}
    assert sorted(train) == r.history.steps and np.allclose([train[s] for s in r.history.steps], r.history.loss)
    evals = {s: d["eval/loss"] for s, d in w.calls if "eval/loss" in d}
    assert sorted(evals) == r.history.eval_steps and np.allclose(list(evals.values()), r.history.eval_loss)
    grads = [d for _, d in w.calls if any(k.startswith("grad_norm/") for k in d)]
    assert grads and any("['h']['w']" in k for k in grads[0])
    assert w.flushes >= 1
    lines = [json.loads(x) for x in open(r.metrics_path)]           # JSONL stays the default
    assert sum(x["kind"] == "train" for x in lines) == len(r.history.steps)


def test_monitor_writer():
    exp = T.experiment(n=4)
    pure = jaxsane.PureExperiment(exp)
    w = FakeWriter()
    mon = jaxsane.Monitor(pure, every=2, log_every=1, lag=0, writer=w)
    state = pure.init(jax.random.key(0))
    for i, b in enumerate(itertools.islice(iter(exp.train), 4)):
        state, metrics = mon.step(state, b, mon.mode_for(i))
        mon.record(i, metrics, state, b)
    mon.record_eval(4, 0.5, accuracy=0.75)
    mon.pull()
    steps = [s for s, d in w.calls if "train/loss" in d]
    assert steps == [0, 1, 2, 3] and (4, {"eval/loss": 0.5, "eval/accuracy": 0.75}) in w.calls
    assert any(k.startswith("grad_norm/") for _, d in w.calls for k in d) and w.flushes >= 4


class NoFlush:
    def __init__(self):
        self.n = 0

    def write_scalars(self, step, scalars):
        self.n += 1


def test_writer_without_flush_is_fine_and_bad_writers_are_refused():
    w = NoFlush()
    jaxsane.fit(T.experiment(n=3), steps=3, eval_every=0, writer=w, **T.FIT)
    assert w.n == 3

    class TB:
        def add_scalar(self, tag, value, step): ...

    for bad, text in ((TB(), "TensorBoard SummaryWriter"), (FakeWriter, "class or factory"), ("logs", "protocol")):
        with pytest.raises(jaxsane.ArgumentError, match=r"\[jaxsane\] jaxsane.fit\(writer=\.\.\.\)") as e:
            jaxsane.fit(T.experiment(n=3), steps=3, writer=bad, **T.FIT)
        assert text in str(e.value) and "write_scalars(step, scalars)" in str(e.value)
    with pytest.raises(jaxsane.ArgumentError, match="Monitor"):
        jaxsane.Monitor(jaxsane.PureExperiment(T.experiment(n=3)), writer=object())
