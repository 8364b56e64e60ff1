"""The training monitor: in-graph telemetry and the train.* detectors, on healthy and faulty runs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsane
from jaxsane._doctor.doctor import doctor
from jaxsane._experiment.batches import iter_batches
from jaxsane._experiment.contract import PureExperiment
from jaxsane._monitor.monitor import (
    MODE_BARE,
    MODE_FULL,
    MODE_NORMS,
    History,
    Monitor,
    check_training,
    dead_fractions,
    depth_order,
    relu_outputs,
)
from jaxsane.examples import digits_optax as D, load
from jaxsane.examples._digits import train_eval


def digits(lr=3e-3, sign=1.0, bias=0.0, shuffle_eval=False):
    """The digits MLP of the optax example with one planted fault (all defaults: healthy)."""
    tx = optax.adam(lr)

    def init(key):
        params = D.init_params(key)
        params = [dict(layer, b=layer["b"] + (bias if i < len(params) - 1 else 0.0)) for i, layer in enumerate(params)]
        return params, tx.init(params)

    @jax.jit
    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(D.loss)(params, batch)
        updates, opt_state = tx.update(jax.tree.map(lambda g: sign * g, grads), opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    train, eval_ = train_eval()
    if shuffle_eval:
        eval_ = {"x": eval_["x"], "y": np.random.default_rng(1).permutation(eval_["y"])}
    return jaxsane.Experiment(init=init, step=step, train=train, eval=eval_, loss=D.loss, apply=D.apply,
                              num_classes=10, name="digits_fault")


def run_codes(exp):
    diagnosis = doctor(exp, stages=["run"], progress=False)
    return diagnosis, [f.code for f in diagnosis if f.code.startswith("train.")]


# ----------------------------------------------------------------------------- telemetry in the graph

@pytest.mark.slow
def test_telemetry_values_match_host_computation():
    exp = load("digits_optax")
    adapted = PureExperiment(exp)
    mon = Monitor(adapted, every=1, dead_every=1)
    state = adapted.init(jax.random.key(0))
    batch = next(iter(exp.train))
    new_state, metrics = mon.step(state, batch, MODE_FULL)
    tel = metrics["telemetry"]
    p0, p1 = jax.tree.leaves(state[0]), jax.tree.leaves(new_state[0])
    np.testing.assert_allclose(tel["param_norm"], [np.linalg.norm(np.asarray(x)) for x in p0], rtol=1e-5)
    np.testing.assert_allclose(tel["update_norm"], [np.linalg.norm(np.asarray(b) - np.asarray(a))
                                                    for a, b in zip(p0, p1)], rtol=1e-4, atol=1e-8)
    grads = jax.tree.leaves(jax.grad(D.loss)(state[0], batch))
    np.testing.assert_allclose(tel["grad_norm"], [np.linalg.norm(np.asarray(g)) for g in grads], rtol=1e-4)
    # dead fraction by hand: hidden units that are 0 on every example
    h = np.asarray(jax.nn.relu(batch["x"] @ state[0][0]["w"] + state[0][0]["b"]))
    assert tel["dead_fraction"].shape == (2,)
    np.testing.assert_allclose(tel["dead_fraction"][0], np.mean(np.all(h <= 0, axis=0)), atol=1e-6)
    # the bare mode is the user's step, unchanged
    bare_state, bare_metrics = mon.step(state, batch, MODE_BARE)
    assert "telemetry" not in bare_metrics
    np.testing.assert_array_equal(jax.tree.leaves(bare_state)[0], jax.tree.leaves(new_state)[0])
    sampled = Monitor(adapted, every=2, dead_every=4)
    assert [sampled.mode_for(i) for i in range(6)] == [MODE_FULL, MODE_BARE, MODE_NORMS, MODE_BARE, MODE_FULL,
                                                       MODE_BARE]


def test_monitor_queues_device_arrays_and_pulls_in_batches():
    exp = load("digits_optax")
    adapted = PureExperiment(exp)
    mon = Monitor(adapted, every=2, dead_every=0, log_every=4, lag=1)
    state = adapted.init(jax.random.key(0))
    for i, batch in enumerate(iter_batches(exp.train, 6)):
        state, metrics = mon.step(state, batch, mon.mode_for(i))
        mon.record(i, metrics, state, batch)
        assert isinstance(metrics["loss"], jax.Array)       # nothing was pulled per step
        # pulled in one batch of 4 once a 5th step is queued (the newest stays queued: it may still run)
        assert len(mon.history.steps) == (4 if i >= 4 else 0)
    h = mon.pull()
    assert h.steps == list(range(6)) and h.tele_steps == [0, 2, 4] and h.grad_steps == [0, 2, 4]
    assert h.dead_steps == [] and all(np.isfinite(h.loss))
    assert [h.leaf_paths[i] for i in h.depth][0] == "params[0]['w']"


def test_monitor_compiles_each_mode_once():
    exp = load("digits_optax")
    adapted = PureExperiment(exp)
    mon = Monitor(adapted, every=1, dead_every=2)
    state = adapted.init(jax.random.key(0))
    for i, batch in enumerate(iter_batches(exp.train, 4)):
        state, _ = mon.step(state, batch, mon.mode_for(i))
    assert mon._jitted[MODE_FULL]._cache_size() == 1 and mon._jitted[MODE_NORMS]._cache_size() == 1
    assert mon._jitted[MODE_BARE]._cache_size() == 0    # dead_every=2, every=1: never bare


def test_relu_capture_and_depth_order():
    def apply(params, x):
        h = jax.nn.relu(x @ params["a"])
        h = jnp.maximum(h @ params["b"] + params["bias"], 0.0)
        return jnp.tanh(h @ params["c"])

    params = {"a": jnp.ones((3, 4)), "b": -jnp.ones((4, 5)), "bias": jnp.zeros(5), "c": jnp.ones((5, 2))}
    x = jnp.ones((2, 3))
    relus = jax.jit(relu_outputs, static_argnums=0)(apply, params, x)
    assert [r.shape for r in relus] == [(2, 4), (2, 5)]
    np.testing.assert_allclose(dead_fractions(relus), [0.0, 1.0])
    order = depth_order(apply, params, x)
    names = sorted(params)  # tree order: a, b, bias, c
    assert [names[i] for i in order] == ["a", "b", "bias", "c"]
    # reversed names do not fool the order: it follows the data flow
    rev = {"z": params["a"], "y": params["b"], "x": params["bias"], "w": params["c"]}
    order = depth_order(lambda p, x: apply({"a": p["z"], "b": p["y"], "bias": p["x"], "c": p["w"]}, x), rev, x)
    assert [sorted(rev)[i] for i in order] == ["z", "y", "x", "w"]


# ----------------------------------------------------------------------------- detectors on real runs

@pytest.mark.slow
@pytest.mark.parametrize("name", ["digits_optax", "digits_nnx", "digits_linen"])
def test_healthy_examples_trigger_no_train_findings(name):
    diagnosis, codes = run_codes(load(name))
    assert codes == [], [str(f) for f in diagnosis]
    run = diagnosis.artifacts["run"]
    assert len(run["loss"]) == 30 and run["loss"][-1] < run["loss"][0]
    assert len(run["eval_loss"]) == 7 and len(run["grad_norm"]) == 30 and len(run["dead_fraction"]) == 6


@pytest.mark.parametrize("fault, expected", [
    (dict(lr=0.3), "train.update_ratio"),          # learning rate 100x too high
    (dict(lr=0.0), "train.update_ratio"),          # learning rate 0
    (dict(sign=-1.0), "train.diverging"),          # gradient ascent
    (dict(bias=-10.0), "train.dead_units"),        # ReLUs killed by a large negative bias
    (dict(shuffle_eval=True), "train.overfitting"),  # eval labels shuffled
])
def test_faulty_runs_are_reported(fault, expected):
    diagnosis, codes = run_codes(digits(**fault))
    assert expected in codes, [str(f) for f in diagnosis]
    finding = diagnosis.by_code(expected)[0]
    assert finding.hint and finding.severity in ("warning", "error")
    if "lr" in fault:
        assert diagnosis.by_code(expected)[0].extra["direction"] == ("high" if fault["lr"] else "low")


# ----------------------------------------------------------------------------- detectors on histories

def _history(loss, **kw):
    return History(steps=list(range(len(loss))), loss=list(map(float, loss)), **kw)


def _codes(h, **kw):
    return [f.code for f in check_training(h, **kw)]


def test_loss_rules_judge_windows_not_single_steps():
    rng = np.random.default_rng(0)
    falling = 2.3 * np.exp(-np.arange(60) / 20) + 0.05 * rng.random(60)
    assert _codes(_history(falling)) == []
    spiky = falling.copy()
    spiky[[30, 45, 59]] = 50.0                 # single spikes, even at the very end: not a trend, but spikes
    assert _codes(_history(spiky)) == ["train.loss_spike"]
    assert _codes(_history(2.3 * np.exp(np.arange(60) / 15))) == ["train.diverging"]
    assert _codes(_history([2.3] * 20 + [float("nan")] * 10)) == ["train.diverging"]
    assert _codes(_history(2.3 + 0.001 * rng.random(40))) == ["train.plateau"]
    zigzag = 2.0 + 1.5 * np.where(np.arange(60) % 2, 1.0, -1.0) * rng.uniform(0.5, 1, 60)
    assert _codes(_history(zigzag)) == ["train.oscillating"]
    assert _codes(_history(zigzag), oscillation_rel=10.0) == []   # thresholds are overridable
    assert _codes(_history(2.3 + 0.001 * rng.random(5))) == []    # too short to judge


def test_update_ratio_band():
    p = [[1.0, 10.0]] * 12
    h = _history(np.linspace(2, 1, 12), tele_steps=list(range(12)), param_norm=p,
                 update_norm=[[1e-3, 1e-2]] * 12, weight_leaves=[0, 1], leaf_paths=["w0", "w1"], depth=[0, 1])
    assert _codes(h) == []
    h.update_norm = [[1e-3, 1e-2]] * 11 + [[5.0, 1e-2]]      # one burst step: not judged
    assert _codes(h) == []
    h.update_norm = [[0.5, 1e-2]] * 4 + [[1e-3, 1e-2]] * 8   # an early window above 1e-1
    assert _codes(h) == ["train.update_ratio"]
    h.update_norm = [[1e-3, 0.0]] * 12                         # w1 frozen
    (f,) = check_training(h)
    assert f.code == "train.update_ratio" and f.path == "w1" and f.extra["direction"] == "low"
    assert _codes(h, update_ratio_low=0.0) == []


def test_update_ratio_ignores_leaves_that_grow_from_zero():
    # w0 is a zero-initialised bias: large |update|/|param| while it grows from nothing is not a finding
    grow = np.linspace(0.0, 1.0, 12)
    p = [[g, 10.0] for g in grow]
    h = _history(np.linspace(2, 1, 12), tele_steps=list(range(12)), param_norm=p,
                 update_norm=[[0.5, 1e-2]] * 12, weight_leaves=[0, 1], leaf_paths=["b0", "w1"], depth=[0, 1])
    assert _codes(h) == []
    h.param_norm = [[1.0, 10.0]] * 12     # the same updates on a leaf at its init scale: too large
    assert _codes(h) == ["train.update_ratio"]


def test_a_warmup_from_zero_does_not_hide_where_a_leaf_started():
    """A schedule that warms up from a rate of 0 moves nothing on the first sampled step, which the ratio's
    median leaves out; the zero-initialised bias's start is still that first sample (a healthy NNX LM with
    optax.warmup_cosine_decay_schedule(0.0, ...) drew 'updates are too large' on an attention bias)."""
    grow = [0.0, *np.linspace(0.2, 1.0, 7)]  # the bias: 0 at the first sample (rate 0), then grown by the next
    h = _history(np.linspace(2, 1, 8), tele_steps=list(range(0, 32, 4)), param_norm=[[g, 10.0] for g in grow],
                 update_norm=[[0.0, 0.0]] + [[0.3, 1e-2]] * 7, weight_leaves=[0, 1], leaf_paths=["b0", "w1"],
                 depth=[0, 1])  # fmt: skip
    assert _codes(h) == []
    h.param_norm = [[1.0, 10.0]] * 8  # the same updates on a leaf at its init scale: too large, warmup or not
    assert _codes(h) == ["train.update_ratio"]


def test_kernels_the_optimizer_holds_though_they_have_gradients_are_said_not_blamed():
    """A frozen backbone (optax.multi_transform with set_to_zero) has gradients and no update: an info, not the
    'updates are too small' warning; a kernel cut off from the loss (stop_gradient) has neither: the warning."""
    tele = dict(tele_steps=list(range(12)), param_norm=[[1.0, 1.0, 1.0]] * 12, weight_leaves=[0, 1, 2],
                leaf_paths=["backbone0", "backbone1", "head"], depth=[0, 1, 2], grad_steps=list(range(12)))  # fmt: skip
    frozen = _history(np.linspace(2, 1, 12), update_norm=[[0.0, 0.0, 1e-3]] * 12, grad_norm=[[0.3, 0.2, 0.5]] * 12,
                      **tele)  # fmt: skip
    (f,) = check_training(frozen)
    assert f.code == "train.update_ratio" and f.severity == "info" and f.extra["direction"] == "held", f
    assert f.extra["held"] == ["backbone0", "backbone1"]
    cut_off = _history(np.linspace(2, 1, 12), update_norm=[[0.0, 0.0, 1e-3]] * 12, grad_norm=[[0.0, 0.0, 0.5]] * 12,
                       **tele)  # fmt: skip
    (f,) = [f for f in check_training(cut_off) if f.code == "train.update_ratio"]  # (and vanishing gradients)
    assert f.severity == "warning" and f.extra["direction"] == "no_gradient", f
    assert f.extra["leaves"] == ["backbone0", "backbone1"] and "no learning rate is the cause" in f.message
    rounded = _history(np.linspace(2, 1, 12), update_norm=[[0.0, 0.0, 1e-3]] * 12, grad_norm=[[0.3, 0.2, 0.5]] * 12,
                       lost_steps=list(range(12)), update_lost=[[1.0, 1.0, 0.0]] * 12, **tele)  # fmt: skip
    assert all(f.extra["direction"] != "held" for f in check_training(rounded) if f.code == "train.update_ratio"), (
        "bf16 updates that round away stand still too: train.update_underflow's, not a frozen backbone"
    )
    everything = _history(np.linspace(2, 1, 12), update_norm=[[0.0] * 3] * 12, grad_norm=[[0.3] * 3] * 12, **tele)
    assert [f.severity for f in check_training(everything)] == ["warning"], "every kernel held: not a backbone"


def test_a_kernel_no_gradient_reaches_is_blamed_on_the_loss_not_the_learning_rate():
    """A WaveNet's last residual projection, whose output the model never reads: exactly zero gradient on every
    sample, so its updates are tiny (Adam's weight decay only), and raising the learning rate would change nothing;
    a kernel with a small but real gradient is still 'updates are too small'."""
    tele = dict(tele_steps=list(range(12)), param_norm=[[1.0, 1.0]] * 12, weight_leaves=[0, 1],
                leaf_paths=["blocks[9].res", "head"], depth=[0, 1], grad_steps=list(range(12)))  # fmt: skip
    unused = _history(np.linspace(2, 1, 12), update_norm=[[1e-9, 1e-3]] * 12, grad_norm=[[0.0, 0.5]] * 12, **tele)
    (f,) = [f for f in check_training(unused) if f.code == "train.update_ratio"]
    assert f.extra["direction"] == "no_gradient" and f.path == "blocks[9].res" and "raise the learning" not in f.hint
    small = _history(np.linspace(2, 1, 12), update_norm=[[1e-9, 1e-3]] * 12, grad_norm=[[1e-4, 0.5]] * 12, **tele)
    (f,) = [f for f in check_training(small) if f.code == "train.update_ratio"]
    assert f.extra["direction"] == "low" and "raise the learning rate" in f.hint


def test_a_plateau_while_the_updates_still_grow_is_not_judged():
    """The first steps of a learning-rate warmup from 0 leave the loss flat in a model that learns: with the
    updates still growing over the run's second half the plateau is not judged; with steady updates (Adam at a
    rate too small, momentum built up) it is the warning."""
    steps = list(range(30))
    flat = 6.68 + 0.005 * np.sin(np.arange(30))
    tele = dict(tele_steps=steps, param_norm=[[10.0]] * 30, weight_leaves=[0], leaf_paths=["w"], depth=[0])
    warmup = _history(flat, update_norm=[[1e-3 * (i + 1)] for i in steps], **tele)
    (f,) = check_training(warmup)
    assert f.code == "doctor.skipped" and "train.plateau not judged" in f.message and "run_steps" in f.hint, f
    steady = _history(flat, update_norm=[[1e-3]] * 30, **tele)
    assert _codes(steady) == ["train.plateau"]
    momentum = _history(flat, update_norm=[[1e-3 * (1 - 0.9 ** (i + 1))] for i in steps], **tele)
    assert _codes(momentum) == ["train.plateau"], "momentum has built up by the second half"


def test_overfitting_needs_the_eval_loss_to_climb_back_a_share_of_its_fall():
    """A noisy eval near zero after a long fall is not overfitting; the same relative rise after a short fall, or
    from the start (a mislabeled eval split), is."""
    train = np.linspace(2.8, 0.05, 30)
    noisy = _history(train, eval_steps=[0, 5, 10, 15, 20, 25, 30], eval_loss=[2.8, 0.3, 0.02, 0.008, 0.006, 0.005, 0.0121])
    assert "train.overfitting" not in _codes(noisy)
    climbing = _history(train, eval_steps=[0, 5, 10, 15, 20, 25, 30], eval_loss=[2.3, 1.2, 0.6, 0.5, 0.7, 0.85, 0.95])
    assert "train.overfitting" in _codes(climbing)
    mislabeled = _history(train, eval_steps=[0, 5, 10, 15, 20, 25, 30], eval_loss=[2.3, 2.4, 2.6, 2.9, 3.3, 3.6, 4.0])
    assert "train.overfitting" in _codes(mislabeled)


def test_gradient_rules_follow_autotrainer_thresholds():
    base = dict(grad_steps=list(range(10)), weight_leaves=[0, 1, 2], leaf_paths=["first", "mid", "last"],
                depth=[0, 1, 2])
    healthy = _history(np.linspace(2, 1, 10), grad_norm=[[0.5, 0.7, 1.0]] * 10, **base)
    assert _codes(healthy) == []
    vanishing = _history(np.linspace(2, 1, 10), grad_norm=[[1e-6, 1e-2, 1.0]] * 10, **base)
    assert _codes(vanishing) == ["train.vanishing_grads"]
    small_but_balanced = _history(np.linspace(2, 1, 10), grad_norm=[[1e-5, 1e-5, 1e-5]] * 10, **base)
    assert _codes(small_but_balanced) == []                    # ratio 1: both conditions are needed
    exploding = _history(np.linspace(2, 1, 10), grad_norm=[[100.0, 10.0, 1.0]] * 10, **base)
    assert _codes(exploding) == ["train.exploding_grads"]
    assert _codes(exploding, exploding_ratio=200) == []
    growing = _history(np.linspace(2, 1, 10), grad_norm=[[10.0 ** k] * 3 for k in range(10)], **base)
    assert _codes(growing) == ["train.exploding_grads"]
    # depth order, not tree order, decides which leaf is "first"
    reordered = _history(np.linspace(2, 1, 10), grad_norm=[[1.0, 1e-2, 1e-6]] * 10, **{**base, "depth": [2, 1, 0]})
    assert _codes(reordered) == ["train.vanishing_grads"]


def test_dead_units_rule():
    h = _history(np.linspace(2, 1, 10), dead_steps=list(range(5)), dead_fraction=[[0.1, 0.69]] * 5)
    assert _codes(h) == []
    h.dead_fraction = [[0.1, 0.7]] * 5
    (f,) = check_training(h)
    assert f.code == "train.dead_units" and f.path == "relu[1]"
    h.dead_fraction = [[0.1, 0.9]] + [[0.1, 0.2]] * 4          # one bad sample: not judged
    assert _codes(h) == []


def test_overfitting_rule():
    train = np.linspace(2.3, 0.3, 30)
    h = _history(train, eval_steps=[0, 10, 20, 30], eval_loss=[2.3, 1.5, 1.2, 1.1])
    assert _codes(h) == []
    h.eval_loss = [2.3, 2.2, 2.9, 3.5]
    (f,) = check_training(h)
    assert f.code == "train.overfitting" and f.extra["best_step"] == 10
    h.eval_loss = [2.3, 1.5, 1.2, 1.25]                        # a small wobble is not overfitting
    assert _codes(h) == []
    h2 = _history(np.linspace(2.3, 2.5, 30), eval_steps=[0, 10, 20, 30], eval_loss=[2.3, 2.2, 2.9, 3.5])
    assert "train.overfitting" not in _codes(h2)                # train did not fall: not overfitting


def test_history_round_trips_through_json():
    import json
    h = _history([2.0, float("nan"), 1.0], tele_steps=[0], param_norm=[[1.0]], update_norm=[[-1.0]],
                 eval_steps=[0], eval_loss=[2.0])
    back = History.from_dict(json.loads(json.dumps(h.to_dict())))
    assert back.steps == h.steps and np.isnan(back.loss[1]) and back.eval_loss == [2.0]
    assert np.isnan(back.arrays("update_norm")[0, 0])          # the -1 sentinel reads as "not finite"


def test_no_loss_rule_fires_without_finite_losses():
    """State-only steps record NaN losses: no train.diverging "from nan to nan", no plateau, no oscillation."""
    nan = float("nan")
    for n in (12, 40):
        assert _codes(_history([nan] * n)) == []
    # other rules still judge what was recorded (gradient norms do not need a loss)
    base = dict(grad_steps=list(range(12)), weight_leaves=[0, 1, 2], leaf_paths=["first", "mid", "last"],
                depth=[0, 1, 2])
    assert _codes(_history([nan] * 12, grad_norm=[[1e-6, 1e-2, 1.0]] * 12, **base)) == ["train.vanishing_grads"]
    # a loss that went non-finite after finite steps is still reported, with finite numbers and the step
    (f,) = check_training(_history([2.3] * 20 + [nan] * 10))
    assert f.code == "train.diverging" and "went non-finite" in f.message and f.step == 20
    assert "from nan" not in f.message and np.isfinite(f.extra["start"])
    # a few missing losses among finite ones are ignored, and a rising finite loss is still diverging
    rising = list(2.3 * np.exp(np.arange(60) / 15))
    rising[5] = rising[40] = nan
    assert _codes(_history(rising)) == ["train.diverging"]
    assert "nan" not in check_training(_history(rising))[0].message


def test_state_only_step_gets_no_loss_finding_from_the_run_stage():
    from tests._programs import batch, optax_init, optax_step_state_only

    exp = jaxsane.Experiment(init=optax_init, step=jax.jit(optax_step_state_only), train=batch(), num_classes=3)
    d = doctor(exp, stages=["run"], progress=False, run_steps=12)
    assert not [f for f in d if f.code in ("train.diverging", "train.plateau", "train.oscillating")], str(d)
    assert all(np.isnan(v) for v in d.artifacts["run"]["loss"] if v is not None)


def test_a_short_history_is_stacked_on_the_host_without_a_compile(monkeypatch):
    from jaxsane._monitor import monitor as _monitor
    trees = [{"loss": jnp.float32(i), "norms": jnp.arange(3.0) * i} for i in range(6)]
    with jaxsane.count_compilations(this_thread=True) as c:
        short = _monitor._stacked(trees)
    assert c.compiles == 0
    np.testing.assert_array_equal(short["norms"], np.arange(3.0)[None] * np.arange(6.0)[:, None])
    monkeypatch.setattr(_monitor, "_FETCH_EACH_MAX_LEAVES", 8)  # 6 trees x 2 leaves: now a long history
    with jaxsane.count_compilations(this_thread=True) as c:
        long = _monitor._stacked(trees)
    assert c.compiles == 1, "a long history is stacked on the device"
    for k in ("loss", "norms"):
        np.testing.assert_array_equal(long[k], short[k])
        assert long[k].dtype == short[k].dtype


def test_the_jumps_of_a_diverging_loss_are_consequences_of_train_diverging():
    # the loss runs away (x2.5 a step after step 20): train.diverging is the root, its spikes fold beneath it
    loss = [2.3 + 0.01 * (i % 3) for i in range(20)] + [2.3 * 2.5**k for k in range(1, 21)]
    found = {f.code: f for f in check_training(_history(loss))}
    assert "train.diverging" in found and "train.loss_spike" in found
    assert found["train.loss_spike"].caused_by.code == "train.diverging"
    # a spike in a run that does not diverge stays a root
    calm = [2.3 + 0.01 * (i % 3) for i in range(40)]
    calm[30] = 40.0
    (spike,) = [f for f in check_training(_history(calm)) if f.code == "train.loss_spike"]
    assert spike.caused_by is None


def test_steps_that_moved_no_weight_are_skipped_steps_not_small_updates():
    """Gradient accumulation (optax.MultiSteps(4)) moves the weights on one step in four: the three between are
    skipped steps, not updates too small; a run where nothing ever moves is still frozen."""
    p = [[1.0, 10.0]] * 16
    moves = [[1e-3, 1e-2] if i % 4 == 3 else [0.0, 0.0] for i in range(16)]
    h = _history(np.linspace(2, 1, 16), tele_steps=list(range(16)), param_norm=p, update_norm=moves,
                 weight_leaves=[0, 1], leaf_paths=["w0", "w1"], depth=[0, 1])
    assert _codes(h) == []
    h.update_norm = [[0.0, 0.0]] * 16  # nothing ever moved: frozen (learning rate 0)
    (f,) = check_training(h)
    assert f.code == "train.update_ratio" and f.extra["direction"] == "low" and f.extra["ratio"] == 0.0
