"""locate on programs that carry typed PRNG keys (``jax.random.key``, dtype ``key<fry>``) through shard_map
bodies, scan carries, cond operands and batched while loops: numpy cannot hold a key, and a key is never
non-finite, so the replay must neither crash on one nor lose the origin's line or phase."""

import os

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxsane._locate.locate import locate

from _tagged import tag_finder

HERE, line_of = tag_finder(__file__)


def first_origin(fn, *args):
    report = locate(fn, *args)
    assert report is not None and report.origins, "expected a non-finite origin"
    return report.origins[0]


def assert_at(o, tag: str, code: str):
    assert os.path.abspath(o.file) == HERE and o.line == line_of(tag) and o.code == code, o.summary()


MESH = jax.make_mesh((8,), ("d",))
TX = optax.adam(0.1)


def _loss(w, x, key):
    noise = jax.random.normal(key, x.shape) * 0.01
    return jnp.mean(jnp.log((x + noise) @ w))  # <key_fwd>


def _local_step(w, opt_state, x, key):
    """One data-parallel step inside shard_map: the key is an operand of the body."""
    key, sub = jax.random.split(key)
    loss, grads = jax.value_and_grad(_loss)(w, x, jax.random.fold_in(sub, jax.lax.axis_index("d")))
    grads = jax.lax.pmean(grads, "d")
    updates, opt_state = TX.update(grads, opt_state, w)
    updates = jax.tree_util.tree_map(lambda u: u / jnp.sqrt(u - u), updates)  # <key_update>
    return optax.apply_updates(w, updates), opt_state, key, jax.lax.pmean(loss, "d")


_STEP = jax.jit(
    jax.shard_map(
        _local_step, mesh=MESH, in_specs=(P(), P(), P("d"), P()), out_specs=(P(), P(), P(), P()), check_vma=False
    )
)


def _inputs(x):
    w = jnp.ones((4, 2))
    return w, TX.init(w), jax.device_put(x, NamedSharding(MESH, P("d"))), jax.random.key(0)


def test_nan_born_in_the_update_inside_a_shard_map_with_a_key_operand_is_the_update_phase():
    o = first_origin(_STEP, *_inputs(jnp.ones((16, 4))))
    assert_at(o, "key_update", "nonfinite.update")
    assert any(w.startswith("shard 0, 1, 2") for w in o.where), o.where


def test_nan_born_in_the_forward_of_a_shard_map_body_with_a_key_operand():
    o = first_origin(_STEP, *_inputs(jnp.ones((16, 4)).at[5].set(-1.0)))
    assert_at(o, "key_fwd", "nonfinite.forward")
    assert any(w.startswith("shard 2 of 8") for w in o.where), o.where


def test_a_key_passed_to_a_shard_map_from_a_train_step_outside_it():
    """The shard_map computes the loss; the optimizer update (where the NaN is born) runs outside it."""

    def body(w, x, key):
        return jax.lax.pmean(jnp.mean((x + jax.random.normal(key, x.shape) * 0.0) @ w), "d")

    loss_fn = jax.shard_map(body, mesh=MESH, in_specs=(P(), P("d"), P()), out_specs=P(), check_vma=False)
    tx = optax.sgd(0.1)

    def step(w, opt_state, x, key):
        loss, grads = jax.value_and_grad(loss_fn)(w, x, key)
        updates, opt_state = tx.update(grads, opt_state, w)
        updates = jax.tree_util.tree_map(lambda u: u / (u - u), updates)  # <outer_update>
        return optax.apply_updates(w, updates), opt_state, loss

    w = jnp.ones((4, 2))
    x = jax.device_put(jnp.ones((16, 4)), NamedSharding(MESH, P("d")))
    assert_at(first_origin(step, w, tx.init(w), x, jax.random.key(0)), "outer_update", "nonfinite.update")


