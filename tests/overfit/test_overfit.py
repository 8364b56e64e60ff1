"""The vmapped overfit-one-batch sweep: healthy programs fit, broken ones are named."""

import math

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
import pytest

import jaxsane
from jaxsane import overfit
from jaxsane._overfit.setup import learning_rate_paths
from jaxsane.examples import load
from jaxsane.examples._digits import load_digits_split


def _batch(n=16):
    x, y, _, _ = load_digits_split()
    return {"x": x[:n], "y": y[:n]}


def _tiny(kind="healthy", inject=False, lr=1e-2, opt=optax.adam):
    """A 64-32-10 MLP in pure optax; ``kind`` plants one bug in the step or the model."""
    tx = optax.inject_hyperparams(opt)(learning_rate=lr) if inject else opt(lr)

    def init(key):
        k1, k2 = jax.random.split(key)
        params = {"w1": jax.random.normal(k1, (64, 32)) / 8.0, "b1": jnp.zeros(32),
                  "w2": jax.random.normal(k2, (32, 10)) / math.sqrt(32), "b2": jnp.zeros(10)}
        return params, tx.init(params), jnp.zeros((), jnp.int32)

    def apply(params, x):
        if kind == "ignores_input":
            x = jnp.zeros_like(x)  # BUG: the input is never used
        h = jax.nn.relu(x @ params["w1"] + params["b1"])
        return h @ params["w2"] + params["b2"]

    def loss(params, batch):
        return optax.softmax_cross_entropy_with_integer_labels(apply(params, batch["x"]), batch["y"]).mean()

    @jax.jit
    def step(state, batch):
        params, opt_state, count = state
        if kind == "shuffled_labels":  # BUG: labels permuted independently of the inputs, every step
            perm = jax.random.permutation(jax.random.fold_in(jax.random.key(1), count), batch["y"].shape[0])
            batch = {"x": batch["x"], "y": batch["y"][perm]}
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if kind == "no_update":  # BUG: the update is computed but never applied
            new_params = params
        return (new_params, opt_state, count + 1), {"loss": value}

    return jaxsane.Experiment(init=init, step=step, train=_batch(), loss=loss, apply=apply, name=kind)


@pytest.mark.parametrize("name", ["digits_optax", "digits_linen", "digits_nnx"])
def test_bundled_healthy_examples_fit(name):
    result = overfit(load(name), seeds=2, steps=150)
    assert result.ok, result.table()
    assert "overfit.failed" not in result.codes and "model.ignores_input" not in result.codes
    assert result.reached[result.real].all()
    assert result.verdicts[-1] == "baseline" and result.configs[-1].baseline
    # the baseline (constant inputs, same labels) cannot memorise the batch
    assert not result.reached[result.baseline]
    assert "overfit.no_lr_sweep" in result.codes  # the examples use plain optax.adam
    assert result.losses.shape == (3, result.steps_run) and result.compiles == 1


@pytest.mark.parametrize("kind", ["shuffled_labels", "no_update"])
def test_broken_steps_fail(kind):
    result = overfit(_tiny(kind), seeds=2, steps=150)
    assert "overfit.failed" in result.codes, result.table()
    assert not result.ok and not result.reached[result.real].any()
    assert result.steps_run == 150  # no early exit: nobody reached the target
    failed = next(f for f in result.findings if f.code == "overfit.failed")
    assert failed.severity == "error" and "labels" in failed.hint


def test_healthy_tiny_passes_and_exits_early():
    result = overfit(_tiny("healthy"), seeds=2, steps=300)
    assert result.ok and result.codes == ["overfit.no_lr_sweep", "overfit.best"], result.table()
    assert result.steps_run < 300  # early exit once every real configuration fits


def test_model_ignoring_input_is_reported():
    result = overfit(_tiny("ignores_input"), seeds=2, steps=150)
    assert "model.ignores_input" in result.codes and "overfit.failed" in result.codes, result.table()


