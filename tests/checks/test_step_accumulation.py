"""Gradient accumulation (optax.MultiSteps): parameters that move once every k steps are no bug in the step stage or
the run, while a step that never applies its update, without accumulation, still is."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsane
from jaxsane import check_step
from jaxsane._core.tree import accumulates_gradients


def _experiment(tx, applies=True):
    def init(key):
        p = {"w": jax.random.normal(key, (8, 3)) / 3}
        return p, tx.init(p)

    def loss(p, b):
        return optax.softmax_cross_entropy_with_integer_labels(b["x"] @ p["w"], b["y"]).mean()

    @jax.jit
    def step(s, b):
        value, grads = jax.value_and_grad(loss)(s[0], b)
        updates, opt = tx.update(grads, s[1], s[0])
        return (optax.apply_updates(s[0], updates) if applies else s[0], opt), {"loss": value}

    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(32, 8)).astype(np.float32), "y": rng.integers(0, 3, 32).astype(np.int32)}
    return jaxsane.Experiment(init=init, step=step, train=batch, loss=loss, name="accumulating")


def test_multisteps_is_found_in_the_state_by_path():
    accumulating = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=4)
    assert accumulates_gradients(({"w": jnp.ones(2)}, accumulating.init({"w": jnp.ones(2)})))
    assert not accumulates_gradients(({"w": jnp.ones(2)}, optax.adam(1e-2).init({"w": jnp.ones(2)})))


def test_unchanged_parameters_under_multisteps_are_not_judged_but_a_step_that_drops_its_update_is():
    accumulating = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=4)
    found = check_step(_experiment(accumulating))
    assert [f.code for f in found] == ["doctor.skipped"] and found[0].severity == "info", found
    assert "optax.MultiSteps" in found[0].message and "step_calls" in found[0].hint
    assert [f.code for f in check_step(_experiment(accumulating), calls=5)] == [], "the 4th call moves them"
    dropped = check_step(_experiment(optax.adam(1e-2), applies=False))
    assert [f.code for f in dropped] == ["step.no_update"] and dropped[0].severity == "error"


@pytest.mark.slow
def test_doctor_finds_no_error_or_warning_on_a_healthy_accumulating_program():
    d = jaxsane.doctor(_experiment(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=4)), progress=False,
                       run_telemetry_every=4)  # telemetry on steps 0, 4, 8...: every one between two updates
    assert not [f for f in d if f.severity in ("error", "warning")], d
