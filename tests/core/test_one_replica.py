"""``one_replica`` (``_core/tree.py``): a state replicated over a mesh seen as its replica on one device, for jaxsane's
own programs; anything sharded, or spread over other devices, left where it is."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxsane._core.tree import one_replica

SEVERAL = pytest.mark.skipif(len(jax.devices()) < 2, reason="needs several devices (tests/conftest.py forces 8)")


def _mesh(devices=None):
    return Mesh(np.array(devices or jax.devices()[::-1]), ("data",))  # reversed: the replica is not device 0's


@SEVERAL
def test_a_replicated_state_becomes_its_replica_on_one_device_without_a_copy():
    replicated = NamedSharding(_mesh(), P())
    state = {"w": jax.device_put(jnp.arange(6.0).reshape(2, 3), replicated), "step": 3}
    local = one_replica(state)
    (device,) = local["w"].devices()
    assert local["step"] == 3 and len(local["w"].devices()) == 1
    np.testing.assert_array_equal(local["w"], state["w"])
    assert local["w"].unsafe_buffer_pointer() == state["w"].addressable_data(0).unsafe_buffer_pointer()
    # abstract values go to the same device, so a program compiled for them takes the arrays
    spec = one_replica({"w": jax.ShapeDtypeStruct((2, 3), jnp.float32, sharding=replicated), "step": 3})["w"]
    assert spec.sharding == jax.sharding.SingleDeviceSharding(device)
    f = jax.jit(lambda t: t["w"] * 2)
    compiled = f.lower({"w": spec}).compile()
    np.testing.assert_array_equal(compiled({"w": local["w"]}), 2 * np.asarray(state["w"]))


@SEVERAL
def test_a_sharded_array_or_replicas_on_different_devices_leave_the_tree_as_it_is():
    mesh = _mesh()
    sharded = jax.device_put(jnp.ones((8 * len(jax.devices()), 2)), NamedSharding(mesh, P("data")))
    replicated = jax.device_put(jnp.ones(3), NamedSharding(mesh, P()))
    tree = (replicated, sharded)
    assert one_replica(tree) is tree
    half = len(jax.devices()) // 2
    other = jax.device_put(jnp.ones(3), NamedSharding(_mesh(jax.devices()[:half]), P()))
    elsewhere = (replicated, other)  # two meshes whose first replicas sit on different devices
    assert one_replica(elsewhere) is elsewhere


def test_a_tree_on_one_device_is_unchanged():
    tree = {"w": jnp.ones(3), "b": np.zeros(2)}
    assert one_replica(tree) is tree


def test_copy_arrays_copies_every_array_where_it_lives_and_keeps_what_is_committed():
    from jaxsane._core.tree import copy_arrays

    mesh = Mesh(np.array(jax.devices()), ("d",))
    spread = jax.device_put(jnp.arange(8.0 * len(jax.devices())), NamedSharding(mesh, P("d")))
    tree = {"loose": jnp.ones(3), "spread": spread, "key": jax.random.key(1), "n": 3, "host": np.ones(2)}
    copied = copy_arrays(tree)
    for name in ("loose", "spread", "key"):
        a, b = tree[name], copied[name]
        assert b is not a and b.sharding == a.sharding and b.committed == a.committed, name
        data = (lambda x: jax.random.key_data(x)) if name == "key" else (lambda x: x)
        assert np.array_equal(np.asarray(data(a)), np.asarray(data(b)))
        a.delete()  # the copy survives the original (a donating step deletes its inputs)
        assert not b.is_deleted()
    assert copied["n"] == 3 and copied["host"] is tree["host"]
