"""jaxsane.locate: NaN/Inf provenance, causes and fixes, control flow, no false positives."""

import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxsane
from jaxsane._locate import locate as _locate, replay as _replay
from jaxsane._locate.locate import bisect_compiled, locate, replay_dump

from _tagged import tag_finder

HERE, line_of = tag_finder(__file__)  # line_of(tag): the line ending with ``# <tag>``


def origin(fn, *args, **kwargs):
    report = locate(fn, *args, **kwargs)
    assert report is not None and report.origins, "expected a non-finite origin"
    return report.origins[0]


def assert_at(o, tag: str, code: str):
    assert os.path.abspath(o.file) == HERE, o.summary()
    assert o.line == line_of(tag), o.summary()
    assert o.code == code, o.summary()


# ----------------------------------------------------------------------------- causes

def test_log_of_zero_forward():
    def f(p):
        return -jnp.log(p).sum()  # <log0>
    o = origin(f, jnp.array([0.5, 0.0]))
    assert_at(o, "log0", "nonfinite.forward")
    assert o.primitive == "log" and o.phase == "forward"
    assert "log(0.0) -> -inf" in o.values and "log of 0" in o.cause and "log_softmax" in o.fix


def test_out_of_range_label_in_a_gather_is_named_as_an_index_bug():
    def loss(logits, labels):
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=-1).mean()  # <ignidx>
    o = origin(loss, jnp.zeros((4, 3)), jnp.array([0, 1, -100, 2]))
    assert_at(o, "ignidx", "nonfinite.forward")
    assert "out-of-range index" in o.cause and "-100" in o.cause and "jnp.where(valid, labels, 0)" in o.fix
    in_range = jaxsane.locate(loss, jnp.zeros((4, 3)), jnp.array([0, 1, 2, 2]))
    assert in_range is None or not in_range.origins


def test_log_and_sqrt_and_pow_of_negative():
    def f(x):
        return jnp.log(x - 2.0)  # <logneg>
    o = origin(f, jnp.array([1.0, 3.0]))
    assert_at(o, "logneg", "nonfinite.forward")
    assert "negative" in o.cause and "log(-1.0) -> nan" in o.values

    def g(x):
        return jnp.sqrt(x)  # <sqrtneg>
    o = origin(g, jnp.array([4.0, -1.0]))
    assert_at(o, "sqrtneg", "nonfinite.forward")
    assert "sqrt of a negative" in o.cause and "index [1]" in o.values

    def h(x):
        return x ** 1.5  # <powneg>
    o = origin(h, jnp.array([-2.0]))
    assert_at(o, "powneg", "nonfinite.forward")
    assert o.primitive == "pow" and "fractional power" in o.cause


@pytest.mark.parametrize("fn_name, expect", [
    ("sqrt", "sqrt'(0.0) -> inf"), ("log", "log'(0.0) -> inf"), ("pow", "pow'(0.0, 0.5) -> inf"),
    ("arccos", "acos'(1.0) -> inf"), ("arctan2", "atan2'(0.0, 0.0) -> nan")])
def test_where_trap_backward_names_values_and_the_where(fn_name, expect):
    funcs = {"sqrt": lambda x: jnp.where(x > 0, jnp.sqrt(x), 0.0),  # <trap_sqrt>
             "log": lambda x: jnp.where(x > 0, jnp.log(x), 0.0),  # <trap_log>
             "pow": lambda x: jnp.where(x > 0, x ** 0.5, 0.0),  # <trap_pow>
             "arccos": lambda x: jnp.where(x < 1, jnp.arccos(x), 0.0),  # <trap_arccos>
             "arctan2": lambda x: jnp.where(x != 0, jnp.arctan2(x, x), 0.0)}  # <trap_arctan2>
    x = jnp.array([0.0, 0.5]) if fn_name != "arccos" else jnp.array([1.0, 0.5])
    loss = funcs[fn_name]
    assert np.isfinite(np.asarray(loss(x))).all()   # the forward value is fine
    o = origin(jax.grad(lambda x: jnp.sum(loss(x))), x)
    assert_at(o, f"trap_{fn_name}", "nonfinite.backward")
    assert o.phase == "backward"
    assert expect in o.values, o.values
    assert f"0 cotangent from the select_n (jnp.where) at test_locate.py:{line_of(f'trap_{fn_name}')}" in o.values
    assert "double where" in o.fix and "double-where trap" in o.cause


