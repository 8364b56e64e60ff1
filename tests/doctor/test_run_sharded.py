"""The run stage on a data-parallel step (parameters replicated over every device, the batch sharded, the step
jitted with those shardings and donating its state): the copies it keeps of each step's inputs and its per-step
flags and norms are of one replica, and a step that goes non-finite is run again under guard on its inputs placed
back on the mesh, so the finding is guard's."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxsane
from jaxsane._doctor import run_stage

SEVERAL = pytest.mark.skipif(len(jax.devices()) < 2, reason="needs several devices (tests/conftest.py forces 8)")
TX = optax.sgd(0.1)


def _data_parallel(nan_at: int | None = None) -> jaxsane.Experiment:
    mesh = Mesh(np.array(jax.devices()), ("data",))
    data, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * len(jax.devices()), 8)).astype(np.float32)
    batch = {"x": jax.device_put(x, data), "y": jax.device_put((x[:, 0] > 0).astype(np.int32), data)}

    def loss(params, b):
        logits = jnp.tanh(b["x"] @ params["w1"]) @ params["w2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    def init(key):
        k1, k2 = jax.random.split(key)
        params = {"w1": jax.random.normal(k1, (8, 16)) * 0.3, "w2": jax.random.normal(k2, (16, 2)) * 0.3}
        return jax.device_put((params, TX.init(params), jnp.zeros((), jnp.int32)), replicated)

    def _step(state, b):
        params, opt_state, count = state
        value, grads = jax.value_and_grad(loss)(params, b)
        updates, opt_state = TX.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if nan_at is not None:  # the step's update goes NaN at one step
            params = jax.tree_util.tree_map(lambda p: jnp.where(count == nan_at, jnp.nan, p), params)
        return (params, opt_state, count + 1), {"loss": value}

    step = jax.jit(_step, in_shardings=(replicated, data), out_shardings=(replicated, replicated), donate_argnums=0)
    return jaxsane.Experiment(init=init, step=step, train=batch, loss=loss, params=lambda s: s[0], num_classes=2)


@SEVERAL
def test_the_run_keeps_one_replica_of_a_replicated_state_and_records_its_norms(monkeypatch):
    copied = []
    real = run_stage.copy_arrays

    def spy(tree):
        copied.extend(len(x.devices()) for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array))
        return real(tree)

    monkeypatch.setattr(run_stage, "copy_arrays", spy)
    d = jaxsane.doctor(_data_parallel(), stages=["run"], run_steps=6, progress=False, compile_cache=False)
    assert d.complete and not [f for f in d if f.severity == "error"], d
    assert copied and set(copied) == {1}  # the step donates: a copy each step, of one replica
    norms = np.asarray(d.artifacts["run"]["update_norm"], np.float64)  # (samples, leaves), from the replica
    assert norms.size and np.isfinite(norms).all() and (norms > 0).all()


@SEVERAL
def test_a_data_parallel_step_that_goes_nan_is_named_by_guard_on_its_inputs_back_on_the_mesh():
    d = jaxsane.doctor(_data_parallel(nan_at=3), stages=["run"], run_steps=6, progress=False, compile_cache=False)
    (found,) = [f for f in d if f.code.startswith("nonfinite.")]
    assert found.step == 3 and "not deterministic" not in found.message, found


@SEVERAL
def test_the_measures_of_a_replicated_steps_outputs_are_compiled_ahead_for_their_replica():
    # jax.eval_shape places the step's outputs nowhere: compiled ahead for that, `after` met the outputs' replica
    # on its first call and compiled again (0.4 s of an MLP-Mixer's run); once, in the background or (when the run
    # stage takes the queued compile itself) on the main thread
    compiled = []

    def listener(event, _seconds, **kw):
        if "backend_compile" in event:
            compiled.append(str(kw.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        d = jaxsane.doctor(_data_parallel(), stages=["run"], run_steps=4, progress=False, compile_cache=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert d.complete and not [f for f in d if f.severity == "error"], d
    assert len([name for name in compiled if "_after" in name]) == 1, compiled
