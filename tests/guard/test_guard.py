import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _programs import batch, linen_init, linen_step, nnx_init, nnx_step, optax_init, optax_step
from flax import nnx

import jaxsane


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


@pytest.mark.slow
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


@pytest.mark.slow
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
        model.l1.kernel[...] = model.l1.kernel[...] * jnp.nan
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
        model.l1.kernel[...] = model.l1.kernel[...] * jnp.nan
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


def test_skip_names_the_failing_leaf_by_replay_and_compiles_once():
    guarded = jaxsane.guard(jax.jit(_nan_params_step), on_nonfinite="skip", locate=False)
    state = optax_init(jax.random.key(0))
    new_state, _ = guarded(state, batch())
    guarded.flush()
    assert _leaves_equal(new_state, state) and guarded.skipped == 1
    finding = guarded.failures[0]
    assert finding.code == "nonfinite.update" and finding.path == "state[0]['w']"
    assert finding.extra["paths"] == ["state[0]['w']"]  # the replayed outputs, not the selected old state
    assert guarded.compiles == 1                       # the replay ran the same compiled program


def _many_leaves_state(n):
    return {f"p{i:04d}": jnp.full((3,) if i % 2 else (2, 2), 0.5, jnp.float32) for i in range(n)}


def _many_leaves_step(state, b):
    return jax.tree.map(lambda p: p * b, state), {"loss": b * 2}


def _hlo_ops(guarded, state, b):
    flag = np.bool_(True) if guarded.on_nonfinite == "skip" else None
    text = guarded._compiled_plain.lower((state, b), {}, flag).as_text()
    return text.count("stablehlo.reduce"), text.count("stablehlo.select"), text.count("stablehlo.case") + \
        text.count("stablehlo.if")


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_traced_checks_do_not_grow_per_leaf(policy):
    small, big = _many_leaves_state(64), _many_leaves_state(640)
    guarded = jaxsane.guard(_many_leaves_step, on_nonfinite=policy)
    (r_small, s_small, c_small), (r_big, s_big, c_big) = (_hlo_ops(guarded, small, jnp.float32(1)),
                                                          _hlo_ops(guarded, big, jnp.float32(1)))
    # grouped flags: one reduction per 64 same-(shape, dtype) leaves, not one per leaf
    assert r_big - r_small <= 640 // 64 + 2 and r_big < 640 // 8
    if policy == "skip":  # one lax.cond selects the whole state, no select per leaf
        assert c_big == 1 and s_big == s_small and s_big < 10
    out, _ = guarded(big, jnp.float32(1))
    guarded.flush()
    assert guarded.failures == [] and _leaves_equal(out, big)


@pytest.mark.parametrize("policy", ["raise", "skip", "warn"])
def test_many_leaves_failure_names_the_one_bad_leaf(policy):
    state = _many_leaves_state(300)

    def step(state, b):
        new = jax.tree.map(lambda p: p * b, state)
        new["p0137"] = new["p0137"].at[1].set(jnp.inf)
        return new, {"loss": b}

    guarded = jaxsane.guard(step, on_nonfinite=policy, sync=True, locate=False)
    if policy == "raise":
        with pytest.raises(jaxsane.NonFiniteError):
            guarded(state, jnp.float32(2))
    elif policy == "warn":
        with pytest.warns(jaxsane.JaxsaneWarning, match="p0137"):
            guarded(state, jnp.float32(2))
    else:
        out, _ = guarded(state, jnp.float32(2))
        assert _leaves_equal(out, state)
    assert guarded.failures[0].extra["paths"] == ["state['p0137']"]
    assert guarded.failures[0].code == "nonfinite.update"


def test_skip_nnx_names_the_failing_parameter():
    model, optimizer = nnx_init(jax.random.key(0))

    @nnx.jit
    def poison(model, optimizer, b):
        model.l1.kernel[...] = model.l1.kernel[...] * jnp.nan
        return jnp.sum(b["x"])

    before = jax.tree.map(np.array, jax.tree.leaves(nnx.state((model, optimizer))))
    guarded = jaxsane.guard(poison, on_nonfinite="skip", sync=True, locate=False)
    guarded(model, optimizer, batch())
    assert guarded.skipped == 1 and "l1" in guarded.failures[0].path and "kernel" in guarded.failures[0].path
    assert all(np.array_equal(a, b) for a, b in zip(before, jax.tree.leaves(nnx.state((model, optimizer)))))


