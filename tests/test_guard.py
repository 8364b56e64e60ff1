import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsane
from _programs import batch, linen_init, linen_step, nnx_init, nnx_step, optax_init, optax_step


def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
                                      for x, y in zip(la, lb))


def _nan_params_step(state, b):
    (params, opt_state), metrics = optax_step(state, b)
    params = {**params, "w": params["w"].at[0, 0].set(jnp.nan)}
    return (params, opt_state), metrics


@pytest.mark.parametrize("jit", [False, True])
def test_healthy_steps_pass_and_compile_once(jit):
    step = jax.jit(optax_step) if jit else optax_step
    guarded = jaxsane.guard(step)
    state = optax_init(jax.random.key(0))
    expected = state
    for i in range(4):
        state, metrics = guarded(state, batch(seed=i))
        expected, _ = jax.jit(optax_step)(expected, batch(seed=i))
    guarded.flush()
    assert guarded.failures == [] and guarded.step_count == 4
    assert guarded.compiles == 1
    np.testing.assert_allclose(np.asarray(state[0]["w"]), np.asarray(expected[0]["w"]), rtol=1e-6)


def test_raise_names_step_and_param_path():
    guarded = jaxsane.guard(jax.jit(_nan_params_step), sync=True, locate=False)
    with pytest.raises(jaxsane.NonFiniteError) as info:
        guarded(optax_init(jax.random.key(0)), batch())
    finding = info.value.finding
    assert isinstance(info.value, jaxsane.JaxsaneError)
    assert finding.code == "nonfinite.update" and finding.step == 0
    assert finding.path == "state[0]['w']"
    assert str(info.value).startswith("[jaxsane] nonfinite.update at step 0")


def test_nan_loss_is_forward_and_bad_batch_is_input():
    def nan_loss_step(state, b):
        new, metrics = optax_step(state, b)
        return new, {"loss": jnp.log(metrics["loss"] * 0 - 1.0)}

    guarded = jaxsane.guard(nan_loss_step, sync=True, locate=False)
    with pytest.raises(jaxsane.NonFiniteError) as info:
        guarded(optax_init(jax.random.key(0)), batch())
    assert info.value.finding.code == "nonfinite.forward"
    assert "metrics['loss']" in info.value.finding.extra["paths"]

    guarded = jaxsane.guard(optax_step, sync=True, locate=False)
    with pytest.raises(jaxsane.NonFiniteError) as info:
        guarded(optax_init(jax.random.key(0)), batch(bad=True))
    assert info.value.finding.code == "nonfinite.input"
    assert info.value.finding.path == "b['x']"


def test_async_raise_is_reported_on_a_later_call_or_flush():
    guarded = jaxsane.guard(jax.jit(optax_step), locate=False)
    state = optax_init(jax.random.key(0))
    state, _ = guarded(state, batch())
    state, _ = guarded(state, batch(bad=True))  # does not block: the failure is noticed later
    with pytest.raises(jaxsane.NonFiniteError) as info:
        for _ in range(4):
            state, _ = guarded(state, batch())
        guarded.flush()
    assert info.value.finding.step == 1 and info.value.finding.code == "nonfinite.input"


def test_skip_returns_the_input_state_bitwise_and_counts():
    guarded = jaxsane.guard(jax.jit(_nan_params_step), on_nonfinite="skip", max_consecutive_skips=3, locate=False)
    state = optax_init(jax.random.key(0))
    new_state, metrics = guarded(state, batch())
    assert _leaves_equal(new_state, state)
    guarded(new_state, batch())
    guarded.flush()
    assert guarded.skipped == 2 and len(guarded.failures) == 2
    with pytest.raises(jaxsane.NonFiniteError, match="3 consecutive steps skipped"):
        guarded(new_state, batch())
        guarded.flush()


def test_skip_recovers_after_a_bad_batch():
    guarded = jaxsane.guard(optax_step, on_nonfinite="skip", locate=False)
    state = optax_init(jax.random.key(0))
    s1, _ = guarded(state, batch(bad=True))
    s2, metrics = guarded(s1, batch())
    guarded.flush()
    assert _leaves_equal(s1, state) and guarded.skipped == 1
    assert np.isfinite(np.asarray(metrics["loss"])) and not _leaves_equal(s2, state)


def test_warn_returns_outputs_and_warns():
    guarded = jaxsane.guard(_nan_params_step, on_nonfinite="warn", sync=True, locate=False)
    with pytest.warns(jaxsane.JaxsaneWarning, match="nonfinite.update at step 0"):
        state, _ = guarded(optax_init(jax.random.key(0)), batch())
    assert np.isnan(np.asarray(state[0]["w"][0, 0]))


def test_linen_train_state():
    def bad_linen(state, b):
        new, metrics = linen_step(state, b)
        return new, {"loss": metrics["loss"] / 0.0 * 0.0}

    guarded = jaxsane.guard(jax.jit(bad_linen), sync=True, locate=False)
    with pytest.raises(jaxsane.NonFiniteError) as info:
        guarded(linen_init(jax.random.key(0)), batch())
    assert info.value.finding.code == "nonfinite.forward"


