"""The replay's compiled screen (``_locate/screen.py``): one program that says whether the replay's outputs would be
finite, each equation held on its own behind a barrier. A latent trap still reaches the replay and its warning; a
finite gradient is judged without replaying it; the screen runs only where it costs less than the replay."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsane._locate import locate as locate_mod
from jaxsane._locate import screen
from jaxsane._locate.locate import latent_nan_findings
from jaxsane._jaxpr.interpret import all_eqns
from jaxsane._locate.replay import Replay

W, H = jnp.ones(3), jnp.array([1.0, 0.0, 2.0])


def where_log(w, h):
    z = h * w
    return jnp.sum(jnp.where(z > 0, jnp.log(z), 0.0))


def where_sqrt(w, h):  # d sqrt at 0 is inf, times the where's zero cotangent
    return jnp.sum(jnp.where(h > 0, jnp.sqrt(h * w), 0.0))


def where_inverse_in_a_jit(w, h):  # the trap inside a jitted helper: the screen opens calls as the replay does
    inner = jax.jit(lambda z: jnp.where(z != 0, 1.0 / z, 0.0))
    return jnp.sum(inner(h * w))


def double_where(w, h):
    z = h * w
    return jnp.sum(jnp.where(z > 0, jnp.log(jnp.where(z > 0, z, 1.0)), 0.0))


def masked_forward(w, h):  # -inf in an untaken forward branch only
    return jnp.sum(jnp.where(h > 0, h * w, jnp.log(h)))


def grad_jaxpr(loss):
    return jax.make_jaxpr(jax.grad(loss))(W, H)


@pytest.mark.parametrize("loss", [where_log, where_sqrt, where_inverse_in_a_jit])
def test_a_latent_trap_is_not_finite_on_the_screen(loss):
    assert not screen.finite_everywhere(grad_jaxpr(loss), [W, H])


@pytest.mark.parametrize("loss", [double_where, masked_forward])
def test_a_finite_gradient_is_finite_on_the_screen(loss):
    assert screen.finite_everywhere(grad_jaxpr(loss), [W, H])


def test_every_equation_is_held_behind_a_barrier():
    closed = grad_jaxpr(where_log)

    def program(xs):
        return screen._Screen().run(closed.jaxpr, closed.consts, xs)[0]

    walked = jax.make_jaxpr(program)([W, H])
    barriers = sum(e.primitive.name == "optimization_barrier" for e in walked.jaxpr.eqns)
    assert barriers == sum(1 for _ in all_eqns(closed.jaxpr)) > 5  # the call's own outputs and its body's


@pytest.fixture
def screened(monkeypatch):
    """The screen asked on every program, and a compiler whose fusion hides the trap's NaN (as in test_latent)."""
    monkeypatch.setattr(locate_mod, "screen_pays", lambda closed: True)
    real = locate_mod._run_compiled
    monkeypatch.setattr(
        locate_mod, "_run_compiled", lambda c, a: [np.nan_to_num(np.asarray(o), nan=0.0) for o in real(c, a)]
    )


def test_a_trap_the_screen_sees_still_gets_the_replays_latent_warning(screened):
    (f,) = latent_nan_findings(jax.grad(where_log), W, H)
    assert f.code == "nonfinite.latent" and "double where" in f.hint


def test_a_finite_gradient_is_judged_without_replaying_it(screened, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("replayed a gradient the screen found finite")

    monkeypatch.setattr(Replay, "replay", refuse)
    assert latent_nan_findings(jax.grad(double_where), W, H) == []


def conv_loss(params, x):
    for k in params:
        x = jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        x = jnp.tanh(x)
    return jnp.mean(x**2)


def test_the_screen_runs_where_the_replay_would_compile_many_shapes_and_not_where_it_runs_on_numpy():
    key = jax.random.key(0)
    widths = [3, 8, 16, 32, 64]
    convs = [jax.random.normal(key, (3, 3, a, b)) * 0.1 for a, b in zip(widths, widths[1:])]
    x = jnp.ones((1, 8, 8, 3))
    assert screen.screen_pays(jax.make_jaxpr(jax.grad(conv_loss))(convs, x))

    def mlp_loss(params, x):
        for w in params:
            x = jnp.tanh(x @ w)
        return jnp.mean(x**2)

    dense = [jnp.ones((a, b)) * 0.1 for a, b in zip(widths, widths[1:])]
    assert not screen.screen_pays(jax.make_jaxpr(jax.grad(mlp_loss))(dense, jnp.ones((2, 3))))
    # and on the conv model the latent check's answer is the replay's, with no replay run
    assert latent_nan_findings(jax.grad(conv_loss), convs, x) == []
