"""guard checks every output leaf (Python floats and weak-typed scalars included) and names a failure for
what it is: outputs of a function are not an update of its argument, a returned NaN constant is
nonfinite.literal once located (issue 29, section 1)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxsane
from jaxsane._core.tree import can_be_nonfinite, finite_flags, grouped_finite_flags, host_finite_flags
from jaxsane._guard.flags import flag_chunks, grouped_flags


def _custom_vjp(bwd_value):
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    f.defvjp(lambda x: (jnp.sin(x), None), lambda _, g: (bwd_value,))
    return f


def test_python_float_leaves_are_flagged():
    leaves = [float("nan"), 1.0, jnp.ones(()), 3, complex(1, 0)]
    assert [can_be_nonfinite(x) for x in leaves] == [True, True, True, False, True]
    assert list(np.asarray(finite_flags(leaves))) == [False, True, True, True, True]
    assert list(host_finite_flags(leaves)) == [False, True, True, True, True]
    assert not bool(np.asarray(grouped_finite_flags(leaves)).all())
    chunks = flag_chunks(leaves)
    assert sorted(i for c in chunks for i in c) == [0, 1, 2, 4]  # float, float, f32[] (one result type), complex
    assert not bool(np.asarray(grouped_flags(leaves)).all())


def test_grad_of_custom_vjp_returning_python_nan_raises():
    guarded = jaxsane.guard(jax.grad(_custom_vjp(float("nan"))), sync=True, locate=False)
    with pytest.raises(jaxsane.NonFiniteError) as info:
        guarded(1.0)
    assert info.value.finding.code == "nonfinite.forward"  # grad's output, not an update of x


def test_grad_of_custom_vjp_returning_python_float_passes():
    guarded = jaxsane.guard(jax.grad(_custom_vjp(2.0)), sync=True, locate=False)
    assert float(guarded(1.0)) == 2.0
    assert guarded.failures == []


def test_jitted_function_returning_nan_is_not_an_update():
    @jax.jit
    def f(x):
        y = x + 2
        return jnp.nan, y

    with pytest.raises(jaxsane.NonFiniteError) as info:
        jaxsane.guard(f, sync=True, locate=False)(3)
    assert info.value.finding.code == "nonfinite.forward" and info.value.finding.path == "out[0]"
    with pytest.raises(jaxsane.NonFiniteError) as info:
        jaxsane.guard(f, sync=True)(3)
    assert info.value.finding.code == "nonfinite.literal"
    assert str(info.value).startswith("[jaxsane] nonfinite.literal at step 0")


def test_cond_returning_nan_literal_raises_and_untaken_branch_passes():
    f = jax.jit(lambda x: lax.cond(x == 1, lambda _: np.nan, lambda _: 2.0, operand=None))
    guarded = jaxsane.guard(f, sync=True, locate=False)
    assert float(guarded(2)) == 2.0
    with pytest.raises(jaxsane.NonFiniteError):
        guarded(1)


def test_a_state_of_several_leaves_is_still_an_update():
    def step(state, x):
        return {"w": state["w"] * x, "b": state["b"] / x}

    state = {"w": jnp.ones(2), "b": jnp.ones(2)}
    with pytest.raises(jaxsane.NonFiniteError) as info:
        jaxsane.guard(step, sync=True, locate=False)(state, jnp.float32(0.0))
    assert info.value.finding.code == "nonfinite.update" and info.value.finding.path == "state['b']"


def test_a_returned_nan_constant_is_a_nonfinite_fact_for_root_causes():
    from jaxsane._core.root_cause import is_nonfinite_fact

    assert is_nonfinite_fact(jaxsane.Finding("nonfinite.literal", "a NaN constant", "return a finite value"))