def test_learning_rates_are_set_per_configuration_and_compile_once():
    exp = _tiny("healthy", inject=True)
    adapted = jaxsane._experiment.contract.PureExperiment(exp)
    assert len(learning_rate_paths(adapted.example_state)) == 1
    result = overfit(adapted, seeds=2, learning_rates=[0.0, 1e-2], init_scales=[0.0, 1.0], steps=75,
                     chunk=25, early_exit=False)
    assert result.compiles == 1 and result.steps_run == 75  # three chunks in one compiled while_loop
    assert result.lr_swept and "overfit.no_lr_sweep" not in result.codes
    lr = np.array([c.learning_rate if c.learning_rate is not None else np.nan for c in result.configs])
    scale = np.array([c.init_scale for c in result.configs])
    real = result.real
    # learning rate 0: the loss never moves; 1e-2 at scale 1 fits
    assert np.allclose(result.losses[real][lr[real] == 0.0][:, -1], result.losses[real][lr[real] == 0.0][:, 0])
    assert result.reached[real][(lr[real] == 1e-2) & (scale[real] == 1.0)].all()
    # init scale 0: every parameter is zero, so the logits are uniform and the loss is exactly ln 10
    assert np.allclose(result.losses[real][scale[real] == 0.0][:, 0], math.log(10), atol=1e-5)
    best = next(f for f in result.findings if f.code == "overfit.best")
    assert best.extra["learning_rate"] == pytest.approx(1e-2) and best.extra["init_scale"] == 1.0
    # the default baseline uses the state's own rate (1e-2), scale 1
    assert result.configs[result.baseline].learning_rate == pytest.approx(1e-2)


@pytest.mark.slow
def test_nnx_learning_rate_sweep():
    from flax import nnx

    from jaxsane.examples import digits_nnx

    def init(key):
        model = digits_nnx.MLP(nnx.Rngs(params=key), hidden=32)
        return model, nnx.Optimizer(model, optax.inject_hyperparams(optax.adam)(learning_rate=3e-3), wrt=nnx.Param)

    exp = jaxsane.Experiment(init=init, step=digits_nnx.train_step, train=_batch(), loss=digits_nnx.loss,
                             apply=lambda m, x: m(x), name="nnx_inject")
    result = overfit(exp, seeds=1, learning_rates=[0.0, 1e-2], steps=100)
    assert [c.learning_rate for c in result.configs[:2]] == pytest.approx([0.0, 1e-2])
    assert result.verdicts[:2] == ("fails", "fits"), result.table()
    assert np.allclose(result.losses[0], result.losses[0, 0])
    assert result.ok  # one configuration fits: not overfit.failed


def test_no_lr_sweep_is_said_when_rates_are_asked_but_not_injectable():
    result = overfit(_tiny("healthy"), seeds=1, learning_rates=[1e-3, 1e-2], steps=50, baseline=False)
    assert len(result.configs) == 1 and result.configs[0].learning_rate is None
    info = next(f for f in result.findings if f.code == "overfit.no_lr_sweep")
    assert info.severity == "info" and "inject_hyperparams" in info.hint


def test_result_table_and_plot():
    result = overfit(_tiny("healthy"), seeds=1, steps=50)
    text = str(result)
    assert "constant" in text and "fits" in text and result.table() == text
    fig = result.plot()
    assert isinstance(fig, matplotlib.figure.Figure)
    assert len(fig.axes[0].lines) >= 3  # one real config, the baseline, the target line
    assert fig.axes[0].get_legend() is not None  # outside the axes, see tests/render/test_report.py


def test_missing_loss_raises_clear_error():
    exp = _tiny("healthy")

    def step(state, batch):  # reports no loss
        return exp.step(state, batch)[0]

    bare = jaxsane.Experiment(init=exp.init, step=step, train=exp.train)
    with pytest.raises(jaxsane.ExperimentError, match="overfit needs a loss"):
        overfit(bare, steps=25)