@pytest.mark.parametrize("kwargs, match", [
    ({"max_lag": "2"}, r"max_lag must be an int >= 0"),
    ({"max_lag": -1}, r"max_lag must be an int >= 0"),
    ({"max_lag": 1.5}, r"max_lag must be an int >= 0"),
    ({"max_consecutive_skips": 0}, r"max_consecutive_skips must be an int >= 1"),
    ({"max_consecutive_skips": True}, r"max_consecutive_skips must be an int >= 1"),
    ({"on_nonfinite": "ignore"}, r"on_nonfinite must be one of 'raise', 'skip', 'warn'"),
    ({"on_nonfinite": None}, r"on_nonfinite must be one of"),
    ({"dump_dir": 3}, r"dump_dir must be None or a directory path"),
    ({"dump_dir": ""}, r"dump_dir must be None or a non-empty directory path"),
    ({"check_replicas": 0}, r"check_replicas must be True, False, or a step interval int >= 1"),
    ({"check_replicas": -2}, r"check_replicas must be True, False"),
    ({"check_replicas": "yes"}, r"check_replicas must be True, False"),
    ({"sync": "no"}, r"sync must be True or False"),
    ({"keep_inputs": None}, r"keep_inputs must be True or False"),
    ({"locate": 1}, r"locate must be True or False"),
])
def test_bad_arguments_are_clear_errors(kwargs, match):
    with pytest.raises(jaxsane.JaxsaneError, match=r"^\[jaxsane\] " + match) as info:
        jaxsane.guard(optax_step, **kwargs)
    assert isinstance(info.value, jaxsane._core.errors.GuardConfigError)
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)
    assert "jaxsane.guard" in str(info.value)


def test_good_arguments_are_accepted(tmp_path):
    g = jaxsane.guard(optax_step, on_nonfinite="warn", dump_dir=tmp_path, max_lag=np.int64(0), sync=False,
                      keep_inputs=False, locate=np.bool_(False), check_replicas=100, max_consecutive_skips=1)
    assert g.dump_dir == str(tmp_path) and g.max_lag == 0 and g.check_replicas == 100
    (tmp_path / "file").write_text("x")
    with pytest.raises(jaxsane.JaxsaneError, match="exists and is not a directory"):
        jaxsane.guard(optax_step, dump_dir=tmp_path / "file")


def test_skip_with_a_step_that_changes_a_dtype_is_a_clear_error():
    def step(state, b):
        return {"w": (state["w"] * b).astype(jnp.float16)}, {"loss": b}

    guarded = jaxsane.guard(step, on_nonfinite="skip")
    with pytest.raises(jaxsane.JaxsaneError, match=r"state\['w'\] comes in as float32\[3\] and goes out as "
                                                   r"float16\[3\]") as info:
        guarded({"w": jnp.ones(3)}, jnp.float32(2))
    assert isinstance(info.value, TypeError)
    same = jaxsane.guard(lambda s, b: ({"w": s["w"] * b}, {"loss": b}), on_nonfinite="skip", sync=True)
    out, _ = same({"w": jnp.ones(3)}, jnp.float32(2))
    assert same.failures == [] and float(out["w"][0]) == 2.0


# ----------------------------------------------------------------------------- JAXSANE_ON_NONFINITE (issue 17)

@pytest.mark.slow
def test_environment_switch_overrides_on_nonfinite_at_construction(monkeypatch):
    monkeypatch.setenv("JAXSANE_ON_NONFINITE", "skip")
    guarded = jaxsane.guard(_nan_params_step, locate=False)          # default "raise", no code change
    monkeypatch.setenv("JAXSANE_ON_NONFINITE", "raise")              # read once, when the step was wrapped
    state = optax_init(jax.random.key(0))
    new_state, _ = guarded(state, batch())
    guarded.flush()
    assert guarded.on_nonfinite == "skip" and guarded.skipped == 1 and _leaves_equal(new_state, state)
    monkeypatch.setenv("JAXSANE_ON_NONFINITE", " warn ")
    warned = jaxsane.guard(_nan_params_step, on_nonfinite="raise", sync=True, locate=False)  # env beats the argument
    with pytest.warns(jaxsane.JaxsaneWarning, match="nonfinite.update at step 0"):
        warned(state, batch())
    monkeypatch.setenv("JAXSANE_ON_NONFINITE", "")                   # empty: the argument again
    assert jaxsane.guard(_nan_params_step, on_nonfinite="warn").on_nonfinite == "warn"


@pytest.mark.parametrize("value, text", [
    ("skp", r"JAXSANE_ON_NONFINITE='skp' is not a policy of jaxsane.guard "
            r"\(valid: 'raise', 'skip', 'warn', 'breakpoint'\)"),
    ("rollback", "another tool's policy"),
])
def test_environment_switch_refuses_other_words(monkeypatch, value, text):
    monkeypatch.setenv("JAXSANE_ON_NONFINITE", value)
    with pytest.raises(jaxsane.GuardConfigError, match=text) as e:
        jaxsane.guard(_nan_params_step)
    assert str(e.value).startswith("[jaxsane] ") and "or unset it" in str(e.value)


