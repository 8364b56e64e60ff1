"""Why a step compiled again: each recompilation names the argument path that changed, with the old
and new value side by side (shape, dtype, weak type, sharding, Python scalar type, static value, a
dict key), or says the arguments were identical; steps that compile once get nothing."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsane
from jaxsane import check_step, count_compilations
from jaxsane._jaxpr.recompile import IDENTICAL, diff, signature
from jaxsane.testing import CheckFailed, assert_compiles_once

BATCH = {"x": np.ones((8, 5), np.float32), "y": np.zeros(8, np.int32)}


def _train_step(state, batch):
    return jax.tree.map(lambda w: w - 0.1 * jnp.mean(batch["x"]), state), {"loss": jnp.sum(batch["x"])}


def _explained(fn, *calls, names=None):
    """Call ``fn`` on each argument tuple under one counter; the recompile summaries."""
    with count_compilations() as counter:
        watched = counter.watch(fn, names=names)
        for args in calls:
            watched(*args)
    return counter, [r.summary() for r in counter.reasons]


def test_changed_shape_names_the_batch_leaf():
    step = jax.jit(_train_step)
    state = {"w": jnp.zeros(3)}
    small = {"x": np.ones((4, 5), np.float32), "y": np.zeros(4, np.int32)}
    counter, reasons = _explained(step, (state, BATCH), (state, BATCH), (state, small))
    assert reasons == ["batch['x']: shape (8, 5) -> (4, 5); batch['y']: shape (8,) -> (4,)"]
    assert counter.reasons[0].call == 2
    assert counter.reasons[0].site.startswith(__file__)   # the user's call, not a jaxsane frame
    assert counter.explain().startswith("recompiled at call 2 (" + __file__)


def test_changed_dtype_names_old_and_new_dtype():
    step = jax.jit(_train_step)
    state = {"w": jnp.zeros(3)}
    _, reasons = _explained(step, (state, BATCH), (state, {**BATCH, "x": BATCH["x"].astype(jnp.bfloat16)}))
    assert reasons == ["batch['x']: dtype float32 -> bfloat16"]


def test_python_int_then_float_argument():
    f = jax.jit(lambda x, scale: x * scale)
    _, reasons = _explained(f, (jnp.ones(2), 2), (jnp.ones(2), 3), (jnp.ones(2), 0.5))
    assert reasons == ["scale: type Python int -> Python float"]   # 2 -> 3 reused the program


def test_static_python_int_then_float_is_told_apart():
    f = jax.jit(lambda x, lr: x * lr, static_argnums=1)
    _, reasons = _explained(f, (jnp.ones(2), 1), (jnp.ones(2), 1.0))
    assert reasons == ["lr: value 1 (int) -> 1.0 (float)"]   # 1 == 1.0, but jit compiles each


def test_changed_static_argument_value_and_unnamed_position():
    f = functools.partial(jax.jit, static_argnums=2)(lambda s, b, n: s * n + jnp.sum(b))
    _, reasons = _explained(f, (jnp.ones(2), jnp.ones(3), 2), (jnp.ones(2), jnp.ones(3), 3), names=["s", "b"])
    assert reasons == ["args[2]: value 2 -> 3"]


def test_new_dict_key_is_named():
    step = jax.jit(_train_step)
    state = {"w": jnp.zeros(3)}
    with_mask = {**BATCH, "mask": np.ones(8, bool)}
    _, reasons = _explained(step, (state, BATCH), (state, with_mask), (state, BATCH))
    assert reasons == ["batch['mask']: added (bool[8])"]   # the third call reuses the first program


def test_removed_key_and_changed_sharding():
    state = {"w": jnp.zeros(3), "v": jnp.zeros(3)}
    old = signature((state,), names=["state"])
    assert [str(c) for c in diff(old, signature(({"w": jnp.zeros(3)},), names=["state"]))] == \
        ["state['v']: removed (was float32[3])"]
    on1 = jax.device_put(jnp.zeros(3), jax.devices()[1])
    f = jax.jit(lambda x: x + 1)
    _, reasons = _explained(f, (jax.device_put(jnp.zeros(3), jax.devices()[0]),), (on1,), names=["x"])
    assert reasons == ["x: sharding SingleDeviceSharding(devices [0]) -> SingleDeviceSharding(devices [1])"]


def test_identical_arguments_say_the_function_changed():
    _, reasons = _explained(lambda x: jax.jit(lambda y: y + 1)(x), (jnp.ones(2),), (jnp.ones(2),))
    assert reasons == [IDENTICAL]


def test_a_step_that_does_not_recompile_gets_nothing():
    step = jax.jit(_train_step)
    state = {"w": jnp.zeros(3)}
    counter, reasons = _explained(step, (state, BATCH), (state, dict(BATCH)), (state, BATCH))
    assert reasons == [] and counter.explain().startswith("no recompilation")


def test_assert_compiles_once_lists_the_change_of_a_drifting_state():
    @jax.jit
    def step(state, batch):  # BUG: the Python float in the state comes back as a float32 array
        return {"w": state["w"] + jnp.sum(batch["x"])}, {"loss": jnp.sum(batch["x"])}

    assert_compiles_once(step, {"w": 0.0}, BATCH)  # the same arguments every call: compiles once
    with pytest.raises(CheckFailed) as info:
        assert_compiles_once(step, {"w": 0.0}, BATCH, thread_state=True)
    finding, = info.value.findings
    assert finding.message == "the step compiled again at call 1: state['w']: type Python float -> float32[]"
    assert finding.extra["changes"] == [{"path": "state['w']", "field": "type", "old": "Python float",
                                         "new": "float32[]"}]
    assert str(info.value).startswith("[jaxsane] the step recompiles: 1 problem(s)\n[warning] step.recompiles "
                                      "(state['w'], " + __file__)


def test_assert_compiles_once_with_identical_arguments_says_so():
    with pytest.raises(CheckFailed, match="the arguments are identical: the step function itself changed"):
        assert_compiles_once(lambda x: jax.jit(lambda y: y + 1)(x), jnp.ones(2))


def test_check_step_names_the_weak_typed_state_leaf():
    tx = optax.sgd(0.1)

    def init(key):
        params = {"w": jnp.zeros((5, 3)), "scale": jnp.asarray(1.0)}   # BUG: a weak-typed scalar leaf
        return params, tx.init(params)

    @jax.jit
    def step(state, batch):
        params, opt_state = state
        loss = lambda p: jnp.mean((batch["x"] @ p["w"]) * p["scale"].astype(jnp.float32))
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    findings = [f for f in check_step(jaxsane.Experiment(init=init, step=step, train=BATCH), calls=3)
                if f.code == "step.recompiles"]
    assert len(findings) == 1
    assert findings[0].message == ("the step compiled again at call 1: state[0]['scale']: weak_type True -> False "
                                   "(compilations per call [1, 1, 0])")
    assert findings[0].path == "state[0]['scale']" and "weak type" in findings[0].hint


def test_guard_warns_once_at_the_second_compile_naming_the_change():
    guarded = jaxsane.guard(jax.jit(_train_step))
    state = {"w": jnp.zeros(3)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            state, _ = guarded(state, BATCH)
        assert caught == []                                  # compiled once: nothing to say
        state, _ = guarded(state, {**BATCH, "x": np.ones((8, 6), np.float32)})
        state, _ = guarded(state, {**BATCH, "mask": np.ones(8, bool)})
    guarded.flush()
    assert guarded.compiles == 3
    mine = [w for w in caught if issubclass(w.category, jaxsane.JaxsaneWarning)]
    assert len(mine) == 1 and mine[0].filename == __file__   # once, pointing at the user's call
    finding = mine[0].message.finding
    assert finding.code == "step.recompiles" and finding.step == 3
    assert finding.extra["changes"] == [{"path": "batch['x']", "field": "shape", "old": "(8, 5)", "new": "(8, 6)"}]
    assert str(mine[0].message).startswith("[jaxsane] step.recompiles (step 3, batch['x'], " + __file__)
    assert "the guarded step compiled again at step 3: batch['x']: shape (8, 5) -> (8, 6)" in str(mine[0].message)
    assert [f.message for f in guarded.recompiles] == [
        "the guarded step compiled again at step 3: batch['x']: shape (8, 5) -> (8, 6)",
        "the guarded step compiled again at step 4: batch['mask']: added (bool[8]); "
        "batch['x']: shape (8, 6) -> (8, 5)"]   # in the new tree's order


def test_guard_names_a_changed_static_argument():
    step = functools.partial(jax.jit, static_argnums=2)(lambda s, b, n: (s * n, {"loss": jnp.sum(b)}))
    guarded = jaxsane.guard(step)
    with pytest.warns(jaxsane.JaxsaneWarning, match=r"n: value 2 -> 3"):
        guarded(jnp.ones(2), jnp.ones(3), 2)
        guarded(jnp.ones(2), jnp.ones(3), 2)
        guarded(jnp.ones(2), jnp.ones(3), 3)
    guarded.flush()
    assert guarded.compiles == 2 and len(guarded.recompiles) == 1


def test_guard_warn_recompiles_false_keeps_the_findings_without_the_warning():
    guarded = jaxsane.guard(jax.jit(_train_step), warn_recompiles=False)
    state = {"w": jnp.zeros(3)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxsane.JaxsaneWarning)
        state, _ = guarded(state, BATCH)
        state, _ = guarded(state, {**BATCH, "y": np.zeros(8, np.int64).astype(np.int16)})
    guarded.flush()
    assert [f.message for f in guarded.recompiles] == [
        "the guarded step compiled again at step 1: batch['y']: dtype int32 -> int16"]
    with pytest.raises(jaxsane.GuardConfigError, match="warn_recompiles must be True or False"):
        jaxsane.guard(_train_step, warn_recompiles="yes")


def test_equivalent_shardings_are_not_reported_beside_the_real_change():
    mesh = jax.make_mesh((8,), ("data",))
    old = jax.device_put(jnp.ones(4), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    new = jax.device_put(jnp.ones(4, jnp.int32), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None)))
    assert [str(c) for c in diff(signature((old,), names=["x"]), signature((new,), names=["x"]))] == \
        ["x: dtype float32 -> int32"]