@pytest.mark.slow
def test_doctor_overfit_stage():
    diagnosis = jaxsane.doctor(_tiny("no_update"), stages=["overfit"], progress=False, overfit_steps=50)
    assert "overfit.failed" in diagnosis.codes
    assert isinstance(diagnosis.artifacts["overfit"], jaxsane.OverfitResult)
    assert isinstance(diagnosis.artifacts["overfit"].plot(), matplotlib.figure.Figure)
    assert isinstance(diagnosis.artifacts["init_scales"], jaxsane.InitScaleSweep)
    healthy = jaxsane.doctor(_tiny("healthy"), stages=["overfit"], progress=False)
    assert healthy.ok and "overfit.best" in healthy.codes, str(healthy)


def test_group_layout_puts_a_real_configuration_in_every_group():
    from jaxsane._overfit.sweep import group_layout

    layout = group_layout(n_real=5, baseline=5, groups=2)
    assert layout.groups == 2 and layout.size == 3
    held = sorted(int(c) for c in layout.slots[~layout.padding])
    assert held == [0, 1, 2, 3, 4, 5]  # every configuration once, the padding aside
    assert all(any(c < 5 for c in row[~pad]) for row, pad in zip(layout.slots, layout.padding))
    # never more groups than real configurations: a group of only the baseline could not exit early
    assert group_layout(n_real=1, baseline=1, groups=8).groups == 1
    padded = group_layout(n_real=4, baseline=None, groups=3)
    assert padded.padding.sum() == 2 and padded.slots.shape == (3, 2)


def test_groups_run_side_by_side_and_give_the_same_sweep():
    """Splitting the configurations into groups that run the one compiled program side by side does
    not change a single result, even when one group reaches the target chunks before the other
    (it is resumed to the common stopping chunk)."""
    exp = _tiny("healthy", inject=True)
    kwargs = dict(seeds=2, learning_rates=[3e-2, 3e-3], steps=400, chunk=10)
    one = overfit(exp, groups=1, **kwargs)
    two = overfit(exp, groups=2, **kwargs)
    assert one.groups == 1 and two.groups == 2 and two.compiles == 1
    assert one.steps_run == two.steps_run < 400  # early exit, at the same chunk
    lr = np.array([c.learning_rate or np.nan for c in one.configs])
    fast, slow = one.reached_at[lr == 3e-2], one.reached_at[lr == 3e-3]
    assert fast.max() < slow.min()  # the high-rate configurations fit first
    np.testing.assert_allclose(two.losses, one.losses, rtol=2e-5, atol=1e-6)
    assert np.isfinite(two.losses).all()  # the group that finished first was resumed, not cut short
    np.testing.assert_array_equal(two.reached_at, one.reached_at)
    assert two.verdicts == one.verdicts and two.codes == one.codes


def test_bad_groups_is_a_clear_error():
    with pytest.raises(jaxsane.JaxsaneError, match=r"\[jaxsane\] overfit\(groups"):
        overfit(_tiny("healthy"), groups=0, steps=25)


def test_states_with_prng_keys_and_python_scalars_stack_and_compile_once():
    """The sweep compiles from abstract shapes while the states are built: a typed PRNG key leaf and a
    Python int leaf (int64 on the host, int32 in jax) must match the compiled program exactly."""
    tx = optax.adam(1e-2)

    def init(key):
        k1, k2 = jax.random.split(key)
        params = {"w": jax.random.normal(k1, (64, 10)) / 8.0, "b": jnp.zeros(10)}
        return {"params": params, "opt": tx.init(params), "rng": k2, "count": 0}

    def loss(params, batch):
        return optax.softmax_cross_entropy_with_integer_labels(batch["x"] @ params["w"] + params["b"],
                                                               batch["y"]).mean()

    @jax.jit
    def step(state, batch):
        rng, _ = jax.random.split(state["rng"])
        value, grads = jax.value_and_grad(loss)(state["params"], batch)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt, "rng": rng,
                "count": state["count"] + 1}, {"loss": value}

    exp = jaxsane.Experiment(init=init, step=step, train=_batch(), loss=loss, params=lambda s: s["params"],
                             apply=lambda p, x: x @ p["w"] + p["b"])
    result = overfit(exp, seeds=3, steps=300, groups=2)
    assert result.compiles == 1 and result.groups == 2 and result.ok, result.table()
    assert result.reached[result.real].all()


