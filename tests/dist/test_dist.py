"""Sharded steps on 8 CPU devices: replica checks, per-shard NaN attribution, guard/locate/doctor.

conftest.py sets XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax is imported.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxsane
from jaxsane._dist.replicas import fingerprint, replica_fingerprints, replica_plan
from jaxsane._dist.shards import nonfinite_shards

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (CPU) devices")

N_IN, N_OUT, BATCH = 8, 3, 16          # 16 rows over 8 devices: 2 rows per device
tx = optax.sgd(0.1)


def mesh1():
    return jax.make_mesh((8,), ("data",))


def put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def make_batch(mesh, nan_row=None, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH, N_IN)).astype(np.float32)
    y = rng.normal(size=(BATCH, N_OUT)).astype(np.float32)
    if nan_row is not None:
        x[nan_row, 1] = np.nan
    return {"x": put(x, mesh, P("data")), "y": put(y, mesh, P("data"))}


def make_state(mesh, param_spec=P()):
    params = {"w": jnp.full((N_IN, N_OUT), 0.1), "b": jnp.zeros((N_OUT,))}
    params = {"w": put(params["w"], mesh, param_spec), "b": put(params["b"], mesh, P())}
    return params, jax.device_put(tx.init(params), NamedSharding(mesh, P()))


def loss_fn(params, batch):
    pred = batch["x"] @ params["w"] + params["b"]
    return jnp.mean((pred - batch["y"]) ** 2)


@jax.jit
def dp_step(state, batch):
    """Data parallel (or FSDP, by the params' sharding) with jit over NamedSharding inputs."""
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), {"loss": loss}


def shard_map_step(mesh, all_reduce=True):
    """A data-parallel shard_map step; without the gradient pmean its "replicated" params silently differ."""
    def local(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        if all_reduce:
            grads, loss = jax.lax.pmean((grads, loss), "data")
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), {"loss": loss}

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()),
                                 check_vma=False))


# ----------------------------------------------------------------------------- fingerprints
def test_fingerprint_is_bitwise_and_jit_safe():
    fp = jax.jit(fingerprint)
    x = np.linspace(-1, 1, 37, dtype=np.float32)
    y = x.copy()
    y[17] = np.nextafter(y[17], np.float32(2))                     # one ulp in one element
    assert np.array_equal(fp(x), fp(x.copy()))
    assert not np.array_equal(fp(x), fp(y))
    assert not np.array_equal(fp(x), fp(x[::-1].copy()))          # order matters
    for a in (jnp.ones(5, jnp.bfloat16), jnp.array([True, False]), jax.random.key(3)):
        assert fp(a).shape == (2,) and fp(a).dtype == jnp.uint32
    assert not np.array_equal(fp(jax.random.key(3)), fp(jax.random.key(4)))


# ----------------------------------------------------------------------------- check_replicas
def test_check_replicas_catches_missing_pmean_in_shard_map_step():
    mesh = mesh1()
    params, _ = make_state(mesh)
    batch = make_batch(mesh)
    good, _ = shard_map_step(mesh, all_reduce=True)(params, batch)
    assert jaxsane.check_replicas(good, root="params") == []
    bad, _ = shard_map_step(mesh, all_reduce=False)(params, batch)
    findings = jaxsane.check_replicas(bad, root="params")
    assert {f.code for f in findings} == {"dist.replica_divergence"}
    assert {f.path for f in findings} == {"params['b']", "params['w']"}
    f = next(f for f in findings if f.path == "params['w']")
    copies = {s.device.id: np.asarray(s.data) for s in bad["w"].addressable_shards}
    ref = copies[f.extra["reference_devices"][0]]
    assert f.extra["devices"] and all(not np.array_equal(copies[d], ref) for d in f.extra["devices"])
    assert f.extra["processes"] == [0] and not f.extra["per_process"]
    assert "pmean" in f.hint and f.extra["max_abs_diff"] > 0
    assert "params['w']" in f.message and str(f.extra["devices"][0]) in f.message


