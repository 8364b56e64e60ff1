"""Dropping a jitted step's placement (``_jaxpr/placement.py``): the same values on one device when its jit's
shardings are all the placement it holds; None when anything inside names devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxsane._jaxpr.placement import places_values, unplaced

SEVERAL = pytest.mark.skipif(len(jax.devices()) < 2, reason="needs several devices (tests/conftest.py forces 8)")


def _mesh():
    mesh = Mesh(np.array(jax.devices()), ("data",))
    return mesh, NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))


def _args():
    rng = np.random.default_rng(0)
    return rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(2 * len(jax.devices()), 4)).astype(np.float32)


def _loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)


@SEVERAL
def test_a_data_parallel_step_runs_on_one_device_with_the_same_values():
    _, replicated, data = _mesh()
    step = jax.jit(
        lambda w, x: (w - 0.1 * jax.grad(_loss)(w, x), _loss(w, x)),
        in_shardings=(replicated, data),
        out_shardings=(replicated, replicated),
    )
    w, x = _args()
    one = unplaced(step, jax.ShapeDtypeStruct(w.shape, w.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype))
    assert one is not None
    compiled = jax.jit(one).lower(w, x).compile()
    assert all(len(s.device_set) == 1 for s in compiled.output_shardings)
    got, want = compiled(w, x), step(jax.device_put(w, replicated), jax.device_put(x, data))
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    # vmapped over configurations, as the sweep runs it
    assert jax.vmap(one)(np.stack([w, w]), np.stack([x, x]))[1].shape == (2,)
    assert not places_values(jax.make_jaxpr(one)(w, x))


@SEVERAL
@pytest.mark.parametrize("inside", ["constraint", "shard_map", "constant", "device_put"])
def test_a_step_that_places_values_inside_keeps_its_placement(inside):
    mesh, replicated, data = _mesh()
    w, x = _args()
    spread = jax.device_put(jnp.ones((3,)), replicated)

    def body(w, x):
        h = jnp.tanh(x @ w)
        if inside == "constraint":
            h = jax.lax.with_sharding_constraint(h, data)
        elif inside == "shard_map":
            counted = jax.shard_map(lambda v: v * jax.lax.psum(1.0, "data"), mesh=mesh, in_specs=P("data"), out_specs=P("data"))
            h = counted(h)
        elif inside == "constant":
            h = h + spread
        else:
            h = jax.device_put(h, replicated)
        return jnp.mean(h)

    step = jax.jit(body, in_shardings=(replicated, data))
    assert unplaced(step, w, x) is None
    assert places_values(jax.make_jaxpr(step)(w, x))


def test_a_function_without_placement_is_replayed_as_it_is():
    w, x = _args()
    one = unplaced(_loss, w, x)
    np.testing.assert_allclose(np.asarray(jax.jit(one)(w, x)), np.asarray(_loss(w, x)), rtol=1e-6)
    assert unplaced(lambda w, x: float(w.sum()), w, x) is None  # cannot be traced: keeps its own placement