def test_division_zero_by_zero_and_x_by_zero():
    def ratio(a, b):
        return a / b  # <div>
    o = origin(ratio, jnp.array([0.0, 1.0]), jnp.array([0.0, 1.0]))
    assert_at(o, "div", "nonfinite.forward")
    assert "0/0" in o.cause and "div(0.0, 0.0) -> nan" in o.values
    o = origin(ratio, jnp.array([1.0, 1.0]), jnp.array([2.0, 0.0]))
    assert "x/0" in o.cause and "div(1.0, 0.0) -> inf at index [1]" in o.values


def test_masked_mean_over_all_padding_row():
    @jax.jit
    def pool(h, mask):
        return (h * mask[..., None]).sum(1) / mask.sum(1)[:, None]  # <masked_mean>
    report = locate(pool, jnp.ones((2, 3, 4)), jnp.array([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    o = report.origins[0]
    assert_at(o, "masked_mean", "nonfinite.forward")
    assert "all-padding row" in o.cause and "jnp.maximum(count, 1)" in o.fix
    assert report.bad_outputs[0][1] == 4   # row 1: 4 NaN


def test_inf_minus_inf():
    def f(x):
        hi = jnp.full_like(x, jnp.inf)
        return (x + hi) - hi  # <infinf>
    o = origin(f, jnp.ones(2))
    assert_at(o, "infinf", "nonfinite.forward")
    assert o.primitive == "sub" and "inf - inf" in o.cause


def test_exp_and_softplus_overflow():
    def f(x):
        return jnp.exp(x)  # <exp>
    o = origin(f, jnp.array([1.0, 100.0]))
    assert_at(o, "exp", "nonfinite.forward")
    assert "exp overflow" in o.cause and "exp(100.0) -> inf" in o.values

    def softplus(x):
        return jnp.log(1.0 + jnp.exp(x))  # <softplus>
    o = origin(softplus, jnp.array([1.0, 100.0]))
    assert_at(o, "softplus", "nonfinite.forward")
    assert "softplus overflow" in o.cause and "jax.nn.softplus" in o.fix


@pytest.mark.parametrize("dtype, value", [(jnp.float16, 300.0), (jnp.bfloat16, 3e19)])
def test_low_precision_overflow(dtype, value):
    def f(x):
        return x * x  # <f16>
    o = origin(f, jnp.full((3,), value, dtype))
    assert_at(o, "f16", "nonfinite.forward")
    assert f"{jnp.dtype(dtype).name} overflow" in o.cause and "float32" in o.fix


def test_norm_and_std_at_zero_backward():
    def dist(a, b):
        return jnp.linalg.norm(a - b)  # <norm>
    o = origin(jax.grad(dist), jnp.ones(3), jnp.ones(3))
    assert_at(o, "norm", "nonfinite.backward")
    assert "sqrt'(0.0) -> inf" in o.values and "norm or a standard deviation" in o.cause
    assert "eps" in o.fix

    def spread(x):
        return jnp.std(x)  # <std>
    o = origin(jax.grad(spread), jnp.full(4, 2.0))
    assert_at(o, "std", "nonfinite.backward")
    assert "standard deviation" in o.cause


def test_adam_eps_underflow_in_float16_is_update_phase():
    tx = optax.adam(1e-3)

    @jax.jit
    def step(state, x):
        params, opt_state = state
        grads = jax.grad(lambda p: jnp.sum(p["w"] * x))(params)
        updates, opt_state = tx.update(grads, opt_state, params)  # <adam16>
        return optax.apply_updates(params, updates), opt_state
    params = {"w": jnp.ones((3,), jnp.float16)}
    report = locate(step, (params, tx.init(params)), jnp.array([1.0, 0.0, 1.0], jnp.float16))
    o = report.origins[0]
    assert_at(o, "adam16", "nonfinite.update")
    assert "eps underflows in float16" in o.cause and "float32" in o.fix
    assert "state[0]['w']" in o.reaches


def test_neg_inf_mask_in_softmax_and_cross_entropy():
    def attend(s, m):
        return jax.nn.softmax(jnp.where(m, s, -jnp.inf), axis=-1)  # <softmax_mask>
    mask = jnp.array([[True, False], [False, False]])
    o = origin(attend, jnp.ones((2, 2)), mask)
    assert_at(o, "softmax_mask", "nonfinite.forward")
    assert "-inf mask" in o.cause and "finfo" in o.fix

    def xent(logits, y):
        masked = jnp.where(jnp.array([True, False, False]), logits, -jnp.inf)  # <xent_mask>
        return optax.softmax_cross_entropy_with_integer_labels(masked, y).mean()
    o = origin(xent, jnp.zeros(3), jnp.array(1))   # the label is a masked class: loss = inf
    assert_at(o, "xent_mask", "nonfinite.forward")
    assert "cross-entropy" in o.cause and "labels never point at masked positions" in o.fix
    assert locate(xent, jnp.zeros(3), jnp.array(0)) is None   # a valid label: finite


def test_nonfinite_input():
    def f(x):
        return x * 2.0
    report = locate(f, jnp.array([1.0, jnp.nan]))
    o = report.origins[0]
    assert o.code == "nonfinite.input" and o.primitive == "input" and "1 NaN" in o.values


# ----------------------------------------------------------------------------- no false positives

def test_masked_nans_with_finite_outputs_give_none():
    assert locate(lambda x, d: jnp.where(d != 0, x / d, 0.0), jnp.ones(3), jnp.array([1.0, 0.0, 2.0])) is None
    attend = lambda s, m: jax.nn.softmax(jnp.where(m, s, -jnp.inf), axis=-1)  # noqa: E731
    assert locate(attend, jnp.ones((2, 3)), jnp.array([[True, False, False], [True, True, False]])) is None

    def safe_sqrt(x):
        safe = jnp.where(x > 0, x, 1.0)
        return jnp.sum(jnp.where(x > 0, jnp.sqrt(safe), 0.0))
    assert locate(jax.jit(jax.grad(safe_sqrt)), jnp.array([0.0, 4.0])) is None

    def nan_masked_under_grad(x):
        y = jnp.log(x)
        return jnp.sum(jnp.where(jnp.isnan(y), 0.0, y))
    assert locate(jax.value_and_grad(nan_masked_under_grad), jnp.array([1.0, -1.0])) is None


def test_masked_nan_is_never_named_when_another_value_is_the_cause():
    def f(x, d):
        masked = jnp.where(d != 0, x / d, 0.0)   # NaN made and masked here: not the cause
        return masked + jnp.log(x)  # <real_cause>
    report = locate(f, jnp.array([1.0, 0.0]), jnp.array([1.0, 0.0]))
    assert len(report.origins) == 1
    assert_at(report.origins[0], "real_cause", "nonfinite.forward")
    assert report.origins[0].primitive == "log"


# ----------------------------------------------------------------------------- control flow

def test_inside_jit_custom_jvp_and_remat():
    @jax.jit
    def outer(x):
        return inner(x) * 2.0

    @jax.jit
    def inner(x):
        return jnp.log(x)  # <jit_inner>
    assert_at(origin(outer, jnp.array([0.0])), "jit_inner", "nonfinite.forward")

    @jax.custom_jvp
    def f(x):
        return jnp.sqrt(x)  # <cjvp>
    f.defjvp(lambda p, t: (jnp.sqrt(p[0]), t[0]))
    assert_at(origin(f, jnp.array([-1.0])), "cjvp", "nonfinite.forward")

    def g(x):
        return jnp.sum(jax.checkpoint(lambda y: jnp.sqrt(y))(x))  # <remat>
    o = origin(jax.grad(g), jnp.array([0.0, 1.0]))
    assert_at(o, "remat", "nonfinite.backward")
    assert "sqrt'(0.0) -> inf" in o.values


def test_custom_vjp_forward_and_backward_rules():
    @jax.custom_vjp
    def scaled(x):
        return jnp.log(x)  # <cvjp_primal>

    def fwd(x):
        return jnp.log(x), x

    def bwd(x, g):
        return (g / x,)  # <cvjp_bwd>
    scaled.defvjp(fwd, bwd)
    assert_at(origin(scaled, jnp.array([0.0])), "cvjp_primal", "nonfinite.forward")
    o = origin(jax.grad(lambda x: jnp.sum(scaled(x + 1.0) * 0.0 + x)), jnp.array([-1.0]))
    assert_at(o, "cvjp_bwd", "nonfinite.backward")


def test_scan_names_the_iteration():
    @jax.jit
    def f(xs):
        def body(c, x):
            c = c + jnp.log(x)  # <scan>
            return c, c
        return jax.lax.scan(body, 0.0, xs)
    o = origin(f, jnp.array([1.0, 2.0, 0.0, 3.0]))
    assert_at(o, "scan", "nonfinite.forward")
    assert "scan iteration 2" in o.where


def test_while_loop_and_cond_and_switch():
    def grow(x):
        return jax.lax.while_loop(lambda c: c[0] < 6, lambda c: (c[0] + 1, c[1] * 1e10), (0, x))[1]  # <while>
    o = origin(grow, jnp.float32(1.0))
    assert_at(o, "while", "nonfinite.forward")
    assert "while iteration 3" in o.where and "overflow" in o.cause

    def branchy(x):
        return jax.lax.cond(x[0] > 0, lambda y: y, lambda y: jnp.log(y), x)  # <cond>
    o = origin(branchy, jnp.array([-1.0, 0.0]))
    assert_at(o, "cond", "nonfinite.forward")
    assert "branch 0" in o.where   # the false branch is index 0 of cond's branches

    def switchy(i, x):
        return jax.lax.switch(i, [jnp.sin, lambda y: jnp.sqrt(y)], x)  # <switch>
    o = origin(switchy, 1, jnp.array([-1.0]))
    assert_at(o, "switch", "nonfinite.forward")
    assert "branch 1" in o.where


def test_shard_map_names_the_shard():
    mesh = jax.make_mesh((8,), ("d",))

    def local(a):
        return jax.lax.psum(jnp.log(a), "d")  # <shard>
    f = jax.shard_map(local, mesh=mesh, in_specs=P("d"), out_specs=P(), check_vma=False)
    x = jax.device_put(jnp.ones(16).at[11].set(0.0), NamedSharding(mesh, P("d")))
    o = origin(f, x)
    assert_at(o, "shard", "nonfinite.forward")
    assert any(w.startswith("shard 5 of 8") for w in o.where), o.where


def test_vmap_names_the_batch_index():
    def per_example(x):
        return jnp.sum(jnp.log(x))  # <vmap>
    o = origin(jax.vmap(per_example), jnp.array([[1.0, 2.0], [3.0, 4.0], [0.0, 1.0]]))
    assert_at(o, "vmap", "nonfinite.forward")
    assert "batch index 2" in o.where


# ----------------------------------------------------------------------------- NNX, linen, report API

class _Dist(nnx.Module):
    def __init__(self, rngs):
        self.l = nnx.Linear(3, 2, rngs=rngs)
        self.center = nnx.Param(jnp.zeros(3))

    def __call__(self, x):
        d = jnp.sqrt(jnp.sum((x - self.center) ** 2, -1, keepdims=True))  # <nnx>
        return self.l(x) * d


@nnx.jit
def _nnx_step(model, opt, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    opt.update(model, grads)
    return loss


def test_nnx_step_objects_are_split_and_left_untouched():
    model = _Dist(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    before = np.asarray(model.center[...]).copy()
    report = locate(_nnx_step, model, opt, jnp.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]))
    o = report.origins[0]
    assert_at(o, "nnx", "nonfinite.backward")
    assert any(p.startswith("model") and "center" in p for p in o.reaches), o.reaches
    np.testing.assert_array_equal(np.asarray(model.center[...]), before)


def test_linen_train_step_and_report_api():
    class Classifier(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jax.nn.softmax(nn.Dense(3)(x))
    model = Classifier()
    params = model.init(jax.random.key(0), jnp.ones((1, 4)))
    tx = optax.sgd(0.1)

    @jax.jit
    def step(state, x, y):
        params, opt_state = state

        def loss_fn(p):
            probs = model.apply(p, x)
            return -jnp.mean(jnp.log(probs[jnp.arange(2), y]))  # <linen>
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": loss}
    x = jnp.array([[1.0, 0.0, 0.0, 0.0], [300.0, -300.0, 300.0, -300.0]])
    report = locate(step, (params, tx.init(params)), x, jnp.array([0, 0]))
    o = report.origins[0]
    assert_at(o, "linen", "nonfinite.forward")
    assert "metrics['loss']" in o.reaches
    assert any(p.startswith("metrics") for p, _, _ in report.bad_outputs)
    text = str(report)
    assert text.startswith("[jaxsane] locate:") and "cause:" in text and "fix:" in text
    assert f"test_locate.py:{line_of('linen')}" in o.summary() and "\n" not in o.summary()
    findings = report.findings()
    assert findings[0].code == "nonfinite.forward" and findings[0].line == line_of("linen")
    assert os.path.abspath(findings[0].file) == HERE and findings[0].hint == o.fix


def test_finite_function_returns_none():
    assert locate(lambda x: jnp.tanh(x) * 2, jnp.ones(3)) is None
    assert locate(jax.jit(lambda x, n: x ** n), jnp.ones(3), 2) is None   # static int argument


def _rsqrt_warmup_step(state, x):
    """A schedule of optax.join_schedules' kind, as flax's lm1b writes it: the later piece is evaluated at a
    shifted count too, ``0 ** -0.5`` at step 0, and masked. Traced (as jit traces a Python int), that is an inf
    the select drops; in Python it raises ZeroDivisionError."""
    count = state["step"]
    warm = jnp.minimum(count / 4.0, 1.0)
    decayed = (count + 0) ** -0.5 * 2.0
    lr = jnp.where(count < 4, warm, decayed)
    w = state["w"] - lr * jnp.log(x)  # <int_step_log>
    return {"step": state["step"] + 1, "w": w}


def test_python_int_leaves_are_traced_as_jit_traces_them():
    state = {"step": 0, "w": jnp.ones(3)}  # a fresh TrainState's step is a Python 0 until a jitted step returns
    # the step as written, not jitted (a jitted one traces its arguments itself)
    assert locate(_rsqrt_warmup_step, state, jnp.ones(3)) is None
    report = locate(_rsqrt_warmup_step, state, jnp.array([1.0, 0.0, 2.0]))
    assert_at(report.origins[0], "int_step_log", "nonfinite.forward")
    # an int the function needs in Python (a shape) is held static, and a float beside it is still traced
    def tile(x, n, scale):
        return jnp.log(jnp.tile(x, n) * scale)  # <int_shape_log>

    assert_at(locate(tile, jnp.ones(2), 3, 0.0).origins[0], "int_shape_log", "nonfinite.forward")
    o = locate(tile, jnp.ones(2), 3, float("nan")).origins[0]
    assert o.code == "nonfinite.input" and "scale holds 1 NaN" in str(o.values), o.summary()


# ----------------------------------------------------------------------------- XLA-only NaNs

def _nan_after(primitive: str):
    """A simulated compiler that makes the first ``primitive`` equation's result NaN."""
    from jax._src import core as jcore

    def run(closed, args):
        vals = {}
        seen = False

        def evaluate(jaxpr, consts, args):
            nonlocal seen
            env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
            read = lambda a: a.val if isinstance(a, jcore.Literal) else env[a]  # noqa: E731
            for e in jaxpr.eqns:
                if e.primitive.name in ("pjit", "jit"):   # inline calls, like XLA does
                    inner = e.params["jaxpr"]
                    out = evaluate(inner.jaxpr, inner.consts, [read(a) for a in e.invars])
                else:
                    out = e.primitive.bind(*[read(a) for a in e.invars], **e.params)
                    out = list(out) if e.primitive.multiple_results else [out]
                if e.primitive.name == primitive and not seen:
                    seen = True
                    out = [o * jnp.nan for o in out]
                for v, o in zip(e.outvars, out):
                    env[v] = vals[v] = o
            return [read(a) for a in jaxpr.outvars]
        return evaluate(closed.jaxpr, closed.consts, args)
    return run


def test_xla_only_nan_is_reported_and_bisected(monkeypatch):
    def f(x):
        y = x * 2.0
        z = jnp.exp(y)  # <xla_exp>
        return z + 1.0
    monkeypatch.setattr(_locate, "_run_compiled", _nan_after("exp"))
    report = locate(f, jnp.ones(3))
    assert report is not None and report.xla_only and not report.origins
    assert report.prefix == 2 and report.prefix_total == 3
    assert f"exp at test_locate.py:{line_of('xla_exp')}" in report.prefix_at
    assert "not reproduced outside XLA" in str(report)
    assert report.findings()[0].extra["xla_only"]
    # a jitted function: its body is bisected, and a NaN the replay also masks is not counted
    g = jax.jit(lambda x: jnp.where(x > 0, jnp.log(x), 0.0) + f(x))
    report = locate(g, jnp.array([0.0, 1.0]))
    assert report.xla_only and f"exp at test_locate.py:{line_of('xla_exp')}" in report.prefix_at


def test_bisect_compiled_finds_the_smallest_prefix():
    def f(x):
        a = jnp.sin(x)
        b = a * 3.0
        c = jnp.tanh(b)
        d = jnp.cos(c)
        return d - a
    closed = jax.make_jaxpr(f)(jnp.ones(2))
    assert bisect_compiled(closed, [jnp.ones(2)], run=_nan_after("tanh"))[0] == 3
    assert bisect_compiled(closed, [jnp.ones(2)], run=_nan_after("cos"))[0] == 4
    assert bisect_compiled(closed, [jnp.ones(2)]) is None   # the real compiler: nothing to find


# ----------------------------------------------------------------------------- guard and replay

_STEP_SOURCE = '''
import jax, jax.numpy as jnp

@jax.jit
def step(state, batch):
    loss = jnp.mean(jnp.log(batch["x"] * state["w"]))  # <dumped>
    return {"w": state["w"] - 0.1 * loss}, {"loss": loss}
'''


@pytest.mark.subprocess
def test_guard_carries_the_located_origin(tmp_path):
    import importlib.util
    path = tmp_path / "user_step.py"
    path.write_text(_STEP_SOURCE)
    spec = importlib.util.spec_from_file_location("user_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    guarded = jaxsane.guard(module.step, dump_dir=str(tmp_path / "dumps"))
    state = {"w": jnp.ones(3)}
    with pytest.raises(jaxsane.NonFiniteError) as info:
        guarded(state, {"x": jnp.array([1.0, 0.0, 2.0])})
        guarded.flush()
    located = info.value.located
    assert located.origins[0].line == 6 and located.origins[0].file == str(path)
    assert info.value.finding.line == 6 and info.value.finding.code == "nonfinite.forward"
    dump = info.value.finding.extra["dump"]

    cli = [sys.executable, "-m", "jaxsane.cli", "replay"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    bad = subprocess.run(cli + [dump, "--step", f"{path}:step"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert bad.returncode == 1, bad.stderr
    assert "user_step.py:6" in bad.stdout and "log of 0" in bad.stdout
    from jaxsane import cli as jcli
    assert jcli.main(["replay", str(tmp_path / "missing"), "--step", f"{path}:step"]) == 2
    assert jcli.main(["replay", dump, "--step", f"{path}:nothing_here"]) == 2
    # a dump of finite inputs replays to exit 0
    jaxsane.save_dump(str(tmp_path / "ok"), (state, {"x": jnp.ones(3)}), {})
    assert jcli.main(["replay", str(tmp_path / "ok"), "--step", f"{path}:step"]) == 0


def _tiny_experiment():
    def loss(params, batch):
        return jnp.mean(jnp.where(batch["x"] > 0, jnp.sqrt(batch["x"] * params["w"]), 0.0))  # <exp_trap>

    tx = optax.sgd(0.1)

    def init(key):
        params = {"w": jnp.ones(3)}
        return params, tx.init(params)

    @jax.jit
    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}
    batch = {"x": jnp.array([[1.0, 0.0, 2.0]]), "y": jnp.array([0])}
    return jaxsane.Experiment(init=init, step=step, train=batch, loss=loss, name="tiny")


def test_replay_dump_with_an_experiment(tmp_path):
    from jaxsane._experiment.contract import PureExperiment
    exp = _tiny_experiment()
    state = PureExperiment(exp).init(jax.random.key(0))
    jaxsane.save_dump(str(tmp_path / "d"), (state, exp.train), {})
    report = replay_dump(str(tmp_path / "d"), exp)
    o = report.origins[0]
    assert_at(o, "exp_trap", "nonfinite.backward")
    assert "sqrt'(0.0) -> inf" in o.values
    assert replay_dump(str(tmp_path / "d"), lambda: exp).origins[0].line == line_of("exp_trap")


def test_bad_usage_raises_a_jaxsane_error():
    with pytest.raises(jaxsane.JaxsaneError, match=r"^\[jaxsane\] locate needs a callable"):
        locate("not a function", jnp.ones(2))
    with pytest.raises(jaxsane.JaxsaneError, match="could not trace"):
        locate(lambda x, y: x @ y, jnp.ones((2, 3)), jnp.ones((2, 3)))


def test_xla_only_nan_inside_a_compiled_loop(monkeypatch):
    real_bind = _replay._bind

    def fake_bind(eqn, values, mesh=None):   # the compiled scan returns NaN, its replayed body does not
        out = real_bind(eqn, values, mesh)
        return [o * jnp.nan for o in out] if eqn.primitive.name == "scan" else out

    def f(xs):
        return jax.lax.scan(lambda c, x: (c + jnp.sin(x), c), 0.0, xs)[0]  # <xla_scan>
    monkeypatch.setattr(_replay, "_bind", fake_bind)
    report = locate(f, jnp.ones(3))
    assert report.xla_only and not report.origins
    assert f"scan at test_locate.py:{line_of('xla_scan')}" in report.prefix_at


# ----------------------------------------------------------------------------- independent origins, fix texts, cells

def test_a_backward_nan_at_a_forward_origins_input_is_not_a_further_origin():
    def loss(w, x, y):
        p = jax.nn.softmax(x @ w)
        return -jnp.mean(jnp.log(p[jnp.arange(len(y)), y]))  # log(0) where softmax underflows

    def step(w, x, y):
        value, g = jax.value_and_grad(loss)(w, x, y)
        return w - 0.1 * g, value

    w = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)) * 100
    x = jnp.asarray(np.random.default_rng(1).normal(size=(8, 4)).astype(np.float32))
    report = jaxsane.locate(step, w, x, jnp.arange(8) % 3)
    assert [(o.primitive, o.phase) for o in report.origins] == [("log", "forward")]
    assert "further origin" not in str(report)


def test_independent_origins_are_still_all_reported():
    def f(x, z):
        a = jnp.log(x)            # forward origin at x = 0
        b = jnp.sqrt(z) * 0.0     # an unrelated forward origin: sqrt of a negative number
        return a.sum(), b.sum()

    report = jaxsane.locate(f, jnp.zeros(3), -jnp.ones(2))
    assert sorted(o.primitive for o in report.origins) == ["log", "sqrt"]


@pytest.mark.parametrize("prim", ["div", "sqrt", "log", "log1p", "pow", "integer_pow", "acos", "asin", "atan2",
                                  "rsqrt", "atanh", "logistic", "erf_inv", "lgamma"])
def test_double_where_fix_is_valid_python_that_runs(prim):
    import importlib
    import re

    from jaxsane._locate.nan_causes import _where_fix
    text = _where_fix(prim)
    code = re.search(r'\): (.*), so the untaken branch', text).group(1)
    importlib.import_module("jax.scipy.special")  # named by some fixes
    env = {"jax": jax, "jnp": jnp, "cond": jnp.array([True, False]), "x": jnp.array([0.5, 0.0]),
           "d": jnp.array([2.0, 0.0]), "p": -0.5, "y": jnp.array([0.3, 0.0])}
    for stmt in code.split("; "):
        exec(compile(stmt, "<fix>", "exec"), env)  # raises SyntaxError/NameError/TypeError if malformed
    out = env.get("r", env.get("y"))
    assert bool(jnp.all(jnp.isfinite(out)))


def test_the_derivative_fix_names_the_users_operator():
    def f(x):
        return jax.grad(lambda x: jnp.sum(jnp.where(x > 0, 1.0 / x, 0.0)))(x)  # 0 * inf in the backward pass

    report = jaxsane.locate(f, jnp.array([1.0, 0.0]))
    fix = report.origins[0].fix
    assert "jnp.divide(safe)" not in fix and "x / safe" in fix


def test_notebook_cells_are_named_by_their_execution_count(monkeypatch):
    import types

    from jaxsane._core.frames import cell_number, display_location
    assert display_location("/work/model.py", 41) == "model.py:41"
    assert display_location("<ipython-input-7-3f2a9c>", 6) == "<cell 7>, line 6"
    cell = "/tmp/ipykernel_31337/667549009.py"
    assert display_location(cell, 6) == "<cell>, line 6"  # no IPython session: the count is unknown
    shell = types.SimpleNamespace(compile=types.SimpleNamespace(_filename_map={cell: 3}))
    fake = types.SimpleNamespace(get_ipython=lambda: shell)
    monkeypatch.setitem(sys.modules, "IPython", fake)
    assert cell_number(cell) == 3 and display_location(cell, 6) == "<cell 3>, line 6"


def test_locate_in_an_ipython_cell_names_the_cell():
    shell_mod = pytest.importorskip("IPython.core.interactiveshell")
    shell = shell_mod.InteractiveShell.instance()
    try:
        shell.run_cell("import jax.numpy as jnp, jaxsane", store_history=True)
        result = shell.run_cell("def f(x):\n    return jnp.log(x) * 2\nreport = jaxsane.locate(f, jnp.zeros(2))",
                                store_history=True)
        assert result.success, result.error_in_exec
        origin = shell.user_ns["report"].origins[0]
        assert origin.location == f"<cell {result.execution_count}>, line 2", origin.location
    finally:
        shell_mod.InteractiveShell.clear_instance()


def test_a_replayed_gather_runs_as_a_quick_program_with_eager_values():
    """The replay binds gather (as scatter-add, split...) through one quick-compiled program per (primitive, params): the
    values are those of eager dispatch, and the NaN an embedding lookup passes on is still located."""
    table = jnp.array([[1.0, 2.0], [6.0, 3.0], [4.0, 5.0]])
    ids = jnp.array([0, 2, 2, 1])

    def loss(t):
        return jnp.sum(jnp.log(t[ids] - 1.0))  # <embedlog>

    closed = jax.make_jaxpr(jax.grad(loss))(table)
    eqns = {e.primitive.name: e for e in closed.jaxpr.eqns}
    gather, args = eqns["gather"], (table, ids[:, None])
    quick = _replay._bind(gather, list(args))
    np.testing.assert_array_equal(np.asarray(quick[0]), np.asarray(gather.primitive.bind(*args, **gather.params)))
    assert any(key[0].name == "gather" for key in _replay._QUICK_PROGRAMS)
    assert_at(origin(loss, table), "embedlog", "nonfinite.forward")   # log(1 - 1), after the gather