def test_check_replicas_names_the_one_bad_copy_of_a_partially_replicated_leaf():
    """FSDP-style: sharded over 'model', replicated over 'data'; device 5's copy is planted wrong."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    sharding = NamedSharding(mesh, P(None, "model"))
    full = np.arange(12, dtype=np.float32).reshape(3, 4)
    pieces = []
    for d, index in sharding.addressable_devices_indices_map(full.shape).items():
        piece = full[index].copy()
        if d.id == 5:
            piece[0, 0] += 1.0
        pieces.append(jax.device_put(piece, d))
    leaf = jax.make_array_from_single_device_arrays(full.shape, sharding, pieces)
    healthy = jax.device_put(full, sharding)
    assert jaxsane.check_replicas({"k": healthy}) == []
    (f,) = jaxsane.check_replicas({"k": leaf, "ok": healthy})
    assert f.path == "['k']" and f.extra["devices"] == [5] and f.extra["max_abs_diff"] == 1.0
    # the in-graph version agrees
    plan = replica_plan({"k": leaf})
    ok, fps = jax.jit(replica_fingerprints, static_argnums=1)({"k": leaf}, plan)
    assert not np.asarray(ok).any()


def test_check_replicas_silent_on_sharded_and_host_values():
    mesh = mesh1()
    state = make_state(mesh, param_spec=P("data", None))
    assert jaxsane.check_replicas((state, make_batch(mesh), np.ones(3), 1.5)) == []


# ----------------------------------------------------------------------------- guard: replicas
def test_guard_check_replicas_catches_missing_all_reduce_and_compiles_once():
    mesh = mesh1()
    params, _ = make_state(mesh)
    batch = make_batch(mesh)
    good = jaxsane.guard(shard_map_step(mesh, all_reduce=True), check_replicas=True, sync=True)
    p, _ = good(params, batch)
    p, _ = good(p, batch)   # the step's outputs carry P(None, None) where the inputs had P(): one retrace
    compiled = good.compiles
    p, _ = good(p, batch)
    good.flush()
    assert good.failures == [] and good.compiles == compiled
    bad = jaxsane.guard(shard_map_step(mesh, all_reduce=False), check_replicas=True, sync=True)
    with pytest.raises(jaxsane.ReplicaDivergenceError) as e:
        bad(params, batch)
    codes = {f.code for f in e.value.findings}
    assert codes == {"dist.replica_divergence"} and "params['w']" in str(e.value)
    assert "pmean" in str(e.value)
    # off by default: the same bug goes unnoticed without the option
    quiet = jaxsane.guard(shard_map_step(mesh, all_reduce=False), sync=True)
    quiet(params, batch)
    assert quiet.failures == []


def test_guard_check_replicas_warns_with_warn_policy():
    mesh = mesh1()
    params, _ = make_state(mesh)
    g = jaxsane.guard(shard_map_step(mesh, all_reduce=False), check_replicas=True, on_nonfinite="warn")
    g(params, make_batch(mesh))
    with pytest.warns(jaxsane.JaxsaneWarning, match="dist.replica_divergence"):
        g.flush()
    assert g.failures and g.failures[0].code == "dist.replica_divergence"


# ----------------------------------------------------------------------------- guard: NaN shards
@pytest.mark.parametrize("param_spec", [P(), P("data", None)], ids=["data_parallel", "fsdp"])
def test_guard_attributes_nan_batch_rows_to_their_device(param_spec):
    mesh = mesh1()
    state = make_state(mesh, param_spec)
    g = jaxsane.guard(dp_step, check_replicas=True)
    state, _ = g(state, make_batch(mesh))
    assert state[0]["w"].sharding.is_equivalent_to(NamedSharding(mesh, param_spec), 2)  # shardings pass through
    with pytest.raises(jaxsane.NonFiniteError) as e:
        g(state, make_batch(mesh, nan_row=11))
        g.flush()
    assert e.value.finding.code == "nonfinite.input"
    (shard,) = [f for f in g.failures if f.code == "dist.nonfinite_shard"]
    # rows 10:12 live on the 6th device of the mesh (2 rows per device)
    device = mesh.devices.flat[5].id
    assert shard.path == "batch['x']" and shard.extra["devices"] == [device]
    assert shard.extra["rows"] == [11] and shard.extra["rows_held"] == [[10, 12]]
    assert shard.extra["processes"] == [0]
    assert "dist.nonfinite_shard" in str(e.value) and f"device(s) {device}" in str(e.value)
    assert e.value.finding.extra["nonfinite_shard"]["devices"] == [device]


def test_guard_attributes_nan_born_on_one_device_in_a_sharded_output():
    """Finite batch; log of a negative value on one device's rows: per-example losses are sharded."""
    mesh = mesh1()
    x = np.abs(np.random.default_rng(0).normal(size=(BATCH, N_IN))).astype(np.float32) + 0.5
    x[6, 2] = -1.0                                                     # device 3 holds rows 6:8

    @jax.jit
    def step(w, x):
        per_example = jnp.sum(jnp.log(x) * w, axis=1)
        return w - 0.1 * jnp.mean(per_example), {"per_example": per_example}

    g = jaxsane.guard(step, sync=True, locate=False)
    with pytest.raises(jaxsane.NonFiniteError) as e:
        g(put(jnp.ones(N_IN), mesh, P()), put(x, mesh, P("data")))
    (shard,) = [f for f in g.failures if f.code == "dist.nonfinite_shard"]
    assert shard.path == "metrics['per_example']" and shard.extra["devices"] == [mesh.devices.flat[3].id]
    assert shard.extra["rows"] == [6]
    assert "nonfinite.forward" in str(e.value) or "nonfinite" in e.value.finding.code


