"""The step check's snapshots: large leaves on an accelerator kept as on-device fingerprints, not host copies.

On this CPU-only machine the fingerprint path is forced (every platform treated as an accelerator, a tiny size
threshold), and the step check's own tests run through it again: each must reach the same verdict."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsane._checks.step_snapshot as snap

# the step check's scenarios, collected again here under the fingerprinting fixture below
from test_step_checks import (  # noqa: F401
    test_a_state_leaf_only_passed_through_is_not_stats_frozen,
    test_batchnorm_statistics_computed_and_dropped_are_stats_frozen,
    test_correct_optax_step_is_silent_and_compiles_once,
    test_dropout_key_never_advanced_is_rng_reused,
    test_dropout_with_split_key_is_silent,
    test_dropped_optimizer_state_is_frozen,
    test_fold_in_draws_are_compared_on_the_host,
    test_nnx_dropout_with_rngs_is_silent,
    test_stale_state_is_no_update,
)


@pytest.fixture(autouse=True)
def fingerprinting(monkeypatch):
    """Leaves of 16 bytes or more fingerprinted, whatever their platform (scalars and counters still copied)."""
    monkeypatch.setattr(snap, "HOST_PLATFORMS", ())
    monkeypatch.setattr(snap, "FINGERPRINT_BYTES", 16)


def _fingerprint(x):
    (_, value), = snap.snapshot({"x": x})
    assert isinstance(value, snap.Fingerprint), value
    return value


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.uint8, jnp.bool_])
def test_one_changed_element_changes_the_fingerprint(dtype):
    x = (jax.random.normal(jax.random.key(0), (64, 33)) * 4).astype(dtype)
    base = _fingerprint(x)
    assert snap.bitwise_equal(base, _fingerprint(jnp.array(x)))  # equal values, another buffer
    for index in [(0, 0), (63, 32), (17, 5)]:
        flipped = jnp.logical_not(x[index]) if dtype == jnp.bool_ else x[index] + jnp.ones((), dtype)
        assert not snap.bitwise_equal(base, _fingerprint(x.at[index].set(flipped))), index
    # a smallest change of a float: one bit of its mantissa
    if jnp.issubdtype(dtype, jnp.floating):
        nudged = jnp.nextafter(x[3, 3], jnp.asarray(jnp.inf, dtype))
        assert not snap.bitwise_equal(base, _fingerprint(x.at[3, 3].set(nudged)))


def test_swapped_elements_and_other_shapes_or_dtypes_are_not_the_same():
    x = jnp.arange(64, dtype=jnp.float32)
    base = _fingerprint(x)
    assert not snap.bitwise_equal(base, _fingerprint(x[::-1]))  # a permutation keeps the plain sum
    assert not snap.bitwise_equal(base, _fingerprint(x.reshape(8, 8)))
    assert not snap.bitwise_equal(base, _fingerprint(jax.lax.bitcast_convert_type(x, jnp.int32)))
    assert not snap.bitwise_equal(base, np.asarray(x))  # a host copy is never taken for the same fingerprint


def test_float64_leaves_are_fingerprinted_by_both_halves():
    with jax.enable_x64(True):
        x = jnp.linspace(0.0, 1.0, 40, dtype=jnp.float64)
        base = _fingerprint(x)
        # a change below float32's precision: only the low word moves
        assert not snap.bitwise_equal(base, _fingerprint(x.at[7].add(1e-15)))


@pytest.mark.parametrize("dtype", [jnp.complex64, jnp.int4])
def test_a_leaf_whose_bits_are_not_words_is_copied(dtype):
    x = jnp.ones((8, 8), dtype)  # bitcast refuses a complex or a sub-byte type: a host copy, as on the CPU
    (_, value), = snap.snapshot({"x": x})
    assert isinstance(value, np.ndarray) and snap.bitwise_equal(value, np.asarray(x))


def test_on_the_cpu_large_leaves_are_still_copied(monkeypatch):
    monkeypatch.setattr(snap, "HOST_PLATFORMS", ("cpu",))
    (_, value), = snap.snapshot({"x": jnp.ones((512, 512))})
    assert isinstance(value, np.ndarray)  # numpy reads a CPU array's own buffer: no fingerprint pays there


def test_a_fingerprinted_state_is_rebuilt_abstract_and_small_leaves_as_values():
    state = {"w": jnp.ones((8, 8)), "count": jnp.asarray(3, jnp.int32), "key": jax.random.key(1)}
    rebuilt = snap.state_from_snapshot(state, snap.snapshot(state))
    assert isinstance(rebuilt["w"], jax.ShapeDtypeStruct) and rebuilt["w"].shape == (8, 8)
    assert int(rebuilt["count"]) == 3
    assert jnp.array_equal(jax.random.key_data(rebuilt["key"]), jax.random.key_data(state["key"]))


def test_a_weakly_typed_counter_is_rebuilt_weakly_typed_so_the_step_is_not_traced_again():
    # a TrainState's step counter starts as a Python 0, weakly typed; rebuilt strongly typed, the rebuilt state's
    # signature differed from the original's and the step check traced the user's step once more (0.7 s, a Mixer)
    state = {"step": jnp.asarray(0), "lr": jnp.asarray(0.5), "count": jnp.asarray(3, jnp.int32), "w": jnp.ones(3)}
    assert jax.typeof(state["step"]).weak_type and not jax.typeof(state["count"]).weak_type
    rebuilt = snap.state_from_snapshot(state, snap.snapshot(state))
    assert [jax.typeof(x) for x in jax.tree_util.tree_leaves(rebuilt)] == [
        jax.typeof(x) for x in jax.tree_util.tree_leaves(state)
    ]
    assert int(rebuilt["step"]) == 0 and float(rebuilt["lr"]) == 0.5