def test_environment_breakpoint_is_raise_with_a_debugger_first(monkeypatch):
    # the debugger session itself is driven in tests/locate/test_debugger.py (a subprocess with a scripted stdin)
    monkeypatch.setenv("JAXSANE_ON_NONFINITE", "breakpoint")
    guarded = jaxsane.guard(_nan_params_step, on_nonfinite="skip", locate=False)    # env beats the argument
    assert guarded.breakpoint and guarded.on_nonfinite == "raise"
    monkeypatch.setenv("JAXSANE_ON_NONFINITE", "")
    assert not jaxsane.guard(_nan_params_step).breakpoint
    with pytest.raises(jaxsane.GuardConfigError, match=r"taken only from the environment"):   # not an argument
        jaxsane.guard(_nan_params_step, on_nonfinite="breakpoint")


def test_environment_breakpoint_is_refused_across_processes(monkeypatch):
    monkeypatch.setenv("JAXSANE_ON_NONFINITE", "breakpoint")
    guarded = jaxsane.guard(_nan_params_step, locate=False)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(jaxsane.GuardConfigError, match=r"cannot be used under jax.distributed \(2 processes\).*"
                                                       r"replay DUMP --step module:step --pdb"):
        guarded(optax_init(jax.random.key(0)), batch())


@pytest.mark.slow
def test_environment_switch_leaves_fit_and_doctor_policies_alone(monkeypatch):
    import test_fit as T
    monkeypatch.setenv("JAXSANE_ON_NONFINITE", "warn")
    with pytest.warns(jaxsane.JaxsaneWarning, match="rolled back"):
        result = jaxsane.fit(T.experiment(n=10, poison_at=(4,)), steps=10, eval_every=0, **T.FIT)
    assert result.rollbacks == 1


def test_a_guard_for_one_run_compiles_quickly_and_reports_as_guard_does():
    """Guarded(..., runs=1), doctor's re-run of a failing step: its program is compiled at XLA:CPU's quick
    level, and the failure it reports is the one the default guard reports."""
    from jaxsane._guard.guard import Guarded
    from jaxsane._jaxpr.compile_level import QUICK

    def step(w, x):
        return w * jnp.log(x), {"loss": jnp.sum(w)}

    w, x = jnp.ones(3), jnp.array([1.0, 0.0, -1.0])
    findings = []
    for guarded in (Guarded(step, sync=True), Guarded(step, sync=True, runs=1)):
        with pytest.raises(jaxsane.NonFiniteError) as err:
            guarded(w, x)
        findings.append((err.value.finding.code, err.value.finding.message))
        assert guarded.compiles == 1
    assert findings[0] == findings[1]
    from jaxsane._jaxpr.compile_level import QuickJit, compiler_options
    assert isinstance(Guarded(step, runs=1)._compiled_plain, QuickJit)
    assert not isinstance(Guarded(step)._compiled_plain, QuickJit)   # a training loop's guard: XLA's defaults
    traced = jax.jit(lambda w, x: step(w, x)).trace(w, x)
    assert compiler_options(traced.jaxpr, 1) == QUICK                # what one run of such a step is given


def _plateau_program(overflow: bool):
    """Adam and optax.contrib.reduce_on_plateau over a 20-loss window: its best value is +inf until the window
    fills. ``overflow`` plants a loss scale in the state that doubles into +inf at the first step."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    batch = {"x": x, "y": x @ rng.normal(size=(4, 1)).astype(np.float32)}
    tx = optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau(patience=5, accumulation_size=20))

    def init(key):
        params = {"w": jax.random.normal(key, (4, 1)) * 0.5}
        return params, tx.init(params), jnp.float32(3e38)

    def loss(params, b):
        return jnp.mean((b["x"] @ params["w"] - b["y"]) ** 2)

    @jax.jit
    def step(state, b):
        params, opt, scale = state
        value, grads = jax.value_and_grad(loss)(params, b)
        updates, opt = tx.update(grads, opt, params, value=value)
        return (optax.apply_updates(params, updates), opt, scale * 2 if overflow else scale), {"loss": value}

    return init, step, loss, batch


def test_an_infinite_placeholder_carried_in_the_optimizer_state_is_no_failure():
    """reduce_on_plateau starts its best value at +inf: guard and doctor's run passed it on step after step as a
    non-finite output (a false nonfinite.input error that also cut doctor's run at step 0). An inf carried from
    the input state is none; a scalar that turns inf in the step (an overflowing loss scale) still is."""
    init, step, loss, batch = _plateau_program(overflow=False)
    state, guarded = init(jax.random.key(0)), jaxsane.guard(step)
    for _ in range(3):
        state, _ = guarded(state, batch)
    assert jnp.isinf(state[1][1].best_value), "the placeholder is still there"
    exp = jaxsane.Experiment(init=init, step=step, train=[batch] * 30, loss=loss)
    d = jaxsane.doctor(exp, stages=["run"], progress=False)
    assert not [f for f in d if f.code.startswith("nonfinite")] and len(d.artifacts["run"]["loss"]) == 30
    init, step, _, batch = _plateau_program(overflow=True)
    with pytest.raises(jaxsane.NonFiniteError):
        jaxsane.guard(step, on_nonfinite="raise", sync=True)(init(jax.random.key(0)), batch)