def test_host_setup_and_in_program_setup_give_the_same_sweep(monkeypatch):
    """Init scales and learning rates are applied to the stacked states on the host when the parameters
    are forwarded state leaves; otherwise the compiled program applies them. Both give the same sweep."""
    from jaxsane._overfit import overfit as _overfit, setup as _overfit_setup

    exp = _tiny("healthy", inject=True)
    kwargs = dict(seeds=1, learning_rates=[0.0, 1e-2], init_scales=[0.0, 0.5, 1.0], steps=50, early_exit=False)
    adapted = jaxsane._experiment.contract.PureExperiment(exp)
    plan = _overfit_setup.host_prepare_plan(adapted, adapted.example_state, lambda path: True,
                                            set(learning_rate_paths(adapted.example_state)))
    assert plan is not None and len(plan.scaled) == 4 and len(plan.rates) == 1  # w1, b1, w2, b2; the rate
    on_host = overfit(exp, **kwargs)
    monkeypatch.setattr(_overfit, "host_prepare_plan", lambda *a: None)
    in_program = overfit(exp, **kwargs)
    np.testing.assert_allclose(on_host.losses, in_program.losses, rtol=1e-6, atol=1e-7)
    assert on_host.verdicts == in_program.verdicts and in_program.compiles == 1


def test_overfit_plot_draws_each_target_at_the_verdicts_criterion():
    result = overfit(_tiny("healthy"), seeds=2, steps=40)
    fig = result.plot()
    ax = fig.axes[0]
    targets = {line.get_gid(): line for line in ax.get_lines() if (line.get_gid() or "").startswith("target-")}
    assert set(targets) == {f"target-{i}" for i in result.real}
    for i in result.real:  # the sweep's test: loss <= target x that configuration's own initial loss
        np.testing.assert_allclose(targets[f"target-{i}"].get_ydata(), result.target * result.losses[i, 0])
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "optimizer's lr (default)" in labels and any("each curve's initial loss" in t for t in labels)
    thickest = max(ax.get_lines(), key=lambda line: line.get_linewidth())
    assert thickest.get_color() == "black"  # the default configuration is the most visible


def test_seeds_none_sweeps_two_seeds_and_one_for_a_model_beyond_the_budget(monkeypatch):
    import jaxsane._overfit.setup as setup

    exp = load("digits_optax")
    small = overfit(exp, seeds=None, steps=50, progress=False)
    assert sorted({c.seed for c in small.configs}) == [0, 1] and "overfit.budget" not in small.codes
    monkeypatch.setattr(setup, "LARGE_CONFIGURATION_FLOPS", 1e6)  # the digits MLP is then "large"
    large = overfit(exp, seeds=None, steps=50, progress=False)
    assert {c.seed for c in large.configs} == {0}
    budget = next(f for f in large.findings if f.code == "overfit.budget")
    assert budget.severity == "info" and "overfit_seeds=2" in budget.hint
    assert budget.extra["step_flops"] * 50 > 1e6


def test_budget_seeds_reads_the_step_flops_of_the_jaxpr():
    from jaxsane._overfit.setup import LARGE_CONFIGURATION_FLOPS, budget_seeds

    def step(w, x):
        return jnp.tanh(x @ w) @ w.T

    jaxpr = jax.make_jaxpr(step)(jnp.ones((1024, 1024)), jnp.ones((64, 1024)))  # ~2.7e8 flops
    assert budget_seeds(jaxpr, steps=10, backend="cpu") == (2, None)
    seeds, finding = budget_seeds(jaxpr, steps=300, backend="cpu")
    assert seeds == 1 and finding.code == "overfit.budget" and finding.extra["budget_flops"] == LARGE_CONFIGURATION_FLOPS
    assert budget_seeds(jaxpr, steps=300, backend="gpu") == (2, None)


