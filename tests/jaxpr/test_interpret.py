"""The one jaxpr interpreter (lax semantics of its control-flow rules), the one library-frame predicate,
and recurrent models through every tool that interprets a jaxpr: monitor telemetry, activation
statistics / check_init, locate and step.rng_reused."""

import inspect
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxsane
from jaxsane._checks.init import activation_stats, check_init
from jaxsane._checks.step import check_step
from jaxsane._core.frames import is_library_file
from jaxsane._experiment.contract import PureExperiment
from jaxsane._jaxpr.interpret import Interpreter
from jaxsane._monitor.monitor import MODE_FULL, Monitor

B, T, F, H, C = 6, 5, 4, 8, 3


# ----------------------------------------------------------------------------- the interpreter

def _programs():
    def scan_fn(c, xs):
        def body(carry, x):
            a, n = carry
            a = jnp.tanh(a * c + x)
            return (a, n + 1), (a * 2.0, jnp.sum(x))
        return jax.lax.scan(body, (jnp.zeros(3), 0), xs)

    def scan_reverse(c, xs):
        return jax.lax.scan(lambda a, x: (a * 0.5 + x * c, a), jnp.ones(3), xs, reverse=True, unroll=2)

    def scan_length(c, xs):
        return jax.lax.scan(lambda a, _: (a + c, a * a), jnp.zeros(()), None, length=4)

    def while_fn(c, xs):
        return jax.lax.while_loop(lambda s: s[0] < 7, lambda s: (s[0] + 1, s[1] * c + xs[0]), (0, jnp.ones(3)))

    def fori_fn(c, xs):
        return jax.lax.fori_loop(0, 3, lambda i, a: a + xs[i] * c, jnp.zeros(3))

    def cond_fn(c, xs):
        return jax.lax.cond(c > 0, lambda x: jnp.sin(x), lambda x: jnp.cos(x) * 2.0, xs)

    def switch_fn(c, xs):
        return jax.lax.switch(jnp.int32(c), [jnp.sin, jnp.cos, jnp.tanh], xs)

    def nested(c, xs):
        @jax.jit
        def inner(a, x):
            return jax.checkpoint(lambda y: jnp.sin(y) * a)(x)
        return jax.lax.scan(lambda a, x: (a + 1.0, jax.lax.scan(lambda b, z: (b, inner(a, z)), 0.0, x)[1]),
                            c, xs.reshape(2, 2, 3))

    return [scan_fn, scan_reverse, scan_length, while_fn, fori_fn, cond_fn, switch_fn, nested]


@pytest.mark.parametrize("fn", _programs(), ids=lambda f: f.__name__)
@pytest.mark.parametrize("mode", ["concrete", "jit"])
def test_interpreter_matches_lax_semantics(fn, mode):
    c, xs = jnp.float32(1.5), jnp.arange(12.0).reshape(4, 3) / 10
    closed = jax.make_jaxpr(fn)(c, xs)
    expected = jax.tree.leaves(fn(c, xs))

    def run(c, xs):
        return Interpreter().run(closed.jaxpr, closed.consts, [c, xs])[0]

    got = run(c, xs) if mode == "concrete" else jax.jit(run)(c, xs)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-6, atol=1e-6)


def _key_programs():
    def scan_keys(key, xs):  # a key carry and key ys
        def body(k, x):
            k, sub = jax.random.split(k)
            return k, (sub, x + jax.random.uniform(sub))
        return jax.lax.scan(body, key, xs)

    def scan_no_steps(key, xs):  # zero iterations: the stacked key ys are empty
        return jax.lax.scan(lambda k, x: (k, k), key, xs[:0])

    def batched_while(key, xs):  # per-lane trip counts: the key carry is selected lane by lane
        def one(k, n):
            return jax.lax.while_loop(lambda s: s[0] < n, lambda s: (s[0] + 1.0, jax.random.split(s[1])[0]),
                                      (0.0, k))[1]
        return jax.vmap(one)(jax.random.split(key, 3), xs[:3, 0] * 10)

    def cond_key(key, xs):
        return jax.lax.cond(xs.sum() > 0, lambda k, x: (k, x), lambda k, x: (jax.random.fold_in(k, 1), -x), key, xs)

    return [scan_keys, scan_no_steps, batched_while, cond_key]


def _bits(x):
    return np.asarray(jax.random.key_data(x)) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else np.asarray(x)


