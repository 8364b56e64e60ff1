"""The overfit sweep of a data-parallel step: params replicated, the batch sharded on its example axis over every
device, the step jitted with those in_shardings and out_shardings. doctor cuts the batch to whole shards
(``batches.whole_shards``: 4 rows on 8 devices, the step refused the cut), and runs a multi-device group program one
group at a time, its programs compiled ahead jitted for the states' shardings (a convolution's host loop)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxsane

TX = optax.adam(1e-2)
SEVERAL = pytest.mark.skipif(len(jax.devices()) < 2, reason="needs several devices (tests/conftest.py forces 8)")


def _data_parallel(loss, shapes, x, y):
    """An Experiment training ``loss`` on ``{"x": x, "y": y}`` sharded over every device, the parameters (normal
    draws of ``shapes``, scaled by 0.3) and the optimizer state replicated, the step jitted for those shardings."""
    mesh = Mesh(np.array(jax.devices()), ("data",))
    data, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    batch = {"x": jax.device_put(x, data), "y": jax.device_put(y, data)}

    def init(key):
        keys = jax.random.split(key, len(shapes))
        params = {name: jax.random.normal(k, shape) * 0.3 for k, (name, shape) in zip(keys, shapes.items())}
        params = jax.device_put(params, replicated)
        return params, jax.device_put(TX.init(params), replicated)

    def _step(state, b):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, b)
        updates, opt_state = TX.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    step = jax.jit(_step, in_shardings=(replicated, data), out_shardings=(replicated, replicated))
    return jaxsane.Experiment(init=init, step=step, train=batch, loss=loss, params=lambda s: s[0], num_classes=2)


def _convolutional(seed: int) -> jaxsane.Experiment:
    """A data-parallel convolutional classifier (a convolution makes the sweep loop on the host: HostLooped)."""
    x = np.random.default_rng(seed).normal(size=(2 * len(jax.devices()), 6, 6, 1)).astype(np.float32)

    def loss(params, b):
        h = jax.lax.conv_general_dilated(
            b["x"], params["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        logits = jnp.tanh(h).mean(axis=(1, 2)) @ params["w"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    return _data_parallel(loss, {"k": (3, 3, 1, 8), "w": (8, 2)}, x, (x.mean(axis=(1, 2, 3)) > 0).astype(np.int32))


@SEVERAL
def test_doctor_sweeps_a_step_jitted_for_a_batch_sharded_over_every_device():
    x = np.random.default_rng(0).normal(size=(8 * len(jax.devices()), 8)).astype(np.float32)

    def loss(params, b):
        logits = jnp.tanh(b["x"] @ params["w1"]) @ params["w2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    exp = _data_parallel(loss, {"w1": (8, 32), "w2": (32, 2)}, x, (x[:, 0] > 0).astype(np.int32))
    d = jaxsane.doctor(exp, stages=["overfit"], overfit_batch_size=4, progress=False, compile_cache=False)
    assert d.complete and not [f for f in d if f.severity != "info"], d
    assert d.artifacts["overfit"].batch_size % len(jax.devices()) == 0


@SEVERAL
def test_doctor_sweeps_a_convolutional_step_whose_states_come_back_replicated_over_the_mesh():
    # a convolution makes the sweep loop on the host (HostLooped): its programs, compiled ahead for the default
    # device, then meet the states the user's step returned replicated over every device (out_shardings)
    exp = _convolutional(seed=0)
    d = jaxsane.doctor(exp, stages=["overfit"], progress=False, compile_cache=False)
    assert d.complete and not [f for f in d if f.severity != "info"], d
    assert d.artifacts["overfit"].losses.shape[1] > 5  # the host loop ran past its first chunk


@SEVERAL
def test_the_host_loops_programs_are_compiled_ahead_for_the_mesh_the_users_step_returns_the_states_on(monkeypatch):
    # compiled for the default device, the per-chunk record and the early-exit test refused the states the step
    # returned replicated over the mesh, and each compiled again on its first call (3.5 s of an MLP-Mixer's sweep)
    from jaxsane._overfit import sweep_compile as sweep

    again = []
    real = sweep.CompiledAhead.__call__

    def spy(self, *args):
        ahead = self.compiled is not None
        out = real(self, *args)
        if ahead and self.compiled is None:
            again.append(self)
        return out

    monkeypatch.setattr(sweep.CompiledAhead, "__call__", spy)
    exp = _convolutional(seed=1)
    d = jaxsane.doctor(exp, stages=["overfit"], progress=False, compile_cache=False)
    assert d.complete and not [f for f in d if f.severity != "info"], d
    assert not again, [type(a).__name__ for a in again]


def _dense(constrained: str) -> jaxsane.Experiment:
    """A data-parallel MLP classifier with apply; ``constrained`` ("loss", "apply" or ""): which of them pins the
    hidden layer's sharding on the mesh (the sweep's step calls the loss, its accuracy apply)."""
    x = np.random.default_rng(2).normal(size=(8 * len(jax.devices()), 8)).astype(np.float32)
    mesh = Mesh(np.array(jax.devices()), ("data",))

    def logits(params, inputs, pinned):
        h = jnp.tanh(inputs @ params["w1"])
        if pinned:
            h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P("data")))
        return h @ params["w2"]

    def loss(params, b):
        out = logits(params, b["x"], constrained == "loss")
        return optax.softmax_cross_entropy_with_integer_labels(out, b["y"]).mean()

    exp = _data_parallel(loss, {"w1": (8, 32), "w2": (32, 2)}, x, (x[:, 0] > 0).astype(np.int32))
    apply = lambda params, inputs: logits(params, inputs, constrained == "apply")  # noqa: E731
    return dataclasses.replace(exp, apply=apply, inputs=lambda b: b["x"], labels=lambda b: b["y"])


@SEVERAL
@pytest.mark.parametrize("constrained", ["", "loss", "apply"])
def test_a_replicated_sweep_runs_on_one_device_unless_the_step_places_values_itself(monkeypatch, constrained):
    # compiled for the mesh its state is replicated on, the sweep ran whole on every device (an MLP-Mixer on 8 host
    # devices: 8 times the work on 2 cores); a step whose jit only places its values sweeps on one device, one that
    # constrains a value's sharding inside stays on the mesh, and so does a sweep whose accuracy (apply) does
    from jaxsane._overfit import sweep_compile as sweep

    programs = []
    real = sweep._compiled
    monkeypatch.setattr(sweep, "_compiled", lambda *a, **k: programs.append(a[1]) or real(*a, **k))
    d = jaxsane.doctor(_dense(constrained), stages=["overfit"], progress=False, compile_cache=False)
    assert d.complete and not [f for f in d if f.severity != "info"], d
    assert d.artifacts["overfit"].reached.any(), d.artifacts["overfit"]
    assert (d.artifacts["overfit"].accuracy is not None) and d.artifacts["overfit"].compiles == 1
    (traced,) = programs
    devices = {len(s.device_set) for s in traced.lower().compile().output_shardings if hasattr(s, "device_set")}
    assert devices == ({len(jax.devices())} if constrained else {1}), devices