def test_nnx_in_place_step_detected_and_skipped():
    model, optimizer = nnx_init(jax.random.key(0))
    guarded = jaxsane.guard(nnx_step, on_nonfinite="skip", locate=False)
    loss = guarded(model, optimizer, batch())
    assert np.isfinite(float(loss))
    before = nnx.state((model, optimizer))
    guarded(model, optimizer, batch(bad=True))
    guarded.flush()
    assert guarded.skipped == 1 and guarded.failures[0].path == "b['x']"
    assert _leaves_equal(nnx.state((model, optimizer)), before)

    @nnx.jit
    def poison(model, optimizer, b):
        loss = nnx_step.fun(model, optimizer, b) if hasattr(nnx_step, "fun") else 0.0
        model.l1.kernel.value = model.l1.kernel.value * jnp.nan
        return loss

    raising = jaxsane.guard(poison, sync=True, locate=False)
    with pytest.raises(jaxsane.NonFiniteError) as info:
        raising(model, optimizer, batch())
    assert info.value.finding.path.startswith("model") and "l1" in info.value.finding.path
    assert info.value.finding.code == "nonfinite.update"


def test_composes_with_outer_jit_and_vmap():
    def step(s, b):
        return s + b, {"loss": jnp.sum(b)}

    guarded = jaxsane.guard(step, on_nonfinite="warn")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, metrics = jax.jit(jax.vmap(guarded))(jnp.zeros((3, 2)), jnp.array([[1.0, 2], [jnp.nan, 1], [0, 0]]))
        jax.effects_barrier()
    assert out.shape == (3, 2)
    assert guarded.failures and guarded.failures[0].code == "nonfinite.input"
    healthy = jaxsane.guard(step)
    out, _ = jax.jit(healthy)(jnp.zeros(2), jnp.ones(2))
    jax.effects_barrier()
    assert healthy.failures == [] and float(out.sum()) == 2.0


def test_dump_round_trip_is_bitwise_with_donation_bf16_and_keys(tmp_path):
    def step(state, b):
        w = state["w"] * b["x"].sum()
        return {"w": w, "h": state["h"] * 2, "key": jax.random.split(state["key"])[0]}, {"loss": w.sum()}

    donating = jax.jit(step, donate_argnums=0)
    guarded = jaxsane.guard(donating, dump_dir=str(tmp_path), locate=False)
    state = {"w": jnp.arange(3.0), "h": jnp.ones(2, jnp.bfloat16), "key": jax.random.key(3)}
    state, _ = guarded(state, {"x": np.ones(2, np.float32)})
    inputs = jax.tree.map(lambda x: np.asarray(jax.random.key_data(x)) if x.dtype == jax.random.key(0).dtype
                          else np.array(x), state)
    bad_batch = {"x": np.array([np.inf, 1.0], np.float32)}
    with pytest.raises(jaxsane.NonFiniteError) as info:
        guarded(state, bad_batch)
        guarded.flush()
    dump = jaxsane.load_dump(info.value.dump_path)
    loaded_state, loaded_batch = dump.args
    assert dump.step == 1 and dump.finding["code"] == "nonfinite.input"
    assert loaded_state["h"].dtype == jnp.bfloat16
    assert np.array_equal(loaded_state["w"], inputs["w"]) and np.array_equal(loaded_state["h"], inputs["h"])
    assert np.array_equal(jax.random.key_data(loaded_state["key"]), inputs["key"])
    assert np.array_equal(loaded_batch["x"], bad_batch["x"])


def test_dump_of_custom_nodes_with_like(tmp_path):
    state = linen_init(jax.random.key(0))
    jaxsane.save_dump(str(tmp_path), (state, batch()))
    dump = jaxsane.load_dump(str(tmp_path), like=(state, batch()))
    assert jax.tree.structure(dump.args[0]) == jax.tree.structure(state)
    assert _leaves_equal(dump.args, (state, batch()))


def test_load_dump_errors(tmp_path):
    with pytest.raises(jaxsane.JaxsaneError, match="is not a jaxsane dump"):
        jaxsane.load_dump(str(tmp_path))


def test_bad_policy_and_step():
    with pytest.raises(ValueError, match=r"\[jaxsane\] on_nonfinite must be one of"):
        jaxsane.guard(optax_step, on_nonfinite="ignore")
    with pytest.raises(TypeError, match=r"\[jaxsane\] guard needs a callable"):
        jaxsane.guard(None)


def test_nnx_failure_keeps_the_input_state_for_dump(tmp_path):
    model, optimizer = nnx_init(jax.random.key(0))

    @nnx.jit
    def poison(model, optimizer, b):
        model.l1.kernel.value = model.l1.kernel.value * jnp.nan
        return jnp.sum(b["x"])

    before = jax.tree.map(np.array, jax.tree.leaves(nnx.state(model)))
    guarded = jaxsane.guard(poison, sync=True, locate=False, dump_dir=str(tmp_path))
    with pytest.raises(jaxsane.NonFiniteError) as info:
        guarded(model, optimizer, batch())
    dumped_model = info.value.inputs[0][0]
    assert all(np.array_equal(a, b) for a, b in zip(before, jax.tree.leaves(dumped_model)))
    assert jaxsane.load_dump(info.value.dump_path).step == 0


def test_empty_and_scalar_leaves_in_the_state():
    def step(state, b):
        return {"w": state["w"] + b.sum(), "empty": state["empty"], "s": state["s"] * 2}, {"loss": b.sum()}

    guarded = jaxsane.guard(step, sync=True, locate=False)
    state = {"w": jnp.ones(3), "empty": jnp.zeros((0, 4)), "s": jnp.float32(1.0)}
    state, _ = guarded(state, jnp.ones(2))
    with pytest.raises(jaxsane.NonFiniteError) as info:
        guarded(state, jnp.array([1.0, jnp.inf]))
    assert info.value.finding.code == "nonfinite.input"