def test_key_in_a_scan_carry_a_cond_operand_and_a_batched_while_carry():
    def scanned(x, key):
        def body(carry, xi):
            k, acc = carry
            k, sub = jax.random.split(k)
            return (k, acc + jnp.log(xi + jax.random.uniform(sub) * 0.0)), k  # <key_scan>

        return jax.lax.scan(body, (key, 0.0), x)[0][1]

    o = first_origin(scanned, jnp.array([1.0, 2.0, -1.0]), jax.random.key(0))
    assert_at(o, "key_scan", "nonfinite.forward")
    assert "scan iteration 2" in o.where

    def branchy(x, key):
        return jax.lax.cond(
            x.sum() > 0, lambda x, k: jnp.log(x) + jax.random.normal(k), lambda x, k: x, x, key  # <key_cond>
        )

    assert_at(first_origin(branchy, jnp.array([1.0, 2.0, -0.5]), jax.random.key(0)), "key_cond", "nonfinite.forward")

    def looped(n, key):  # per-lane trip counts: the carry (the key too) is selected lane by lane
        def body(carry):
            i, k, v = carry
            k, sub = jax.random.split(k)
            return i + 1.0, k, v * jnp.exp(n * 40.0) + jax.random.uniform(sub)  # <key_while>

        return jax.lax.while_loop(lambda c: c[0] < n, body, (0.0, key, 1.0))[2]

    o = first_origin(jax.vmap(looped), jnp.array([1.0, 3.0]), jax.random.split(jax.random.key(0), 2))
    assert_at(o, "key_while", "nonfinite.forward")


@pytest.mark.slow
def test_doctor_run_stage_names_the_update_line_of_a_shard_map_step_with_a_key_in_its_state():
    """Inside doctor the located origin (not guard's own guess, without a line) is the finding."""
    import numpy as np

    import jaxsane

    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))  # (a host batch goes in)
    smap = jax.shard_map(
        _local_step, mesh=mesh, in_specs=(P(), P(), P("d"), P()), out_specs=(P(), P(), P(), P()), check_vma=False
    )

    @jax.jit
    def step(state, batch):
        w, opt_state, key = state
        w, opt_state, key, loss = smap(w, opt_state, batch["x"], key)
        return (w, opt_state, key), {"loss": loss}

    def init(key):
        w = jnp.ones((4, 2))
        return w, TX.init(w), key

    train = {"x": np.ones((16, 4), np.float32), "y": np.zeros(16, np.int32)}
    diagnosis = jaxsane.doctor(jaxsane.Experiment(init=init, step=step, train=train), stages=["run"],
                               progress=False, run_steps=3)
    found = [f for f in diagnosis.findings if f.code.startswith("nonfinite.")]
    assert found and found[0].code == "nonfinite.update", diagnosis.findings
    assert os.path.abspath(found[0].file) == HERE and found[0].line == line_of("key_update"), found[0]


@pytest.mark.slow
def test_guard_and_its_dump_replay_locate_the_update_line_with_a_key_operand(tmp_path):
    """guard's check skips the key output, its dump holds the key, and the dump's replay finds the same line."""
    import jaxsane
    from jaxsane._locate.locate import replay_dump

    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))  # (a dump holds host arrays)
    step = jax.jit(jax.shard_map(
        _local_step, mesh=mesh, in_specs=(P(), P(), P("d"), P()), out_specs=(P(), P(), P(), P()), check_vma=False
    ))
    w = jnp.ones((4, 2))
    guarded = jaxsane.guard(step, dump_dir=str(tmp_path), sync=True)
    with pytest.raises(jaxsane.NonFiniteError) as info:
        guarded(w, TX.init(w), jnp.ones((16, 4)), jax.random.key(0))
    finding = info.value.finding
    assert finding.code == "nonfinite.update" and finding.line == line_of("key_update"), finding
    report = replay_dump(finding.extra["dump"], step)
    assert_at(report.origins[0], "key_update", "nonfinite.update")
