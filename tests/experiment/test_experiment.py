import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _programs import (
    batch,
    linen_init,
    linen_loss,
    linen_step,
    nnx_init,
    nnx_loss,
    nnx_step,
    nnx_step_tuple,
    optax_init,
    optax_loss,
    optax_step,
    optax_step_state_only,
)

import jaxsane
from jaxsane._experiment.batches import first_batch, get_inputs, get_labels, iter_batches
from jaxsane._experiment.contract import PureExperiment

STYLES = {
    "optax": dict(init=optax_init, step=jax.jit(optax_step), loss=optax_loss),
    "optax_state_only": dict(init=optax_init, step=optax_step_state_only, loss=optax_loss),
    "linen": dict(init=linen_init, step=linen_step, loss=linen_loss),
    "nnx": dict(init=nnx_init, step=nnx_step, loss=nnx_loss),
    "nnx_tuple": dict(init=nnx_init, step=nnx_step_tuple, loss=nnx_loss),
}


@pytest.mark.slow
@pytest.mark.parametrize("style", list(STYLES))
def test_every_step_style_adapts_to_one_pure_step(style):
    exp = jaxsane.Experiment(train=batch(), num_classes=3, **STYLES[style])
    adapted = PureExperiment(exp)
    state = adapted.init(jax.random.key(0))
    step = jax.jit(adapted.step)
    losses = []
    for _ in range(5):
        before = adapted.params(state)
        state, metrics = step(state, batch())
        changed = any(not np.array_equal(a, b) for a, b in
                      zip(jax.tree.leaves(before), jax.tree.leaves(adapted.params(state))))
        assert changed, "the adapted step must apply the update"
        losses.append(float(adapted.loss_fn(adapted.params(state), batch())))
    assert losses[-1] < losses[0]
    if style != "optax_state_only":
        assert "loss" in metrics
    # the pure step is vmappable over states (needed by the overfit sweep)
    states = jax.tree.map(lambda x: jnp.stack([x, x]), adapted.init(jax.random.key(1)))
    out, _ = jax.vmap(adapted.step, in_axes=(0, None))(states, batch())
    assert jax.tree.structure(out) == jax.tree.structure(states)


def test_nnx_user_state_round_trip():
    adapted = PureExperiment(jaxsane.Experiment(init=nnx_init, step=nnx_step, train=batch(), loss=nnx_loss))
    state = adapted.init(jax.random.key(0))
    model, optimizer = adapted.user_state(state)
    assert float(nnx_loss(model, batch())) == pytest.approx(float(adapted.loss_fn(adapted.params(state), batch())))


def test_with_params_replaces_only_params():
    adapted = PureExperiment(jaxsane.Experiment(init=optax_init, step=optax_step, train=batch()))
    state = adapted.init(jax.random.key(0))
    zeros = jax.tree.map(jnp.zeros_like, adapted.params(state))
    new = adapted.with_params(state, zeros)
    assert all(not x.any() for x in jax.tree.leaves(adapted.params(new)))
    assert jax.tree.structure(new) == jax.tree.structure(state)


def test_batch_lookup_defaults_and_errors():
    exp = jaxsane.Experiment(init=optax_init, step=optax_step, train=batch())
    assert get_inputs(exp, {"image": 1, "label": 2}) == 1
    assert get_labels(exp, (np.ones(2), np.zeros(2))).shape == (2,)
    with pytest.raises(jaxsane.DataError, match=r"\[jaxsane\] cannot find the labels .*keys \['a', 'b'\].*labels="):
        get_labels(exp, {"a": 1, "b": 2})
    with pytest.raises(jaxsane.DataError, match="empty"):
        first_batch([])
    with pytest.raises(jaxsane.DataError, match="string"):
        first_batch({"x": np.array(["a", "b"])})
    assert len(list(iter_batches(batch(), 3))) == 3
    assert len(list(iter_batches([batch(), batch()], 5))) == 2


def test_train_data_as_a_generator_function_or_a_batch_callable():
    def epoch():  # a generator function: each call is a fresh pass over three batches
        for i in range(3):
            yield {"x": np.full((4, 2), float(i)), "y": np.zeros(4, np.int32)}

    assert [float(b["x"][0, 0]) for b in iter_batches(epoch, 5)] == [0.0, 1.0, 2.0]
    assert [float(b["x"][0, 0]) for b in iter_batches(epoch, 2)] == [0.0, 1.0]  # a new pass each time
    assert float(first_batch(epoch)["x"][0, 0]) == 0.0
    calls = []

    def sample():  # a callable returning one batch: called once per batch, none wasted
        calls.append(1)
        return {"x": np.full((4, 2), float(len(calls))), "y": np.zeros(4, np.int32)}

    assert [float(b["x"][0, 0]) for b in iter_batches(sample, 3)] == [1.0, 2.0, 3.0] and len(calls) == 3
    with pytest.raises(jaxsane.DataError, match="empty"):
        list(iter_batches(lambda: iter([]), 2))
    with pytest.raises(jaxsane.DataError, match=r"\[jaxsane\] cannot read batches .* int"):
        list(iter_batches(lambda: 5, 2))


