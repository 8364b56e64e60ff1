"""Step wiring: stale states, frozen optimizer state, reused dropout randomness and recompiling
steps are caught from a few real calls; correct steps in every style stay silent."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import jaxsane
from jaxsane import check_step, count_compilations
from jaxsane.testing import CheckFailed, assert_compiles_once, assert_step_ok

BATCH = {"x": np.random.default_rng(0).normal(size=(8, 5)).astype(np.float32), "y": (np.arange(8) % 3).astype(np.int32)}
TX = optax.adam(1e-2)


def _params(key):
    return {"w": jax.random.normal(key, (5, 3)) * 0.3, "b": jnp.zeros(3)}


def _loss(params, batch):
    logits = batch["x"] @ params["w"] + params["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _optax_experiment(step, tx=TX):
    return jaxsane.Experiment(
        init=lambda key: (_params(key), tx.init(_params(key))), step=step, train=BATCH, loss=_loss, num_classes=3
    )


def _codes(findings):
    return [f.code for f in findings]


def test_stale_state_is_no_update():
    @jax.jit
    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(_loss)(params, batch)
        updates, new_opt_state = TX.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)  # noqa: F841 (the bug: computed, not returned)
        return (params, opt_state), {"loss": value}  # BUG: returns the state it was given

    findings = check_step(_optax_experiment(step))
    assert _codes(findings) == ["step.no_update"]
    assert "neither did the optimizer state" in findings[0].message
    assert findings[0].path.startswith("state[0]")


def test_learning_rate_zero_in_linen_train_state_is_no_update():
    model = nn.Dense(3)

    def init(key):
        params = model.init(key, jnp.zeros((1, 5)))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.0))  # BUG

    @jax.jit
    def step(state, batch):
        loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(
            model.apply({"params": p}, batch["x"]), batch["y"]
        ).mean()
        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads), {"loss": value}

    findings = check_step(jaxsane.Experiment(init=init, step=step, train=BATCH))
    assert _codes(findings) == ["step.no_update"]
    assert findings[0].path == "state.params['bias']"


def test_dropped_optimizer_state_is_frozen():
    @jax.jit
    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(_loss)(params, batch)
        updates, _ = TX.update(grads, opt_state, params)  # BUG: the new optimizer state is dropped
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    findings = check_step(_optax_experiment(step))
    assert _codes(findings) == ["step.opt_state_frozen"]
    assert ".mu" in findings[0].path or ".nu" in findings[0].path


class _DropNet(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        h = nn.relu(nn.Dense(8)(x))
        h = nn.Dropout(0.5, deterministic=not train)(h)
        return nn.Dense(3)(h)


def _linen_dropout_experiment(split_key):
    model = _DropNet()
    tx = optax.adam(1e-2)

    def init(key):
        params = model.init(key, jnp.zeros((1, 5)))["params"]
        return params, tx.init(params), jax.random.key(1)

    @jax.jit
    def step(state, batch):
        params, opt_state, key = state
        if split_key:
            key, sub = jax.random.split(key)
        else:
            sub = key  # BUG: the dropout key is never advanced

        def loss(p):
            logits = model.apply({"params": p}, batch["x"], train=True, rngs={"dropout": sub})
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, key), {"loss": value}

    return jaxsane.Experiment(init=init, step=step, train=BATCH, num_classes=3)


@pytest.mark.slow
def test_dropout_key_never_advanced_is_rng_reused():
    findings = check_step(_linen_dropout_experiment(split_key=False))
    assert _codes(findings) == ["step.rng_reused"]
    f = findings[0]
    assert f.severity == "warning"
    assert f.path == "state[2]" and f.extra["frozen_keys"] == ["state[2]"]
    assert f.file.endswith("test_step_checks.py") and f.line is not None  # the Dropout line
    assert "split" in f.hint


@pytest.mark.slow
def test_dropout_with_split_key_is_silent():
    assert check_step(_linen_dropout_experiment(split_key=True)) == []


class _NNXDrop(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(5, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.l1(x))))


@pytest.mark.slow
def test_nnx_dropout_with_rngs_is_silent():
    """nnx.Rngs keeps its key and advances a counter: the draws differ, nothing is reported."""

    def init(key):
        model = _NNXDrop(nnx.Rngs(params=key, dropout=1))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        loss = lambda m: optax.softmax_cross_entropy_with_integer_labels(m(batch["x"]), batch["y"]).mean()
        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    assert check_step(jaxsane.Experiment(init=init, step=step, train=BATCH)) == []


def _fold_in_dropout_experiment(advance: bool):
    """A dropout key derived each step with ``fold_in``: of the step counter (right), or of 0 (the same mask
    every step)."""

    def init(key):
        return {"w": jax.random.normal(key, (5, 3)), "key": jax.random.key(1), "count": jnp.zeros((), jnp.int32)}

    @jax.jit
    def step(state, batch):
        sub = jax.random.fold_in(state["key"], state["count"] if advance else 0)
        keep = jax.random.bernoulli(sub, 0.5, batch["x"].shape)

        def loss(w):
            logits = jnp.where(keep, batch["x"], 0.0) @ w
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        value, grad = jax.value_and_grad(loss)(state["w"])
        return {**state, "w": state["w"] - 0.1 * grad, "count": state["count"] + 1}, {"loss": value}

    return jaxsane.Experiment(init=init, step=step, train=BATCH, params=lambda state: state["w"])


@pytest.mark.parametrize("advance", [False, True])
def test_fold_in_draws_are_compared_on_the_host(advance, monkeypatch):
    """The draws of a fold_in'd key are replayed with numpy, bit for bit, with no compile of the replay."""
    import jaxsane._checks.step as step_module

    def no_compile(*args, **kwargs):
        raise AssertionError("the random-bits replay compiled a program")

    monkeypatch.setattr(step_module, "quick_jit", no_compile)
    codes = _codes(check_step(_fold_in_dropout_experiment(advance)))
    assert codes == ([] if advance else ["step.rng_reused"])