@pytest.mark.parametrize("fn", _key_programs(), ids=lambda f: f.__name__)
@pytest.mark.parametrize("mode", ["concrete", "jit"])
def test_interpreter_carries_typed_prng_keys(fn, mode):
    key, xs = jax.random.key(3), jnp.arange(12.0).reshape(4, 3) / 10
    closed = jax.make_jaxpr(fn)(key, xs)
    expected = jax.tree.leaves(fn(key, xs))

    def run(key, xs):
        return Interpreter().run(closed.jaxpr, closed.consts, [key, xs])[0]

    got = run(key, xs) if mode == "concrete" else jax.jit(run)(key, xs)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_allclose(_bits(g), _bits(e), rtol=1e-6)


class _Tanhs(Interpreter):
    def after(self, eqn, invals, outs, tags, out_tags, ectx):
        if eqn.primitive.name == "tanh":
            self.emit(eqn, outs[0])
        return outs, out_tags


@pytest.mark.parametrize("mode", ["concrete", "jit"])
def test_values_recorded_in_a_scan_body_are_stacked_per_time_step(mode):
    fn = _programs()[0]
    c, xs = jnp.float32(1.5), jnp.arange(12.0).reshape(4, 3) / 10
    closed = jax.make_jaxpr(fn)(c, xs)

    def run(c, xs):
        it = _Tanhs()
        with it.collecting() as records:
            it.run(closed.jaxpr, closed.consts, [c, xs])
        return list(records.values())

    (rec,) = run(c, xs) if mode == "concrete" else jax.jit(run)(c, xs)
    _, (ys, _) = fn(c, xs)
    assert rec.shape == (4, 3)                       # one row per time step, not the whole axis at once
    np.testing.assert_allclose(np.asarray(rec) * 2.0, np.asarray(ys), rtol=1e-6)


def test_while_records_stack_per_iteration_when_concrete_and_are_dropped_when_traced():
    c, xs = jnp.float32(0.5), jnp.arange(12.0).reshape(4, 3) / 10
    closed = jax.make_jaxpr(lambda c, xs: jax.lax.while_loop(
        lambda s: s[0] < 3, lambda s: (s[0] + 1, jnp.tanh(s[1] * c + xs[0])), (0, jnp.ones(3))))(c, xs)

    def run(c, xs):
        it = _Tanhs()
        with it.collecting() as records:
            outs, _ = it.run(closed.jaxpr, closed.consts, [c, xs])
        return outs, list(records.values())

    outs, recs = run(c, xs)
    assert [r.shape for r in recs] == [(3, 3)]                    # three iterations ran
    np.testing.assert_allclose(np.asarray(recs[0][-1]), np.asarray(outs[1]), rtol=1e-6)
    outs_jit, recs_jit = jax.jit(run)(c, xs)
    assert recs_jit == [] and np.allclose(outs_jit[1], outs[1])


# ----------------------------------------------------------------------------- the frame predicate

def test_library_frame_predicate():
    site = os.path.dirname(os.path.dirname(jax.__file__))
    assert is_library_file(jax.__file__) and is_library_file(np.__file__) and is_library_file(optax.__file__)
    assert is_library_file(inspect.__file__)                               # the stdlib
    assert is_library_file(jaxsane.__file__)
    assert is_library_file(os.path.join(site, "equinox", "_jit.py"))
    assert is_library_file(os.path.join(site, "orbax", "checkpoint", "x.py"))
    assert not is_library_file(os.path.join(site, "my_models", "rnn.py"))   # a user's installed package
    assert not is_library_file(os.path.join(os.path.dirname(jaxsane.__file__), "examples", "digits_optax.py"))
    assert not is_library_file(__file__)


# ----------------------------------------------------------------------------- a hand-written lax.scan RNN

def _rnn_params(key, bias=0.0, const_wx=False):
    k1, k2, k3 = jax.random.split(key, 3)
    wx = jnp.full((F, H), 0.3, jnp.float32) if const_wx else jax.random.normal(k1, (F, H)) / np.sqrt(F)
    return {"wx": wx, "wh": jax.random.normal(k2, (H, H)) / np.sqrt(H), "b": jnp.full((H,), bias, jnp.float32),
            "out": jax.random.normal(k3, (H, C)) / np.sqrt(H)}


def rnn_apply(p, x):
    def cell(h, x_t):
        h = jnp.tanh(x_t @ p["wx"] + h @ p["wh"] + p["b"])
        return h, jax.nn.relu(h)
    _, ys = jax.lax.scan(cell, jnp.zeros((x.shape[0], H)), jnp.swapaxes(x, 0, 1))
    return jnp.mean(ys, axis=0) @ p["out"]


def _ce(apply):
    def loss(p, batch):
        return optax.softmax_cross_entropy_with_integer_labels(apply(p, batch["x"]), batch["y"]).mean()
    return loss