@pytest.mark.parametrize("field,value,match", [
    ("init", 3, "Experiment.init must be callable"),
    ("step", None, "Experiment.step must be callable"),
    ("loss", "nope", "Experiment.loss must be a callable"),
    ("num_classes", 1, r"Experiment\.num_classes must be an int >= 2"),
])
def test_bad_experiment_fields(field, value, match):
    kwargs = dict(init=optax_init, step=optax_step, train=batch())
    kwargs[field] = value
    with pytest.raises(jaxsane.ExperimentError, match=r"\[jaxsane\] " + match):
        jaxsane.Experiment(**kwargs)


def test_step_output_that_does_not_match_the_state():
    exp = jaxsane.Experiment(init=optax_init, step=lambda s, b: (s[0], 1.0), train=batch())
    adapted = PureExperiment(exp)
    with pytest.raises(jaxsane.ExperimentError, match="does not match the state's structure"):
        adapted.step(adapted.init(jax.random.key(0)), batch())


def test_non_array_state_leaf():
    exp = jaxsane.Experiment(init=lambda k: {"w": jnp.ones(2), "name": "mlp"}, step=lambda s, b: s, train=batch())
    with pytest.raises(jaxsane.ExperimentError, match=r"non-array leaf at state\['name'\].*str"):
        PureExperiment(exp)


def test_init_with_wrong_signature():
    exp = jaxsane.Experiment(init=lambda: None, step=lambda s, b: s, train=batch())
    with pytest.raises(jaxsane.ExperimentError, match=r"init\(key\) failed"):
        PureExperiment(exp)


def _counting(fn):
    calls = []

    def counted(key):
        calls.append(1)
        return fn(key)
    return counted, calls


def test_init_runs_once_per_key_and_hands_out_fresh_trees():
    init, calls = _counting(nnx_init)
    adapted = PureExperiment(jaxsane.Experiment(init=init, step=nnx_step, loss=nnx_loss, train=batch()), reuse_init=True)
    assert len(calls) == 1
    first, second = adapted.init(jax.random.key(0)), adapted.init(jax.random.key(0))
    assert len(calls) == 1, "the same key: the user's init is not run again"
    a, b = jax.tree.leaves(first, is_leaf=lambda x: hasattr(x, "get_value")), \
        jax.tree.leaves(second, is_leaf=lambda x: hasattr(x, "get_value"))
    assert all(x is not y for x, y in zip(a, b)), "each caller gets its own NNX Variables"
    a[0].set_value(a[0].get_value() + 1.0)  # one caller's in-place change...
    third = adapted.init(jax.random.key(0))
    np.testing.assert_array_equal(jax.tree.leaves(third)[0], jax.tree.leaves(second)[0])  # ...is not seen by others
    adapted.init(jax.random.key(1))
    assert len(calls) == 2, "another key: init runs"


def test_init_runs_again_after_a_donating_step_deleted_its_arrays():
    init, calls = _counting(optax_init)
    adapted = PureExperiment(jaxsane.Experiment(init=init, step=optax_step, loss=optax_loss, train=batch()), reuse_init=True)
    state = adapted.init(jax.random.key(0))
    jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)(state)
    assert any(x.is_deleted() for x in jax.tree.leaves(state))
    again = adapted.init(jax.random.key(0))
    assert len(calls) == 2 and not any(x.is_deleted() for x in jax.tree.leaves(again))
    np.testing.assert_array_equal(jax.tree.leaves(again)[0], jax.tree.leaves(optax_init(jax.random.key(0)))[0])


def test_init_is_not_reused_by_default():
    init, calls = _counting(optax_init)
    adapted = PureExperiment(jaxsane.Experiment(init=init, step=optax_step, loss=optax_loss, train=batch()))
    adapted.init(jax.random.key(0)), adapted.init(jax.random.key(0))
    assert len(calls) == 3 and adapted._last_init is None, "a training loop's PureExperiment keeps no initial state alive"
