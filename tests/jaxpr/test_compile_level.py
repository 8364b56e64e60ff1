"""The optimization level jaxsane compiles its own analysis programs at (jaxsane._jaxpr.compile_level)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsane._jaxpr.compile_level import QUICK, QUICK_GPU, compiler_options, program_cost, quick_jit


def _mlp_loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)


def test_program_cost_counts_scan_bodies_length_times_and_leaves_matrix_products_out():
    x = jnp.ones((8, 16))
    one = program_cost(jax.make_jaxpr(lambda x: jnp.tanh(x) + 1.0)(x)).work
    looped = program_cost(jax.make_jaxpr(
        lambda x: jax.lax.scan(lambda c, _: (jnp.tanh(c) + 1.0, None), x, None, length=10)[0])(x)).work
    assert one == 2 * 8 * 16 and looped == 10 * one
    dot = program_cost(jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((64, 32)), jnp.ones((32, 16))))
    assert dot.work == 0.0 and dot.flops == 2 * 64 * 32 * 16  # a library kernel at every level
    conv = program_cost(jax.make_jaxpr(lambda x, k: jax.lax.conv(x, k, (1, 1), "SAME"))(
        jnp.ones((2, 3, 8, 8)), jnp.ones((4, 3, 3, 3))))
    assert conv.work == 0.0 and conv.flops == 2 * (2 * 4 * 8 * 8) * (3 * 3 * 3)
    cond = jax.make_jaxpr(lambda p, x: jax.lax.cond(p, lambda x: jnp.tanh(jnp.exp(x)), lambda x: x * 2.0, x))
    equations, work, _ = program_cost(cond(True, x))
    assert 2 * 8 * 16 <= work < 2 * 8 * 16 + 8 and equations >= 4  # the costlier branch (+ the predicate), all equations


def test_a_short_program_compiles_quick_and_a_long_running_one_at_the_default_level():
    jaxpr = jax.make_jaxpr(jax.grad(_mlp_loss))(jnp.ones((32, 32)), jnp.ones((16, 32)))
    assert compiler_options(jaxpr, runs=1, backend="cpu") == QUICK
    assert compiler_options(jaxpr, runs=1e9, backend="cpu") is None
    assert compiler_options(jaxpr, runs=1, backend="tpu") is None  # XLA:TPU compiles at its defaults


def test_quick_jit_computes_what_jax_jit_does_and_traces_once():
    traces = []

    def loss(w, x):
        traces.append(1)
        return _mlp_loss(w, x)

    w, x = jax.random.normal(jax.random.key(0), (32, 32)), jax.random.normal(jax.random.key(1), (16, 32))
    quick = quick_jit(jax.value_and_grad(loss), runs=2)
    value, grad = quick(w, x)
    again = quick(w * 2, x)  # same shapes: the compiled program is reused
    assert len(traces) == 1
    ref_value, ref_grad = jax.jit(jax.value_and_grad(_mlp_loss))(w, x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(again[0], jax.jit(_mlp_loss)(w * 2, x), rtol=1e-5)
    assert quick.lower(w, x).compile() is not None


def test_quick_jit_under_an_outer_transform_is_a_plain_jit():
    quick = quick_jit(lambda x: jnp.sin(x) * 2.0)
    assert float(jax.grad(lambda x: quick(x))(0.0)) == pytest.approx(2.0)
    assert float(jax.jit(lambda x: quick(x) + 1.0)(0.0)) == pytest.approx(1.0)


def test_quick_jit_keeps_static_arguments():
    quick = quick_jit(lambda x, n: x * n, static_argnums=1)
    assert float(quick(jnp.float32(2.0), 3)) == 6.0 and float(quick(jnp.float32(2.0), 4)) == 8.0


def test_the_overfit_sweep_compiles_quick_for_a_short_budget_and_fully_for_a_long_one(monkeypatch):
    import optax

    import jaxsane
    import jaxsane._overfit.sweep_compile as sweep

    chosen = []

    def recording(jaxpr, runs, backend=None):
        options = compiler_options(jaxpr, runs, backend)
        chosen.append((runs, options))
        return options
    monkeypatch.setattr(sweep, "compiler_options", recording)
    tx = optax.sgd(0.1)
    x = jax.random.normal(jax.random.key(0), (16, 8))
    batch = {"x": x, "y": x @ jnp.arange(8.0)}

    def loss(params, batch):
        return jnp.mean((batch["x"] @ params - batch["y"]) ** 2)

    def step(state, batch):
        params, opt = state
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), {"loss": value}

    exp = jaxsane.Experiment(init=lambda key: (jnp.zeros(8), tx.init(jnp.zeros(8))), step=jax.jit(step),
                             train=batch, loss=loss, name="linear")
    for steps in (50, 10**7):
        jaxsane.overfit(exp, batch, seeds=1, steps=steps, chunk=25, progress=False, groups=1)
    (short_runs, short), (long_runs, long) = chosen
    assert (short_runs, long_runs) == (2, 10**7 // 25) and short == QUICK and long is None


@pytest.mark.parametrize("backend, name, expected", [("cpu", "QUICK", QUICK), ("gpu", "QUICK_GPU", QUICK_GPU)])
def test_an_xla_that_refuses_the_quick_option_compiles_at_its_defaults(monkeypatch, backend, name, expected):
    import jaxsane._jaxpr.compile_level as level

    jaxpr = jax.make_jaxpr(jnp.sin)(1.0)
    assert level._quick_compiles(backend) and compiler_options(jaxpr, 1, backend=backend) == expected
    monkeypatch.setattr(level, name, {"xla_no_such_option_anywhere": 0})
    level._quick_compiles.cache_clear()
    try:
        assert compiler_options(jaxpr, 1, backend=backend) is None
    finally:
        monkeypatch.undo()
        level._quick_compiles.cache_clear()


def test_on_a_gpu_every_analysis_program_compiles_without_autotuning():
    small = jax.make_jaxpr(jnp.sin)(1.0)
    big = jax.make_jaxpr(lambda a: jnp.tanh(a @ a).sum())(jnp.ones((512, 512)))
    # however long it runs: autotuning costs seconds per program, its gain over an analysis program's steps less
    assert compiler_options(small, 1, backend="gpu") == QUICK_GPU == compiler_options(big, 10**7, backend="gpu")
    assert compiler_options(big, 10**7, backend="cpu") is None  # the CPU's rule still weighs the run
    assert compiler_options(small, 1, backend="tpu") is None
