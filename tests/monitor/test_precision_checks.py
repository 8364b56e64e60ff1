"""train.update_underflow (bf16 updates that round away, measured by a float32 shadow step) and
train.loss_spike (median + k·MAD), on faulty and correct runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsane
from jaxsane._core.history import History
from jaxsane._experiment.contract import PureExperiment
from jaxsane._monitor.monitor import Monitor, check_training
from jaxsane._monitor.precision_checks import spike_steps
from jaxsane._precision.underflow import lost_fractions, proxy_lost_fractions


def regression(param_dtype, lr, steps=30, n=64, d=16, seed=0):
    """A linear regression trained with plain SGD, its weights stored in ``param_dtype``."""
    rng = np.random.default_rng(seed)
    w_true = rng.normal(size=(d, 1)).astype(np.float32)
    x = rng.normal(size=(steps, n, d)).astype(np.float32)
    batches = [{"x": xb, "y": xb @ w_true} for xb in x]

    def loss(params, batch):
        pred = batch["x"].astype(params["w"].dtype) @ params["w"]
        return jnp.mean((pred.astype(jnp.float32) - batch["y"]) ** 2)

    def init(key):
        w = jax.random.normal(key, (d, 1)) * 2.0 + 4.0  # large weights: a bf16 ulp is 2^-5 here
        return {"params": {"w": w.astype(param_dtype)}}

    def step(state, batch):
        value, g = jax.value_and_grad(loss)(state["params"], batch)
        new = jax.tree.map(lambda p, gi: (p - lr * gi).astype(p.dtype), state["params"], g)
        return {"params": new}, {"loss": value}

    return jaxsane.Experiment(init=init, step=step, train=batches, loss=loss, name=f"reg_{jnp.dtype(param_dtype)}")


def run_monitor(exp, steps=20):
    pure = PureExperiment(exp)
    mon = Monitor(pure, every=1, dead_every=0)
    state = pure.init(jax.random.key(0))
    for i, batch in enumerate(exp.train[:steps]):
        state, metrics = mon.step(state, batch, mon.mode_for(i))
        mon.record(i, metrics, state, batch)
    return mon, mon.pull()


def test_pure_bf16_small_lr_is_update_underflow():
    mon, h = run_monitor(regression(jnp.bfloat16, lr=1e-4))
    assert mon._shadow_ok is True  # measured by the float32 shadow step, not the proxy
    assert len(h.update_lost) == 20 and min(r[0] for r in h.update_lost) > 0.9
    found = [f for f in check_training(h) if f.code == "train.update_underflow"]
    assert found and found[0].path == h.leaf_paths[0] and "float32 master weights" in found[0].hint


def test_float32_master_weights_and_large_lr_are_clean():
    _, h = run_monitor(regression(jnp.float32, lr=1e-4))
    assert h.update_lost == []  # a float32 model is not measured at all (no shadow, no cost)
    assert "train.update_underflow" not in [f.code for f in check_training(h)]
    _, h = run_monitor(regression(jnp.bfloat16, lr=3e-3))  # bf16 with updates above half an ulp
    assert h.update_lost and "train.update_underflow" not in [f.code for f in check_training(h)]


def test_frozen_bf16_leaf_is_not_underflow():
    old = [jnp.ones((4,), jnp.bfloat16)]
    # the shadow did not move either (a frozen leaf): nothing lost
    assert float(lost_fractions(old, old, [old[0].astype(jnp.float32)])[0]) == 0.0
    # proxy: gradient non-zero but no element moved -> frozen, not counted; some moved -> counted
    g = [jnp.ones((4,), jnp.float32)]
    assert float(proxy_lost_fractions(old, old, g)[0]) == 0.0
    moved = [old[0].at[0].set(2.0)]
    assert float(proxy_lost_fractions(old, moved, g)[0]) == pytest.approx(0.75)
    # float32 leaves are not measured
    assert float(lost_fractions([jnp.ones(3)], [jnp.ones(3)], [jnp.ones(3) * 2])[0]) == -1.0


def test_underflow_threshold_is_overridable():
    h = History(steps=list(range(12)), loss=list(np.linspace(2.0, 1.0, 12)), leaf_paths=["params.w", "params.b"],
                lost_steps=[0, 1, 2], update_lost=[[0.3, -1.0], [0.3, -1.0], [0.4, -1.0]])
    assert [f.code for f in check_training(h)] == ["train.update_underflow"]
    assert check_training(h, underflow_fraction=0.5) == []


def test_spike_rule_median_mad():
    rng = np.random.default_rng(0)
    loss = 1.0 + 0.05 * rng.standard_normal(100)
    assert spike_steps(loss) == []  # ordinary noise: no spike
    loss[60] = 3.0
    assert [i for i, _, _ in spike_steps(loss)] == [60]
    assert spike_steps(loss, k=100.0, rel=5.0) == []  # overridable
    falling = 2.3 * np.exp(-np.arange(80) / 20) + 0.01 * rng.random(80)
    assert spike_steps(falling) == []  # a falling loss never spikes
    shift = np.r_[np.ones(40), 3 * np.ones(60)]  # a lasting level shift stops counting
    assert len(spike_steps(shift)) < 30


@pytest.mark.slow
def test_doctor_names_underflow_not_no_update():
    from jaxsane._doctor.doctor import doctor

    bad = doctor(regression(jnp.bfloat16, lr=1e-4), stages=["step", "run"], progress=False)
    codes = [f.code for f in bad]
    assert "train.update_underflow" in codes and "step.no_update" not in codes
    good = doctor(regression(jnp.float32, lr=1e-4), stages=["step", "run"], progress=False)
    assert "train.update_underflow" not in [f.code for f in good]
