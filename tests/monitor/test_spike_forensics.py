"""train.loss_spike explained: the examples of the spiking batch that carry the gradient, Adam's second moment,
and fit(on_spike=...) with the non-finite vocabulary (rollback skips only the offending batch)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsane
from jaxsane._core.errors import FitArgumentError
from jaxsane._experiment.contract import PureExperiment
from jaxsane._monitor.spike_forensics import carriers, explain_spike

BAD_BATCH, BAD_EXAMPLES = 40, (3, 17)


def regression(corrupt: bool, steps=60, n=32, d=8, seed=0):
    """Linear regression with Adam; with ``corrupt`` two examples of one batch have absurd targets."""
    rng = np.random.default_rng(seed)
    w_true = rng.normal(size=(d, 1)).astype(np.float32)
    batches = []
    for i in range(steps):
        x = rng.normal(size=(n, d)).astype(np.float32)
        y = x @ w_true + 0.1 * rng.normal(size=(n, 1)).astype(np.float32)
        if corrupt and i == BAD_BATCH:
            y[list(BAD_EXAMPLES)] = 300.0
        batches.append({"x": x, "y": y})
    tx = optax.adam(1e-2)

    def loss(params, batch):
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

    def init(key):
        params = {"w": 0.1 * jax.random.normal(key, (d, 1))}
        return {"params": params, "opt": tx.init(params)}

    def step(state, batch):
        value, g = jax.value_and_grad(loss)(state["params"], batch)
        updates, opt = tx.update(g, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": value}

    return jaxsane.Experiment(init=init, step=step, train=batches, loss=loss, name="spiky" if corrupt else "clean")


def spike_findings(result):
    return [f for f in result.diagnosis if f.code == "train.loss_spike"]


def test_carriers_names_few_examples_or_none():
    assert carriers(np.array([0.1] * 30 + [10.0, 9.0])) == [30, 31]  # both outliers, the largest first
    assert carriers(np.ones(32)) == []  # spread over the batch: nobody to blame
    assert carriers(np.zeros(4)) == []


def test_explain_spike_names_corrupt_examples():
    exp = regression(corrupt=True)
    pure = PureExperiment(exp)
    state = pure.init(jax.random.key(0))
    for batch in exp.train[:10]:
        state, _ = pure.step(state, batch)
    f = explain_spike(pure, state, exp.train[BAD_BATCH], step=BAD_BATCH)
    assert f.code == "train.loss_spike" and sorted(f.extra["examples"]) == list(BAD_EXAMPLES)
    assert "#3" in f.message and "#17" in f.message
    assert f.extra["adam_lag"] > 10 and "second moment lagged" in f.message  # |g| jumped far above sqrt(nu)
    calm = explain_spike(pure, state, exp.train[BAD_BATCH - 1], step=BAD_BATCH - 1)
    assert calm.extra["examples"] == [] and calm.extra["adam_lag"] < 10


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["rollback", "skip"])  # a spike is seen after its update: skip rolls back too
def test_fit_on_spike_rollback_skips_only_the_batch(tmp_path, policy):
    with pytest.warns(jaxsane.JaxsaneWarning, match="loss spike"):
        result = jaxsane.fit(regression(corrupt=True), steps=60, progress=False, on_spike=policy,
                             rollback_every=5, dump_dir=str(tmp_path))
    assert result.skipped_batches == [BAD_BATCH] and result.rollbacks == 1
    found = spike_findings(result)
    assert len(found) == 1 and found[0].step == BAD_BATCH
    assert sorted(found[0].extra["examples"]) == list(BAD_EXAMPLES)
    assert found[0].extra["dump"] and (tmp_path / f"spike_step{BAD_BATCH}").is_dir()
    assert BAD_BATCH not in result.history.steps


@pytest.mark.slow
def test_fit_on_spike_warn_records_and_clean_run_is_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = jaxsane.fit(regression(corrupt=True), steps=60, progress=False, rollback_every=5)
    assert result.rollbacks == 0 and result.skipped_batches == []
    found = spike_findings(result)
    assert len(found) == 1 and sorted(found[0].extra["examples"]) == list(BAD_EXAMPLES)
    clean = jaxsane.fit(regression(corrupt=False), steps=60, progress=False, rollback_every=5)
    assert spike_findings(clean) == []


def test_fit_on_spike_is_checked():
    with pytest.raises(FitArgumentError, match="on_spike"):
        jaxsane.fit(regression(corrupt=False), steps=2, progress=False, on_spike="ignore")
