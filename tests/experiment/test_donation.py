"""A donating step never deletes the arrays that PureExperiment(reuse_init=True) shares between callers
(``_experiment/donation.py``): doctor's background checks read them while a stage calls the step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsane
from jaxsane import PureExperiment

TX = optax.sgd(0.1)
BATCH = {"x": np.ones((4, 3), np.float32), "y": np.zeros((4,), np.float32)}


def _loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def _experiment(donate: bool):
    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(_loss)(params, batch)
        updates, opt_state = TX.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    def init(key):
        params = {"w": jax.random.normal(key, (3,))}
        return params, TX.init(params)

    jitted = jax.jit(step, donate_argnums=0) if donate else jax.jit(step)
    return jaxsane.Experiment(init=init, step=jitted, train=BATCH, loss=_loss, params=lambda s: s[0])


@pytest.mark.parametrize("donate", [True, False])
def test_a_donating_step_leaves_the_shared_init_arrays_alone(donate):
    adapted = PureExperiment(_experiment(donate), reuse_init=True)
    key = jax.random.key(0)
    reader, caller = adapted.init(key), adapted.init(key)  # two callers, one set of arrays (a background check)
    shared = jax.tree_util.tree_leaves(reader)
    new_state, metrics = adapted.step(caller, BATCH)
    assert not any(x.is_deleted() for x in shared)  # the reader's arrays survive the donating call
    np.testing.assert_array_equal(np.asarray(adapted.params(reader)["w"]), np.asarray(adapted.params(caller)["w"]))
    assert float(metrics["loss"]) > 0 and not any(x.is_deleted() for x in jax.tree_util.tree_leaves(new_state))
    guard = adapted.memoized("traced:step")
    assert guard.donates is donate  # learned from the first call: a step that donates nothing is never copied for
    again, _ = adapted.step(new_state, BATCH)  # not shared: passed as it is (a donating step deletes it)
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(new_state)) is donate


def test_a_cut_of_a_batch_sharded_on_its_example_axis_keeps_whole_shards():
    """doctor's overfit sweep cuts the batch to a few examples; a step jitted with in_shardings P("data") over 8
    devices refuses 4 rows, so the cut is rounded up to whole shards (a replicated batch is cut as asked)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxsane._experiment.batches import whole_shards

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("data",))
    x = jax.device_put(np.zeros((8 * len(devices), 3), np.float32), NamedSharding(mesh, P("data")))
    assert whole_shards({"x": x}, 4) == (len(devices) if len(devices) > 1 else 4)
    assert whole_shards({"x": x}, 2 * len(devices)) == 2 * len(devices)
    assert whole_shards({"x": np.zeros((64, 3))}, 4) == 4
    assert whole_shards({"x": jax.device_put(np.zeros((64, 3)), NamedSharding(mesh, P()))}, 4) == 4