@pytest.mark.parametrize("kind", ["jit", "shard_map"])
def test_guard_replays_shards_to_find_the_rows_behind_a_nan_spread_by_all_reduce(kind):
    """Finite batch; one row makes the loss NaN, and the mean/pmean spreads it to every device."""
    mesh = mesh1()

    def log_loss(params, batch):
        return jnp.mean(jnp.log(batch["x"]) @ params["w"] + params["b"])

    def local(params, batch):
        loss, grads = jax.value_and_grad(log_loss)(params, batch)
        if kind == "shard_map":
            grads, loss = jax.lax.pmean((grads, loss), "data")
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), {"loss": loss}

    step = jax.jit(local if kind == "jit" else jax.shard_map(
        local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=False))
    params, _ = make_state(mesh)
    x = np.abs(np.random.default_rng(0).normal(size=(BATCH, N_IN))).astype(np.float32) + 0.5
    ok_batch = {"x": put(x.copy(), mesh, P("data"))}
    x[13, 4] = -2.0                                                   # rows 12:14 live on the 7th device
    g = jaxsane.guard(step, sync=True, locate=False)
    params, _ = g(params, ok_batch)
    params, _ = g(params, ok_batch)
    compiled = g.compiles
    with pytest.raises(jaxsane.NonFiniteError) as e:
        g(params, {"x": put(x, mesh, P("data"))})
    (shard,) = [f for f in g.failures if f.code == "dist.nonfinite_shard"]
    assert shard.extra["replayed"] and shard.extra["devices"] == [mesh.devices.flat[6].id]
    assert shard.extra["rows_held"] == [[12, 14]] and shard.extra["rows"] == [13]
    assert "rows 12:14" in str(e.value) and "row(s) 13 alone" in str(e.value)
    assert g.compiles == compiled                     # the replays reuse the compiled step


def test_no_attribution_on_unsharded_or_everywhere_nan():
    mesh = mesh1()
    everywhere = put(jnp.full((8, 2), jnp.nan), mesh, P("data"))
    assert nonfinite_shards([("a", everywhere), ("b", jnp.array([jnp.nan]))]) is None


def test_guard_skip_keeps_sharded_state_bitwise_and_compiles_once():
    mesh = mesh1()
    state = make_state(mesh)
    g = jaxsane.guard(dp_step, on_nonfinite="skip", locate=False)
    state0, _ = g(state, make_batch(mesh))
    state1, _ = g(state0, make_batch(mesh))      # outputs carry P(None, None) for P(): one retrace, then stable
    compiled = g.compiles
    state2, _ = g(state1, make_batch(mesh, nan_row=3))
    g(state2, make_batch(mesh, seed=1))
    g.flush()
    assert g.skipped == 1 and g.compiles == compiled
    for a, b in zip(jax.tree.leaves(state1), jax.tree.leaves(state2)):
        assert np.array_equal(np.asarray(a), np.asarray(b)) and a.sharding == b.sharding


def test_guard_shard_map_step_nan_is_caught_and_attributed():
    mesh = mesh1()
    params, _ = make_state(mesh)
    g = jaxsane.guard(shard_map_step(mesh), sync=True, locate=False)
    params, _ = g(params, make_batch(mesh))
    with pytest.raises(jaxsane.NonFiniteError):
        g(params, make_batch(mesh, nan_row=0))
    (shard,) = [f for f in g.failures if f.code == "dist.nonfinite_shard"]
    assert shard.extra["devices"] == [mesh.devices.flat[0].id] and shard.extra["rows"] == [0]


# ----------------------------------------------------------------------------- locate and doctor
def test_locate_names_the_line_in_a_sharded_step():
    locate = pytest.importorskip("jaxsane._locate.locate").locate
    mesh = mesh1()

    @jax.jit
    def step(w, x):
        return w - 0.1 * jnp.mean(jnp.log(x) @ w)  # log of a negative row -> NaN

    x = np.ones((BATCH, N_IN), np.float32)
    x[9, 0] = -1.0
    report = locate(step, put(jnp.ones((N_IN,)), mesh, P()), put(x, mesh, P("data")))
    assert report is not None and report.origins[0].primitive == "log"
    assert report.origins[0].file.endswith("test_dist.py")