def test_a_small_rate_that_cannot_be_swept_is_swept_by_scaling_the_updates():
    result = overfit(_tiny("healthy", lr=1e-4, opt=optax.sgd), seeds=2, steps=300)
    assert not [f for f in result.findings if f.severity == "error"], result.table()
    assert "overfit.update_scaled" in result.codes and result.ok
    best = result.configs[result.best]
    assert best.update_scale in (10.0, 100.0, 1000.0) and result.verdicts[result.best] == "fits"
    assert "updates scaled" in result.table()



def test_the_scaled_update_sweep_ends_at_its_first_fit_also_in_memory_sized_turns():
    from jaxsane._overfit.overfit import plan_overfit

    # it asks whether some factor fits: at the first fit every curve is cut, however the groups run
    exp = _tiny("healthy", lr=1e-4, opt=optax.sgd)
    at_once = overfit(exp, seeds=2, steps=300)
    in_turns = plan_overfit(exp, seeds=2, steps=300, memory_bytes=1, progress=False).run()  # one state at a time
    for result in (at_once, in_turns):
        assert "overfit.update_scaled" in result.codes and result.ok, result.table()
        assert result.steps_run < 300 and result.losses.shape[1] == result.steps_run
        assert result.verdicts[result.best] == "fits" and result.configs[result.best].update_scale == 1000.0
        assert np.all(result.reached_at < result.steps_run)
    assert in_turns.groups > at_once.groups and in_turns.steps_run == at_once.steps_run
    np.testing.assert_array_equal(in_turns.reached_at, at_once.reached_at)

def test_scaled_updates_still_report_a_model_that_ignores_its_input():
    result = overfit(_tiny("ignores_input", lr=1e-4, opt=optax.sgd), seeds=2, steps=300)
    assert "model.ignores_input" in result.codes and "overfit.failed" in result.codes, result.table()


def test_updates_that_no_scale_moves_are_not_judged_an_error(monkeypatch):
    from jaxsane._overfit import update_scale

    # a tiny rate that even 10x..1000x cannot move (scaled updates that do not act as a larger rate)
    monkeypatch.setattr(update_scale, "UPDATE_SCALES", (1.0, 1.0, 1.0))
    monkeypatch.setattr(update_scale, "BASELINE_SCALE", 1.0)
    from jaxsane._overfit import overfit as overfit_module

    monkeypatch.setattr(overfit_module, "UPDATE_SCALES", (1.0, 1.0, 1.0))
    result = overfit(_tiny("healthy", lr=1e-6, opt=optax.sgd), seeds=1, steps=50)
    assert not [f for f in result.findings if f.severity == "error"], result.table()
    assert any(f.code == "doctor.skipped" and "overfit not judged" in f.message for f in result.findings)


def test_nnx_updates_are_scaled_from_the_values_before_the_step():
    from flax import nnx

    from jaxsane.examples import digits_nnx

    def init(key):  # NNX states hold Variables the step updates in place: the delta must be read before it
        model = digits_nnx.MLP(nnx.Rngs(params=key), hidden=32)
        return model, nnx.Optimizer(model, optax.sgd(1e-4), wrt=nnx.Param)

    exp = jaxsane.Experiment(init=init, step=digits_nnx.train_step, train=_batch(), loss=digits_nnx.loss,
                             apply=lambda m, x: m(x), name="nnx_sgd")
    result = overfit(exp, seeds=1, steps=200)
    assert result.ok and "overfit.update_scaled" in result.codes, result.table()