BATCH = {"x": np.asarray(jax.random.uniform(jax.random.key(3), (B, T, F))),
         "y": np.arange(B) % C}


def _pure_experiment(init_params, apply):
    tx = optax.adam(1e-2)
    loss = _ce(apply)

    def init(key):
        params = init_params(key)
        return params, tx.init(params)

    @jax.jit
    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    return jaxsane.Experiment(init=init, step=step, train=[BATCH], loss=loss, apply=apply, num_classes=C)


def _telemetry(exp):
    adapted = PureExperiment(exp)
    mon = Monitor(adapted, every=1, dead_every=1)
    state = adapted.init(jax.random.key(0))
    _, metrics = mon.step(state, BATCH, MODE_FULL)
    return jax.tree.map(np.asarray, metrics["telemetry"])


@pytest.mark.slow
@pytest.mark.parametrize("bias", [0.0, -50.0])
def test_monitor_telemetry_on_a_scan_rnn(bias):
    tel = _telemetry(_pure_experiment(lambda k: _rnn_params(k, bias=bias), rnn_apply))
    assert np.all(np.isfinite(tel["grad_norm"])) and np.all(np.isfinite(tel["param_norm"]))
    assert tel["dead_fraction"].shape == (1,)              # the ReLU inside the scan body, one site
    if bias == 0.0:
        assert 0.0 <= tel["dead_fraction"][0] < 0.5
    else:                                                  # tanh(-50) -> -1 -> every ReLU unit dead
        assert tel["dead_fraction"][0] == 1.0


@pytest.mark.slow
def test_doctor_run_stage_on_a_scan_rnn_does_not_crash():
    from jaxsane._doctor.doctor import doctor
    diagnosis = doctor(_pure_experiment(_rnn_params, rnn_apply), stages=["run"], progress=False, run_steps=6,
                       run_dead_every=2)
    assert [f.message for f in diagnosis if f.code == "doctor.skipped"] == []
    dead = np.asarray(diagnosis.artifacts["run"]["dead_fraction"], dtype=float)
    assert dead.shape[0] >= 1 and dead.shape[1] == 1 and np.all((dead >= 0) & (dead < 0.5))   # the ReLU in the scan


@pytest.mark.slow
def test_activation_stats_and_check_init_see_layers_inside_a_scan_body():
    params = _rnn_params(jax.random.key(0))
    layers = activation_stats(rnn_apply, params, BATCH["x"])
    names = [l.name for l in layers]
    assert names == ["params['wx']", "params['wh']", "params['out']"]
    assert all(np.isfinite([l.pre_rms, l.act_std]).all() for l in layers)
    assert [l.shape for l in layers] == [(B, H), (B, H), (B, C)] and layers[-1].is_output
    assert layers[0].act_frac_zero == 0.0 and 0.0 < layers[1].pre_rms < 10.0
    assert layers[0].location and layers[0].location.endswith(f"test_interpret.py:{_line_of('x_t @ p[')}")
    healthy = check_init(rnn_apply, params, BATCH["x"], BATCH["y"])
    assert "init.symmetric" not in [f.code for f in healthy]
    faulty = check_init(rnn_apply, _rnn_params(jax.random.key(0), const_wx=True), BATCH["x"], BATCH["y"])
    sym = [f for f in faulty if f.code == "init.symmetric"]
    assert [f.path for f in sym] == ["params['wx']"]


def _line_of(text: str) -> int:
    lines = open(__file__).read().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line and "def " not in line)


def test_init_scale_sweep_measures_a_layer_inside_a_scan_body():
    sweep = jaxsane.init_scale_sweep(_pure_experiment(_rnn_params, rnn_apply), BATCH, scales=(0.5, 2.0))
    assert sum("in a scan body" in l for l in sweep.layers) == 2
    assert np.all(np.isfinite(sweep.activation_std)) and np.all(np.isfinite(sweep.gradient_std))
    assert np.all(sweep.activation_std[1] > sweep.activation_std[0])   # larger weights, larger activations


def rnn_with_sqrt(p, x):
    def cell(h, x_t):
        h = jnp.tanh(x_t @ p["wx"] + h @ p["wh"]) * jnp.sqrt(x_t[:, :1])  # NaN for a negative input
        return h, h
    _, ys = jax.lax.scan(cell, jnp.zeros((x.shape[0], H)), jnp.swapaxes(x, 0, 1))
    return jnp.mean(ys, axis=0) @ p["out"]


