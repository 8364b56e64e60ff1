"""doctor's analysis programs take the model's parameters and the batch as arguments, never as constants closed
over: a closure makes XLA embed them in the program, and the compile cache then compresses them (a 12M-parameter
Equinox MLP's batch-independence probe spent 3 s there, its init baseline as much again)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _programs import optax_step_of

import jaxsane
from jaxsane import check_batch_independence

WIDTH = 768  # 768 x 768 float32: 2.4 MB per matrix, above the 1 MB this test allows as constants


@pytest.fixture
def constants_warn_at_1mb():
    before = jax.config.jax_captured_constants_warn_bytes
    jax.config.update("jax_captured_constants_warn_bytes", 1_000_000)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield caught
    finally:
        jax.config.update("jax_captured_constants_warn_bytes", before)


def _captured(caught) -> list[str]:
    return [str(w.message)[:160] for w in caught if "constants were captured" in str(w.message)]


def _regression():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, WIDTH)).astype(np.float32)
    batch = {"x": x, "y": np.tanh(x[:, :4]).astype(np.float32)}
    tx = optax.adam(1e-3)

    def init(key):
        k1, k2 = jax.random.split(key)
        params = {
            "w1": jax.random.normal(k1, (WIDTH, WIDTH)) / np.sqrt(WIDTH),
            "w2": jax.random.normal(k2, (WIDTH, 4)) / np.sqrt(WIDTH),
        }
        return params, tx.init(params)

    def apply(params, x):
        return jnp.tanh(x @ params["w1"]) @ params["w2"]

    def loss(params, b):
        return jnp.mean((apply(params, b["x"]) - b["y"]) ** 2)

    return jaxsane.Experiment(
        init=init, step=optax_step_of(loss, tx), train=batch, loss=loss, apply=apply, inputs=lambda b: b["x"], labels=lambda b: b["y"]
    )


def test_the_init_baseline_and_the_batch_probe_capture_no_parameters(constants_warn_at_1mb):
    diagnosis = jaxsane.doctor(_regression(), stages=["init", "batch"], progress=False)
    assert [s["status"] for s in diagnosis.stages] == ["ran", "ran"], diagnosis.stages
    assert "init_loss" in diagnosis.artifacts and diagnosis.passed, diagnosis.findings
    assert _captured(constants_warn_at_1mb) == []


def test_the_forward_batch_probe_captures_no_parameters(constants_warn_at_1mb):
    """Integer inputs (token ids) take the forward probe, which compiles apply over the params too."""
    table = jnp.asarray(np.random.default_rng(0).normal(size=(WIDTH, WIDTH)), jnp.float32)
    tokens = np.arange(8 * 4).reshape(8, 4) % WIDTH
    assert check_batch_independence(lambda p, t: p[t].sum(1), table, tokens) == []
    assert _captured(constants_warn_at_1mb) == []


def test_a_closure_over_the_parameters_is_seen_by_this_test(constants_warn_at_1mb):
    """The warning this module relies on fires for a program that closes over a 2.4 MB matrix."""
    w = np.ones((WIDTH, WIDTH), np.float32)
    jax.jit(lambda x: x @ w)(jnp.ones((2, WIDTH)))
    assert _captured(constants_warn_at_1mb) != []