@pytest.mark.slow
def test_batchnorm_fit_is_judged_by_the_loss_and_says_the_accuracy_is_apply_s():
    import flax.linen as nn
    from flax.training import train_state

    class BNMLP(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            h = nn.BatchNorm(use_running_average=not train, momentum=0.9)(nn.Dense(32)(x))
            return nn.Dense(10)(nn.relu(h))

    class State(train_state.TrainState):
        batch_stats: dict

    model, tx = BNMLP(), optax.adam(3e-3)

    def init(key):
        v = model.init(key, jnp.zeros((2, 64)))
        return State.create(apply_fn=model.apply, params=v["params"], tx=tx, batch_stats=v["batch_stats"])

    @jax.jit
    def step(state, batch):  # train mode: batch statistics
        def loss(p):
            logits, upd = model.apply({"params": p, "batch_stats": state.batch_stats}, batch["x"], train=True,
                                      mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), upd

        (value, upd), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads).replace(batch_stats=upd["batch_stats"]), {"loss": value}

    # eval mode on running statistics that the fit never updates, far from the batch's (a mean of 100: every unit
    # is off after the ReLU, so apply predicts one class whatever the training did; the initial statistics alone
    # happened to classify all 16 examples on some library versions)
    stats = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 100.0 if "mean" in jax.tree_util.keystr(path) else x, init(jax.random.key(0)).batch_stats
    )
    exp = jaxsane.Experiment(init=init, step=step, train=_batch(), num_classes=10,
                             apply=lambda p, x: model.apply({"params": p, "batch_stats": stats}, x))
    result = overfit(exp, seeds=1, steps=150, baseline=False)
    best = next(f for f in result.findings if f.code == "overfit.best")
    assert result.ok and result.target_accuracy is None, result.table()
    assert "(judged by the loss)" in best.message and "apply's accuracy" in best.message
    # a model whose loss is apply's cross-entropy: the accuracy judges the same fit, as before
    plain = overfit(_tiny("healthy"), seeds=1, steps=150, baseline=False)
    assert plain.target_accuracy is not None and "judged by the loss" not in str(plain.findings)


def test_whether_the_accuracy_can_judge_the_fit_is_found_while_the_sweep_compiles(monkeypatch):
    import threading

    from jaxsane._overfit import overfit as _overfit_module

    threads = []

    def mismatch(*args):
        threads.append(threading.current_thread().name)
        return "apply runs in another mode (a stand-in for the real check)"

    monkeypatch.setattr(_overfit_module, "accuracy_mismatch", mismatch)
    result = overfit(_tiny("healthy"), seeds=1, steps=150, baseline=False)
    best = next(f for f in result.findings if f.code == "overfit.best")
    assert threads and threads[0] != threading.main_thread().name  # beside the compile, not before it
    assert result.target_accuracy is None and "(judged by the loss)" in best.message
    assert "a stand-in for the real check" in best.message


def test_with_a_reference_batch_the_accuracy_check_runs_there_when_the_sweep_runs(monkeypatch):
    """doctor passes the batch its step stage runs the user's step on: the check that apply's accuracy can judge
    the fit then runs on that batch, on the main thread once the sweep runs, and compiles no step at the overfit
    batch's shape; the verdict is the check's as before."""
    import threading

    from jaxsane._overfit import overfit as _overfit_module
    from jaxsane._overfit.overfit import plan_overfit

    calls = []

    def mismatch(adapted, seed, batch, reports):
        calls.append((threading.current_thread().name, int(np.shape(batch["x"])[0])))
        return "apply runs in another mode (a stand-in for the real check)"

    monkeypatch.setattr(_overfit_module, "accuracy_mismatch", mismatch)
    exp = _tiny("healthy")
    full = _batch()  # the Experiment's one train batch, 16 examples
    plan = plan_overfit(exp, jax.tree_util.tree_map(lambda v: v[:8], full), seeds=1, steps=150, baseline=False,
                        progress=False, reference_batch=full)  # fmt: skip
    assert calls == []  # nothing yet: not while planning, not beside the compile
    result = plan.run()
    assert calls == [(threading.main_thread().name, int(np.shape(full["x"])[0]))], calls
    best = next(f for f in result.findings if f.code == "overfit.best")
    assert result.target_accuracy is None and "a stand-in for the real check" in best.message
