"""The replay's host (numpy) primitives: random bits, shifts, bitcasts and iotas give jax's values bit for bit,
with no compile, so a model with dropout is replayed without compiling its key arithmetic op by op."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src.random import prng
from jax._src.random.threefry2x32 import threefry_2x32

from jaxsane._locate.host_ops import NP, np_random_bits
from jaxsane._locate.locate import locate


@pytest.mark.parametrize("seed", [0, 1, 12345])
@pytest.mark.parametrize("bit_width", [8, 16, 32])
@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (2, 3, 7)])
def test_random_bits_match_jax(seed, bit_width, shape):
    key = jax.random.key(seed)
    ref = np.asarray(jax.random.bits(key, shape, dtype=f"uint{bit_width}"))
    got = np_random_bits(np.asarray(jax.random.key_data(key)), bit_width=bit_width, shape=shape)
    assert got.dtype == ref.dtype and np.array_equal(got, ref)


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.int8, np.uint16])
@pytest.mark.parametrize(
    "name, op",
    [
        ("shift_left", lax.shift_left),
        ("shift_right_logical", lax.shift_right_logical),
        ("shift_right_arithmetic", lax.shift_right_arithmetic),
    ],
)
def test_shifts_match_xla(dtype, name, op):
    info = np.iinfo(dtype)
    bits = 8 * np.dtype(dtype).itemsize
    x = np.array([info.min, -5 if info.min < 0 else 5, 3, info.max], dtype)
    y = np.array([1, bits - 1, bits, bits + 3], dtype)  # shifts by the width or more: 0 or the sign, never a wrap
    ref = np.asarray(op(x, y))
    got = NP[name](x, y)
    assert got.dtype == ref.dtype and np.array_equal(got, ref)


def test_bitcast_iota_and_threefry_match_jax():
    f = np.array([1.5, -0.0, np.inf, np.nan], np.float32)
    assert np.array_equal(NP["bitcast_convert_type"](f, new_dtype=np.uint32), lax.bitcast_convert_type(f, jnp.uint32))
    with pytest.raises(ValueError):  # a bitcast that changes the width is left to jax
        NP["bitcast_convert_type"](f, new_dtype=np.uint16)
    iota = NP["iota"](dtype=np.int32, shape=(3, 4), dimension=1, sharding=None)
    assert np.array_equal(iota, lax.broadcasted_iota(jnp.int32, (3, 4), 1))
    for shape in [(3, 4), (7,)]:
        assert all(np.array_equal(a, b) for a, b in zip(NP["iota_2x32_shape"](shape=shape), prng.iota_2x32_shape(shape)))
    k = np.array([7, 2**32 - 1], np.uint32)
    x = np.arange(6, dtype=np.uint32)
    ref = threefry_2x32(jnp.asarray(k), jnp.asarray(x))
    hi, lo = NP["threefry2x32"](k[0], k[1], x[:3], x[3:])
    assert np.array_equal(np.concatenate([hi, lo]), ref)


def _dropout_nan(x, key):
    keep = jax.random.bernoulli(key, 0.7, x.shape)
    return jnp.log(jnp.where(keep, x, -x))  # NaN exactly where an element was dropped


def test_locate_replays_dropout_with_the_compiled_bits_and_no_compile():
    x, key = jnp.linspace(0.5, 2.0, 64).reshape(8, 8), jax.random.key(3)
    events = []

    def listener(event, secs, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(event)

    locate(_dropout_nan, x[:4], key)  # the replay's own helpers, compiled once for any program
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        report = locate(_dropout_nan, x, key)  # bits of a shape not drawn before
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert events == [], "the replay compiled the dropout's random bits (or other key arithmetic) op by op"
    expected = int(np.isnan(np.asarray(jax.jit(_dropout_nan)(x, key))).sum())
    assert 0 < expected < 64
    assert report is not None and report.bad_outputs[0][1] == expected  # the same elements dropped: the same bits


def test_the_original_threefry_draws_are_left_to_jax():
    """Under the non-partitionable threefry the bits differ: the replay binds them, and still finds the same NaNs."""
    x, key = jnp.linspace(0.5, 2.0, 64).reshape(8, 8), jax.random.key(5)
    with jax.threefry_partitionable(False):
        expected = int(np.isnan(np.asarray(jax.jit(_dropout_nan)(x, key))).sum())
        report = locate(_dropout_nan, x, key)
    assert 0 < expected < 64
    assert report is not None and report.bad_outputs[0][1] == expected