@functools.partial(jax.jit, static_argnums=2)
def _step_with_static_lr(state, batch, lr):
    params, opt_state = state
    value, grads = jax.value_and_grad(_loss)(params, batch)
    return (jax.tree.map(lambda p, g: p - lr * g, params, grads), opt_state), {"loss": value}


@pytest.mark.slow
def test_python_float_static_argument_recompiles():
    calls = []

    def step(state, batch):
        calls.append(1)
        lr = 0.1 / len(calls)  # BUG: a Python float that changes every call, passed as a static argument
        return _step_with_static_lr(state, batch, lr)

    findings = check_step(_optax_experiment(step, tx=optax.identity()))
    assert _codes(findings) == ["step.recompiles"]
    assert findings[0].extra["compiles"][1:] == [1, 1]
    assert "static" in findings[0].hint


@pytest.mark.slow
def test_new_jit_every_call_recompiles():
    def step(state, batch):
        @jax.jit  # BUG: a new jitted function (and compilation) on every call
        def inner(state, batch):
            params, opt_state = state
            value, grads = jax.value_and_grad(_loss)(params, batch)
            updates, opt_state = TX.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), {"loss": value}

        return inner(state, batch)

    assert _codes(check_step(_optax_experiment(step))) == ["step.recompiles"]


def test_correct_optax_step_is_silent_and_compiles_once():
    @jax.jit
    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(_loss)(params, batch)
        updates, opt_state = TX.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    exp = _optax_experiment(step)
    assert check_step(exp, calls=4) == []
    assert_step_ok(exp)
    state = exp.init(jax.random.key(0))
    assert_compiles_once(step, state, BATCH)


def test_count_compilations_and_assert_compiles_once():
    f = jax.jit(lambda x: x * 2)
    with count_compilations() as counter:
        f(jnp.ones(3))
        f(jnp.ones(3))
    assert counter.compiles == 1
    with pytest.raises(CheckFailed, match="recompiles"):
        assert_compiles_once(lambda x: jax.jit(lambda y: y + 1)(x), jnp.ones(2))


def test_calls_must_be_at_least_two():
    with pytest.raises(jaxsane.JaxsaneError, match="calls must be >= 2"):
        check_step(_optax_experiment(jax.jit(lambda s, b: (s, {}))), calls=1)


class _BNMLP(nn.Module):
    frozen: bool = False  # eval-mode BatchNorm in the step too (fine-tuning with frozen statistics)

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.BatchNorm(use_running_average=self.frozen or not train, momentum=0.9)(nn.Dense(8)(x))
        return nn.Dense(3)(nn.relu(h))


class _BNState(train_state.TrainState):
    batch_stats: dict