def test_doctor_runs_on_a_sharded_experiment():
    mesh = mesh1()
    batches = [make_batch(mesh, seed=s) for s in range(3)]

    def init(key):
        params = {"w": jax.random.normal(key, (N_IN, N_OUT)) * 0.1, "b": jnp.zeros((N_OUT,))}
        params = jax.device_put(params, NamedSharding(mesh, P()))
        return params, jax.device_put(tx.init(params), NamedSharding(mesh, P()))

    exp = jaxsane.Experiment(init=init, step=dp_step, train=batches, loss=loss_fn, name="sharded")
    diagnosis = jaxsane.doctor(exp, stages=["run"], progress=False, run_steps=3)
    assert not diagnosis.errors, diagnosis.render() if hasattr(diagnosis, "render") else diagnosis
    assert len(diagnosis.artifacts["run"]["loss"]) == 3

    bad = [make_batch(mesh, seed=0), make_batch(mesh, nan_row=13)]
    exp_bad = jaxsane.Experiment(init=init, step=dp_step, train=bad, loss=loss_fn, name="sharded_nan")
    diagnosis = jaxsane.doctor(exp_bad, stages=["run"], progress=False, run_steps=2)
    assert "nonfinite.input" in diagnosis.codes


def test_every_doctor_stage_runs_on_an_explicit_mesh_experiment():
    """jax.make_mesh gives Explicit axes: batch rows sharded as float32[16@data, 8]. Slicing such a batch
    on device or feeding an unsharded cotangent to its VJP raises; every stage must still run."""
    mesh = mesh1()
    assert jax.sharding.AxisType.Explicit in mesh.axis_types

    def init(key):
        params = {"w": jax.random.normal(key, (N_IN, N_OUT)) * 0.1, "b": jnp.zeros((N_OUT,))}
        params = jax.device_put(params, NamedSharding(mesh, P()))
        return params, jax.device_put(tx.init(params), NamedSharding(mesh, P()))

    def batches():  # a generator function: each call starts a fresh pass
        for s in range(4):
            yield make_batch(mesh, seed=s)

    exp = jaxsane.Experiment(init=init, step=dp_step, train=batches, loss=loss_fn,
                             apply=lambda p, x: x @ p["w"] + p["b"], name="explicit_mesh")
    diagnosis = jaxsane.doctor(exp, progress=False, run_steps=3, overfit_steps=50, overfit_seeds=1)
    crashed = [f for f in diagnosis if f.code == "doctor.skipped" and "crashed" in f.message]
    assert not crashed, "\n".join(map(str, crashed))
    assert diagnosis.complete, diagnosis.stages  # every stage ran (a crash in any code would show here too)
    assert "overfit.best" in diagnosis.codes and len(diagnosis.artifacts["run"]["loss"]) == 3


def test_guard_on_a_sharded_nnx_step():
    from flax import nnx

    mesh = mesh1()
    model = nnx.Linear(N_IN, N_OUT, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    for obj in (model, opt):
        nnx.update(obj, jax.device_put(nnx.state(obj), NamedSharding(mesh, P())))

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(model)
        opt.update(model, grads)
        return loss

    g = jaxsane.guard(step, check_replicas=True, sync=True, locate=False)
    g(model, opt, make_batch(mesh))
    assert g.failures == [] and any(g._replica_plans.values())   # replicated NNX state is checked
    with pytest.raises(jaxsane.NonFiniteError):
        g(model, opt, make_batch(mesh, nan_row=5))
    (shard,) = [f for f in g.failures if f.code == "dist.nonfinite_shard"]
    assert shard.extra["devices"] == [mesh.devices.flat[2].id] and shard.extra["rows"] == [5]


def test_check_replicas_of_copies_nan_everywhere_with_other_nan_bits_warns_nothing():
    """Every copy NaN, one with other NaN bits: the copies differ bitwise, and no difference is a number."""
    mesh = jax.make_mesh((8,), ("data",))
    sharding = NamedSharding(mesh, P())
    full = np.full((2, 3), np.nan, np.float32)
    other = full.view(np.uint32) | np.uint32(1)  # a NaN with another payload
    pieces = [jax.device_put(other.view(np.float32) if d.id == 3 else full, d)
              for d in sharding.addressable_devices_indices_map(full.shape)]
    leaf = jax.make_array_from_single_device_arrays(full.shape, sharding, pieces)
    (f,) = jaxsane.check_replicas({"k": leaf})  # warnings are errors in the suite: no "All-NaN slice"
    assert f.extra["devices"] == [3] and np.isnan(f.extra["max_abs_diff"])
