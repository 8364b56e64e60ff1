"""TracedOnce: the user's loss/apply traced once per input signature, its jaxpr replayed everywhere else."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsane._jaxpr.trace_cache import TracedOnce


def _counted(fn):
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)
    counted.__name__ = fn.__name__
    return counted, calls


def loss(params, batch):
    return jnp.mean(jnp.tanh(batch["x"] @ params["w"]) ** 2)  # the line the jaxpr's equations point at


PARAMS = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)}
BATCH = {"x": jnp.arange(8.0).reshape(2, 4) / 8}


def test_one_trace_per_signature_and_the_same_values_under_every_transform():
    fn, calls = _counted(loss)
    traced = TracedOnce(fn)
    assert float(traced(PARAMS, BATCH)) == float(loss(PARAMS, BATCH))  # eager: the function itself
    assert len(calls) == 1
    grads = jax.jit(jax.grad(traced))(PARAMS, BATCH)
    np.testing.assert_array_equal(grads["w"], jax.jit(jax.grad(loss))(PARAMS, BATCH)["w"])
    per_example = jax.vmap(traced, (None, 0))(PARAMS, {"x": BATCH["x"][:, None]})
    np.testing.assert_array_equal(per_example, jax.vmap(loss, (None, 0))(PARAMS, {"x": BATCH["x"][:, None]}))
    assert len(calls) == 3, "one trace for jit(grad), one for the vmapped [1,4] per-example batch"
    np.testing.assert_array_equal(jax.jit(traced)(PARAMS, BATCH), jax.jit(lambda p, b: traced(p, b))(PARAMS, BATCH))
    np.testing.assert_array_equal(jax.jit(lambda p, b: traced(params=p, batch=b))(PARAMS, BATCH),
                                  jax.jit(loss)(PARAMS, BATCH))
    assert len(calls) == 4, "jit and a lambda around it share the trace; keyword arguments are another signature"
    jax.jit(traced)(PARAMS, {"x": jnp.ones((5, 4))})
    assert len(calls) == 5, "a new batch shape is a new signature"


def test_the_replayed_program_is_the_directly_traced_one():
    direct = jax.jit(jax.value_and_grad(loss)).lower(PARAMS, BATCH).as_text()
    replayed = jax.jit(jax.value_and_grad(TracedOnce(loss))).lower(PARAMS, BATCH).as_text()
    assert replayed == direct
    eqns = jax.make_jaxpr(TracedOnce(loss))(PARAMS, BATCH).jaxpr.eqns
    tanh = next(e for e in eqns if e.primitive.name == "tanh")
    frames = [f for f in tanh.source_info.traceback.frames if f.file_name == __file__]
    assert frames and frames[0].function_name == "loss", "equations keep the user's source line"


def test_a_function_that_cannot_be_traced_runs_itself():
    def branchy(params, batch):
        if float(batch["x"].sum()) > 0:  # a Python branch on a value: fine eagerly, not under a trace
            return params["w"].sum()
        return jnp.zeros(())
    fn, calls = _counted(branchy)
    traced = TracedOnce(fn)
    assert float(traced(PARAMS, BATCH)) == float(PARAMS["w"].sum())
    for _ in range(2):
        n = len(calls)
        with pytest.raises(jax.errors.ConcretizationTypeError):  # the user's own error, raised by their code
            jax.vmap(traced, (None, 0))(PARAMS, {"x": BATCH["x"][:, None]})
        assert len(calls) == n + (2 if _ == 0 else 1), "an untraceable signature is remembered, then called directly"
    strings = TracedOnce(lambda params, tag: params["w"].sum() * len(tag))
    assert float(jax.jit(lambda p: strings(p, "abc"))(PARAMS)) == pytest.approx(3 * float(PARAMS["w"].sum()))


def test_x64_is_part_of_the_signature():
    fn, calls = _counted(lambda x: jnp.arange(3) + x)
    traced = TracedOnce(fn)
    assert traced(1).dtype == jnp.int32
    with jax.enable_x64(True):
        assert traced(1).dtype == jnp.int64
    assert len(calls) == 2
