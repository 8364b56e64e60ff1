"""compare_precision: each classic low-precision failure is named at its line with its fix, and the corrected
program (or a correct bf16 program) gives no finding."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsane
from jaxsane._precision.compare import precision_table

RNG = np.random.default_rng(0)


def line_of(fn, marker):
    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, s in enumerate(src) if marker in s)


def codes(findings):
    return [f.code for f in findings]


def bf16_mean_of_constant_rows(x):
    return jnp.mean(x, axis=-1, dtype=x.dtype)  # MARK


def f32_mean(x):
    return jnp.mean(x.astype(jnp.float32), axis=-1).astype(x.dtype)


def test_long_sum_accumulated_in_bf16():
    x = jnp.full((4, 8192), 0.1, jnp.float32)
    found = jaxsane.compare_precision(bf16_mean_of_constant_rows, x, dtype=jnp.bfloat16)
    assert codes(found) == ["precision.lost"]
    f = found[0]
    assert f.line == line_of(bf16_mean_of_constant_rows, "MARK") and f.extra["prim"] == "reduce_sum"
    assert "accumulated in bfloat16" in f.message and "forward" in f.message and "float32" in f.hint
    assert jaxsane.compare_precision(f32_mean, x, dtype=jnp.bfloat16) == []


def one_minus_sigmoid(z):
    p = jax.nn.sigmoid(z)
    return jnp.log(1 - p)  # MARK


def log1p_by_hand(s):
    return jnp.log(1 + s)  # MARK


def test_cancellations_are_named_with_their_fix():
    z = jnp.linspace(4.0, 9.0, 64)
    (f,) = jaxsane.compare_precision(one_minus_sigmoid, z, dtype=jnp.bfloat16)
    assert f.line == line_of(one_minus_sigmoid, "MARK") and f.message.startswith("1 - p cancellation")
    assert "sigmoid(-z)" in f.hint
    assert jaxsane.compare_precision(lambda z: jax.nn.log_sigmoid(-z), z, dtype=jnp.bfloat16) == []
    s = jnp.linspace(1e-4, 1e-3, 64)
    (g,) = jaxsane.compare_precision(log1p_by_hand, s, dtype=jnp.bfloat16)
    assert g.line == line_of(log1p_by_hand, "MARK") and "log1p" in g.hint
    assert jaxsane.compare_precision(jnp.log1p, s, dtype=jnp.bfloat16) == []


def fp16_activation(a):
    return jnp.exp(a)  # MARK


def test_fp16_overflow_names_a_loss_scale():
    a = jnp.linspace(1.0, 12.0, 64)
    found = jaxsane.compare_precision(fp16_activation, a, dtype=jnp.float16)
    assert codes(found) == ["precision.overflow"] and found[0].severity == "error"
    assert found[0].line == line_of(fp16_activation, "MARK") and "loss scale" in found[0].hint
    assert jaxsane.compare_precision(fp16_activation, a / 4, dtype=jnp.float16) == []


def bf16_variance(x):
    return jnp.mean(x * x, axis=-1) - jnp.mean(x, axis=-1) ** 2  # MARK


def test_variance_by_moments_in_bf16_and_backward_pass():
    x = jnp.asarray(10.0 + 0.1 * RNG.standard_normal((4, 512)), jnp.float32)
    found = jaxsane.compare_precision(bf16_variance, x, dtype=jnp.bfloat16)
    assert found and found[0].line == line_of(bf16_variance, "MARK") and found[0].extra["prim"] == "sub"
    assert jaxsane.compare_precision(lambda x: jnp.var(x.astype(jnp.float32), axis=-1), x, dtype=jnp.bfloat16) == []
    # the pass: equations of a transposed jvp are the backward pass
    rows = precision_table(jax.grad(lambda x: jnp.sum(jnp.tanh(x) * 3.0)), x.astype(jnp.bfloat16))
    assert {r.phase for r in rows} >= {"backward"}


def test_correct_bf16_programs_give_nothing():
    w = jnp.asarray(RNG.standard_normal((64, 32)) * 0.1, jnp.float32)
    x = jnp.asarray(RNG.standard_normal((16, 64)), jnp.float32)
    y = jnp.asarray(RNG.integers(0, 32, 16))

    def loss(w, x):
        logits = (x @ w).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    assert jaxsane.compare_precision(loss, w, x, dtype=jnp.bfloat16) == []
    assert jaxsane.compare_precision(jax.grad(loss), w, x, dtype=jnp.bfloat16) == []
    assert jaxsane.compare_precision(lambda x: jax.nn.gelu(x) * 2.0, x, dtype=jnp.bfloat16) == []
