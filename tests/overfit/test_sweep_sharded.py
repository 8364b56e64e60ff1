"""The overfit sweep of a data-parallel step: params replicated, the batch sharded on its example axis over every
device, the step jitted with those in_shardings: doctor cuts the batch to whole shards (``batches.whole_shards``;
4 rows, 8 devices: the step refused the cut)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxsane

TX = optax.adam(1e-2)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs several devices (tests/conftest.py forces 8 CPU devices)")
def test_doctor_sweeps_a_step_jitted_for_a_batch_sharded_over_every_device():
    mesh = Mesh(np.array(jax.devices()), ("data",))
    data, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    n = 8 * len(jax.devices())
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    batch = {"x": jax.device_put(x, data), "y": jax.device_put((x[:, 0] > 0).astype(np.int32), data)}

    def loss(params, b):
        logits = jnp.tanh(b["x"] @ params["w1"]) @ params["w2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    def init(key):
        k1, k2 = jax.random.split(key)
        params = {"w1": jax.random.normal(k1, (8, 32)) * 0.3, "w2": jax.random.normal(k2, (32, 2)) * 0.3}
        params = jax.device_put(params, replicated)
        return params, jax.device_put(TX.init(params), replicated)

    @jax.jit
    def _step(state, b):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, b)
        updates, opt_state = TX.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    step = jax.jit(_step, in_shardings=(replicated, data), out_shardings=(replicated, replicated))
    exp = jaxsane.Experiment(init=init, step=step, train=batch, loss=loss, params=lambda s: s[0], num_classes=2)
    d = jaxsane.doctor(exp, stages=["overfit"], overfit_batch_size=4, progress=False, compile_cache=False)
    assert d.complete and not [f for f in d if f.severity != "info"], d
    assert d.artifacts["overfit"].batch_size % len(jax.devices()) == 0


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs several devices (tests/conftest.py forces 8 CPU devices)")
def test_doctor_sweeps_a_convolutional_step_whose_states_come_back_replicated_over_the_mesh():
    # a convolution makes the sweep loop on the host (HostLooped): its programs, compiled ahead for the default
    # device, then meet the states the user's step returned replicated over every device (out_shardings)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    data, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    n = 2 * len(jax.devices())
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 6, 6, 1)).astype(np.float32)
    y = (x.mean(axis=(1, 2, 3)) > 0).astype(np.int32)
    batch = {"x": jax.device_put(x, data), "y": jax.device_put(y, data)}

    def loss(params, b):
        h = jax.lax.conv_general_dilated(b["x"], params["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        logits = jnp.tanh(h).mean(axis=(1, 2)) @ params["w"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    def init(key):
        k1, k2 = jax.random.split(key)
        params = {"k": jax.random.normal(k1, (3, 3, 1, 8)) * 0.3, "w": jax.random.normal(k2, (8, 2)) * 0.3}
        params = jax.device_put(params, replicated)
        return params, jax.device_put(TX.init(params), replicated)

    def _step(state, b):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, b)
        updates, opt_state = TX.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    step = jax.jit(_step, in_shardings=(replicated, data), out_shardings=(replicated, replicated))
    exp = jaxsane.Experiment(init=init, step=step, train=batch, loss=loss, params=lambda s: s[0], num_classes=2)
    d = jaxsane.doctor(exp, stages=["overfit"], progress=False, compile_cache=False)
    assert d.complete and not [f for f in d if f.severity != "info"], d
    assert d.artifacts["overfit"].losses.shape[1] > 5  # the host loop ran past its first chunk
