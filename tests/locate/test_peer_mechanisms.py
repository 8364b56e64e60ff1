"""jaxsane.locate on the program classes of jax's own debug_nans/checkify tests (issue 29, section 1): a
non-finite constant returned as is, shard_map bodies, custom_vjp backward rules passed straight to
jax.grad, vmap of a while_loop, a forward NaN that only the gradient reads, Python-float and inf inputs.
Each mechanism: a faulty program it must name line-exact, and a correct one it must leave alone."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxsane
from jaxsane._core.codes import CODES
from jaxsane._locate.locate import locate

from _tagged import tag_finder

HERE, line_of = tag_finder(__file__)


def first(fn, *args):
    report = locate(fn, *args)
    assert report is not None and report.origins, "expected a non-finite origin"
    return report, report.origins[0]


def assert_at(o, tag: str, code: str, phase: str):
    assert o.file is not None and os.path.abspath(o.file) == HERE, o.summary()
    assert (o.line, o.code, o.phase) == (line_of(tag), code, phase), o.summary()


# ----------------------------------------------------------------------------- A: constants returned as is


@pytest.mark.parametrize("jit", [False, True])
def test_cond_branch_returning_nan_is_a_literal_at_the_branch(jit):
    def f(x):
        return lax.cond(x == 1, lambda _: np.nan, lambda _: 2.0, operand=None)  # <cond_nan>

    g = jax.jit(f) if jit else f
    report, o = first(g, 1)
    assert_at(o, "cond_nan", "nonfinite.literal", "forward")
    assert o.primitive == "literal" and "NaN constant" in o.values and "branch 1" in o.where
    assert not report.xla_only and "not reproduced outside XLA" not in str(report)
    assert locate(g, 2) is None  # the other branch: finite


def test_jitted_function_returning_nan_is_a_literal_at_its_return():
    @jax.jit
    def f(x):
        y = x + 2
        return jnp.nan, y  # <return_nan>

    report, o = first(f, 3)
    assert_at(o, "return_nan", "nonfinite.literal", "forward")
    assert "not reproduced outside XLA" not in report.summary() + str(report)
    assert o.to_finding().code == "nonfinite.literal" and "nonfinite.literal" in CODES


@pytest.mark.parametrize("python_float", [False, True])
def test_custom_vjp_bwd_returning_nan_constant_is_a_backward_literal(python_float):
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    def f_bwd(_, g):
        return (float("nan"),) if python_float else (jnp.full_like(g, jnp.nan),)  # <bwd_nan>

    f.defvjp(lambda x: (jnp.sin(x), None), f_bwd)
    _, o = first(jax.grad(f), 1.0 if python_float else jnp.array(1.0))
    assert_at(o, "bwd_nan", "nonfinite.literal", "backward")


def test_inf_constant_consumed_by_a_mask_keeps_the_operation():
    def attend(s, m):  # every position masked: the -inf written here makes NaN in softmax
        return jax.nn.softmax(jnp.where(m, s, -jnp.inf), axis=-1)  # <mask_const>

    _, o = first(attend, jnp.ones((2, 2)), jnp.array([[True, False], [False, False]]))
    assert_at(o, "mask_const", "nonfinite.forward", "forward")


@pytest.mark.parametrize("op", ["mul", "switch"])
def test_inf_constant_in_arithmetic_is_a_literal_at_its_line(op):
    def f(i, x):
        if op == "mul":
            return (x + 2.0) * jnp.inf  # <inf_mul>
        return lax.switch(i, [lambda v: v * 2.0, lambda v: v + jnp.inf], x)  # <inf_switch>

    _, o = first(jax.jit(f), jnp.array(1), jnp.array(3.0))
    assert_at(o, "inf_mul" if op == "mul" else "inf_switch", "nonfinite.literal", "forward")
    assert "constant written in the program" in o.cause


def test_inf_constant_filling_a_mask_that_reaches_the_output_stays_forward():
    def pooled(x, m):
        return jnp.where(m, x, -jnp.inf).max(-1)  # <mask_fill>

    _, o = first(pooled, jnp.ones((2, 3)), jnp.array([[True, False, False], [False, False, False]]))
    assert_at(o, "mask_fill", "nonfinite.forward", "forward")
    assert locate(pooled, jnp.ones((2, 3)), jnp.array([[True, False, False], [False, True, False]])) is None


@pytest.mark.parametrize("call", ["jit", "pmap"])
def test_inf_constant_passed_to_the_users_function_is_a_literal_at_the_call(call):
    def g(x):
        def f(y):
            return jnp.sin(x * y)  # <callee_sin>

        if call == "jit":
            return jax.jit(f)(jnp.inf)  # <call_jit>
        return jax.pmap(f)(jnp.array([jnp.inf]))  # <call_pmap>

    report, o = first(g, jnp.array(2.0))
    assert_at(o, f"call_{call}", "nonfinite.literal", "forward")
    assert "sin(inf) -> nan" in o.then and f":{line_of('callee_sin')}" in o.then, o.then
    assert locate(lambda x: jax.jit(jnp.minimum)(x, jnp.inf), jnp.array(2.0)) is None  # a finite use of inf


# ----------------------------------------------------------------------------- B: shard_map bodies


@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_body_with_a_literal_operand_is_entered(check_vma):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))

    def body(x):
        return 0.0 / x  # <shard_body>

    f = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=check_vma)
    _, o = first(f, jnp.array([1.0, 0.0]))
    assert_at(o, "shard_body", "nonfinite.forward", "forward")
    assert any("shard 1 of 2" in w for w in o.where), o.where
    assert locate(f, jnp.array([1.0, 2.0])) is None


def test_shard_map_body_using_axis_index_is_entered():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("d",))

    def body(x):
        i = lax.axis_index("d")
        return x / i.astype(x.dtype)  # <axis_index>

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False))
    _, o = first(f, jnp.ones(4))
    assert_at(o, "axis_index", "nonfinite.forward", "forward")
    assert locate(f, jnp.zeros(4)) is not None  # 0/0 on shard 0 too


# ----------------------------------------------------------------------------- C: custom_vjp bwd via jax.grad


def test_custom_vjp_passed_straight_to_grad_keeps_the_bwd_line():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    def f_bwd(x, g):
        return (g / (x - x),)  # <bwd_div>

    f.defvjp(lambda x: (jnp.sin(x), x), f_bwd)
    _, o = first(jax.jit(jax.grad(f)), jnp.array(1.0))
    assert_at(o, "bwd_div", "nonfinite.backward", "backward")


def test_correct_custom_vjp_passed_to_grad_is_silent():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    f.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (g * c,))
    assert locate(jax.grad(f), 1.0) is None


# ----------------------------------------------------------------------------- D: vmap of a while_loop


def _counter(n, v):
    def body(s):
        counter, value = s
        return counter / value, value - 1.0  # <vmap_while>

    return lax.while_loop(lambda s: s[0] > 0, body, (n, v))


def test_vmap_of_while_with_a_batched_predicate_enters_the_body():
    f = jax.jit(jax.vmap(lambda n, v: _counter(n, v)[0]))
    _, o = first(f, jnp.asarray([1.0, 2.0, 3.0]), jnp.asarray([5.0, 2.0, 4.0]))
    assert_at(o, "vmap_while", "nonfinite.forward", "forward")


def test_vmap_of_while_whose_finished_lanes_hold_the_inf_is_silent():
    f = jax.vmap(lambda n, v: _counter(n, v)[1])  # the value output stays finite in every lane
    assert locate(f, jnp.asarray([1.0, 2.0, 3.0]), jnp.asarray([5.0, 2.0, 4.0])) is None


# ----------------------------------------------------------------------------- E: read only by the gradient


def test_forward_nan_read_only_by_the_gradient_stays_forward():
    def body(carry, x):
        carry = carry - 1.0
        return carry, x + jnp.sin(1.0 / carry)  # <grad_only>

    loss = lambda c, xs: jnp.sum(lax.scan(body, c, xs)[1])  # noqa: E731
    _, o = first(jax.jit(jax.grad(loss)), jnp.array(2.0), jnp.ones(3))
    assert_at(o, "grad_only", "nonfinite.forward", "forward")
    assert locate(jax.jit(jax.grad(loss)), jnp.array(5.5), jnp.ones(3)) is None


def test_custom_vjp_residual_read_only_by_the_bwd_is_backward():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    def f_fwd(x):
        return jnp.sin(x), jnp.log(x)  # <residual>

    f.defvjp(f_fwd, lambda r, g: (r * g,))
    _, o = first(jax.jit(jax.grad(f)), jnp.array(0.0))
    assert_at(o, "residual", "nonfinite.backward", "backward")


def test_derivative_coefficient_is_still_backward():
    _, o = first(jax.grad(lambda x: jnp.sqrt(x)), 0.0)  # <sqrt_coeff>
    assert_at(o, "sqrt_coeff", "nonfinite.backward", "backward")


# ----------------------------------------------------------------------------- F and G: inputs


@pytest.mark.parametrize("value", [np.nan, float("inf")])
def test_python_float_nan_or_inf_argument_is_an_input(value):
    report, o = first(jax.jit(lambda x: x * 3.0), value)
    assert o.code == "nonfinite.input" and o.phase == "input", o.summary()


def test_python_float_used_in_python_control_flow_is_still_static():
    def f(x, scale):
        if scale > 1.0:  # Python control flow on the float: it cannot be traced
            return jnp.log(x) * scale  # <static_float>
        return x

    _, o = first(f, jnp.zeros(2), 2.0)
    assert_at(o, "static_float", "nonfinite.forward", "forward")


@pytest.mark.parametrize("kind", ["sin", "cond", "scan"])
def test_inf_input_made_nan_by_its_first_operation_is_the_input(kind):
    def f(x):
        if kind == "sin":
            return jnp.sin(x)  # <first_op>
        if kind == "cond":
            return lax.cond(True, jnp.sin, jnp.cos, x)
        return lax.scan(lambda c, v: (c, jnp.sin(v)), 0.0, x)[1]

    report, o = first(jax.jit(f), jnp.array([0.0, jnp.inf]))
    assert o.code == "nonfinite.input" and "sin(inf) -> nan" in o.then, (o.summary(), o.then)
    if kind == "sin":
        assert f"test_peer_mechanisms.py:{line_of('first_op')}" in o.then
    assert "then: sin(inf)" in str(report)


def test_inf_bias_argument_masked_correctly_is_silent():
    def attend(s, bias):
        return jax.nn.softmax(s + bias, axis=-1)

    bias = jnp.array([[0.0, -jnp.inf], [0.0, 0.0]])  # one masked position per row at most: finite softmax
    assert locate(attend, jnp.ones((2, 2)), bias) is None
    assert jaxsane.guard(attend, sync=True, locate=False)(jnp.ones((2, 2)), bias) is not None


def test_inf_made_inside_the_program_stays_the_operation():
    def f(x):
        big = jnp.exp(x)  # <exp_overflow>
        return jnp.sin(big)

    _, o = first(f, jnp.array([1.0, 100.0]))
    assert_at(o, "exp_overflow", "nonfinite.forward", "forward")


def test_a_body_that_cannot_be_replayed_is_said_so(monkeypatch):
    from jaxsane._locate import replay as replay_mod

    def refuse(self, node):
        raise RuntimeError("no replay for this body")

    monkeypatch.setattr(replay_mod.Replay, "_expand_shard_map", refuse)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    f = jax.shard_map(lambda x: jnp.log(x), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    _, o = first(f, jnp.array([1.0, 0.0]))
    assert o.primitive == "shard_map" and "body could not be replayed (RuntimeError: no replay" in o.values