def _bn_experiment(returns_stats: bool, frozen: bool = False):
    model = _BNMLP(frozen)

    def init(key):
        variables = model.init(key, BATCH["x"])
        return _BNState.create(
            apply_fn=model.apply, params=variables["params"], tx=TX, batch_stats=variables["batch_stats"]
        )

    @jax.jit
    def step(state, batch):
        def loss(params):
            logits, updates = model.apply(
                {"params": params, "batch_stats": state.batch_stats}, batch["x"], train=True, mutable=["batch_stats"]
            )
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), updates

        (value, updates), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
        state = state.apply_gradients(grads=grads)
        if returns_stats:
            state = state.replace(batch_stats=updates["batch_stats"])
        return state, {"loss": value}  # returns_stats=False: the BUG, the old batch_stats

    return jaxsane.Experiment(init=init, step=step, train=BATCH, num_classes=3)


@pytest.mark.parametrize(
    "returns_stats,frozen",
    [(True, False), (False, True), (False, False)],
    ids=["returns_stats", "eval_mode_frozen_stats", "drops_stats"],
)
def test_batchnorm_statistics_computed_and_dropped_are_stats_frozen(returns_stats, frozen):
    findings = check_step(_bn_experiment(returns_stats, frozen), check_rng=False)
    if returns_stats or frozen:
        assert not findings, [str(f) for f in findings]
        return
    assert _codes(findings) == ["step.stats_frozen"]
    assert findings[0].severity == "error" and "batch_stats" in findings[0].path


def test_a_state_leaf_only_passed_through_is_not_stats_frozen():
    @jax.jit
    def step(state, batch):
        params, opt_state, extra = state
        value, grads = jax.value_and_grad(_loss)(params, batch)
        updates, opt_state = TX.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, extra), {"loss": value}

    exp = jaxsane.Experiment(
        init=lambda key: (_params(key), TX.init(_params(key)), {"ema": jnp.ones(3)}),
        step=step,
        train=BATCH,
        loss=_loss,
        num_classes=3,
    )
    assert check_step(exp, check_rng=False) == []


@pytest.mark.parametrize("returns_ema", [True, False], ids=["returns_ema", "drops_ema"])
def test_an_ema_of_parameters_that_did_not_move_yet_is_not_stats_frozen_but_a_dropped_one_is(returns_ema):
    """Under optax.MultiSteps the parameters stand still for the first k-1 calls, so an EMA of them comes out
    bitwise unchanged though the step computes and returns it; a step that returns the old EMA drops it."""
    tx = optax.MultiSteps(TX, every_k_schedule=4)

    @jax.jit
    def step(state, batch):
        params, opt_state, ema = state
        value, grads = jax.value_and_grad(_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        new_ema = jax.tree_util.tree_map(lambda e, p: 0.99 * e + 0.01 * p, ema, params)
        return (params, opt_state, new_ema if returns_ema else ema), {"loss": value}

    exp = jaxsane.Experiment(
        init=lambda key: (_params(key), tx.init(_params(key)), _params(key)),
        step=step,
        train=BATCH,
        loss=_loss,
        params=lambda s: s[0],
        num_classes=3,
    )
    codes = _codes(check_step(exp, check_rng=False))
    assert ("step.stats_frozen" in codes) is not returns_ema, codes


# ----------------------------------------------------------------------------- check_step's batch argument


@pytest.mark.parametrize(
    "bad, error, needle",
    [
        (
            "b",
            jaxsane.ArgumentError,
            "check_step(batch=...): expected a batch: a pytree (dict, tuple) of numeric arrays",
        ),
        ({"x": [object()]}, jaxsane.ArgumentError, "check_step(batch['x'][0]=...): expected a numeric array"),
        ({}, jaxsane.ArgumentError, "it has no array leaves"),
        (
            {"x": np.ones((8, 5), np.float32), "y": np.zeros(8, np.int32)},
            jaxsane.DataError,
            "its leaf ['x'] has per-example shape [5] float32 but the first train batch's ['x'] has [4] float32",
        ),
    ],
)
def test_a_batch_check_step_cannot_use_is_named_before_the_step_runs(bad, error, needle):
    from _programs import optax_experiment

    with pytest.raises(error) as info:
        jaxsane.check_step(optax_experiment(), batch=bad)
    assert str(info.value).startswith("[jaxsane] ") and needle in str(info.value), str(info.value)


def test_check_step_refuses_a_key_that_is_no_prng_key():
    from _programs import optax_experiment

    with pytest.raises(jaxsane.ArgumentError, match=r"check_step\(key=...\): expected a PRNG key"):
        jaxsane.check_step(optax_experiment(), key=3)