def test_locate_finds_a_nan_born_inside_a_scan_body_at_its_line_and_iteration():
    x = np.array(BATCH["x"])
    x[2, 3, 0] = -1.0
    report = jaxsane.locate(rnn_with_sqrt, _rnn_params(jax.random.key(0)), x)
    o = report.origins[0]
    assert o.primitive == "sqrt" and o.file.endswith("test_interpret.py")
    assert o.line == _line_of("jnp.sqrt(x_t[:, :1])")
    assert "scan iteration 3" in o.where
    assert jaxsane.locate(rnn_with_sqrt, _rnn_params(jax.random.key(0)), BATCH["x"]) is None


def _dropout_rnn_experiment(split_key):
    tx = optax.adam(1e-2)

    def loss(p, batch, key):
        def cell(h, inp):
            x_t, k = inp
            h = jnp.tanh(x_t @ p["wx"] + h @ p["wh"] + p["b"])
            return jnp.where(jax.random.bernoulli(k, 0.8, h.shape), h / 0.8, 0.0), None  # dropout
        keys = jax.random.split(key, T)
        h, _ = jax.lax.scan(cell, jnp.zeros((B, H)), (jnp.swapaxes(batch["x"], 0, 1), keys))
        return optax.softmax_cross_entropy_with_integer_labels(h @ p["out"], batch["y"]).mean()

    def init(key):
        params = _rnn_params(key)
        return params, tx.init(params), jax.random.key(1)

    @jax.jit
    def step(state, batch):
        params, opt_state, key = state
        if split_key:
            key, sub = jax.random.split(key)
        else:
            sub = key   # BUG: the same dropout masks every step
        value, grads = jax.value_and_grad(loss)(params, batch, sub)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, key), {"loss": value}

    return jaxsane.Experiment(init=init, step=step, train=[BATCH], num_classes=C)


@pytest.mark.slow
def test_rng_reused_sees_dropout_draws_inside_a_scan_body():
    findings = check_step(_dropout_rnn_experiment(split_key=False))
    assert [f.code for f in findings] == ["step.rng_reused"]
    assert findings[0].file.endswith("test_interpret.py")
    assert findings[0].line == _line_of("jax.random.bernoulli(k, 0.8")
    assert check_step(_dropout_rnn_experiment(split_key=True)) == []


# ----------------------------------------------------------------------------- linen and NNX recurrent cells

class _LinenLSTM(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.RNN(nn.LSTMCell(H))(x)
        return nn.Dense(C)(nn.relu(nn.Dense(H)(h[:, -1])))


def _linen_experiment():
    model = _LinenLSTM()
    return _pure_experiment(lambda k: model.init(k, BATCH["x"])["params"],
                            lambda p, x: model.apply({"params": p}, x))


class _NNXLSTM(nnx.Module):
    def __init__(self, rngs):
        self.rnn = nnx.RNN(nnx.LSTMCell(F, H, rngs=rngs))
        self.hidden = nnx.Linear(H, H, rngs=rngs)
        self.out = nnx.Linear(H, C, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(self.rnn(x)[:, -1])))


def _nnx_experiment():
    def init(key):
        model = _NNXLSTM(nnx.Rngs(key))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        value, grads = nnx.value_and_grad(lambda m: _ce(lambda mm, x: mm(x))(m, batch))(model)
        optimizer.update(model, grads)
        return value

    return jaxsane.Experiment(init=init, step=step, train=[BATCH], loss=lambda m, b: _ce(lambda mm, x: mm(x))(m, b),
                              apply=lambda m, x: m(x), num_classes=C)


@pytest.mark.slow
@pytest.mark.parametrize("make", [_linen_experiment, _nnx_experiment], ids=["linen", "nnx"])
def test_lstm_cells_through_monitor_and_activation_stats(make):
    exp = make()
    tel = _telemetry(exp)
    assert np.all(np.isfinite(tel["grad_norm"])) and np.all(np.isfinite(tel["update_norm"]))
    assert tel["dead_fraction"].shape == (1,) and 0.0 <= tel["dead_fraction"][0] < 1.0
    adapted = PureExperiment(exp)
    state = adapted.init(jax.random.key(0))
    layers = activation_stats(adapted.apply_fn, adapted.params(state), BATCH["x"])
    recurrent = [l for l in layers if l.shape == (B, H) and l.name.endswith("['hi']")]
    assert len(recurrent) == 1, [(l.name, l.shape) for l in layers]   # an LSTM gate, inside the scan body
    assert all(np.isfinite([l.pre_rms, l.act_std, l.symmetry]).all() for l in layers)
    assert "init.symmetric" not in [f.code for f in check_init(adapted.apply_fn, adapted.params(state), BATCH["x"])]
