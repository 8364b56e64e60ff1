"""Latent NaNs: a gradient non-finite when replayed equation by equation (as eager mode computes it) while
the compiled program's is finite -> ``nonfinite.latent`` warnings with the line and the double-where fix;
nothing for the double-where-fixed program, for masked NaNs of a forward ``where``, or when the compiled
gradient is non-finite too (a real failure)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxsane._core.codes import severity_of
from jaxsane._locate import locate as locate_mod
from jaxsane._locate.locate import latent_nan_findings, locate, locate_failure

from _tagged import tag_finder

HERE, line_of = tag_finder(__file__)


def trap_loss(w, h):
    z = h * w
    return jnp.sum(jnp.where(z > 0, jnp.log(z), 0.0))  # <trap>


def fixed_loss(w, h):
    z = h * w
    safe = jnp.where(z > 0, z, 1.0)  # the double where: the untaken branch sees a harmless 1.0
    return jnp.sum(jnp.where(z > 0, jnp.log(safe), 0.0))


def masked_forward_loss(w, h):  # NaN/Inf in the untaken branch of FORWARD wheres only, a finite backward
    z = jnp.where(h > 0, h * w, 0.0)
    r = jnp.where(h > 0, jnp.log(jnp.where(h > 0, h, 1.0)) * w, jnp.log(h))  # log(0) = -inf, masked
    return jnp.sum(z + r)


W, H = jnp.ones(3), jnp.array([1.0, 0.0, 2.0])


@pytest.fixture
def finite_compiler(monkeypatch):
    """A compiler whose fusion turns the trap's 0 * inf into 0 (as some backends' rewrites do): the compiled
    gradient is finite where the equation-by-equation one is NaN."""
    real = locate_mod._run_compiled

    def fused(closed, args):
        return [np.nan_to_num(np.asarray(o), nan=0.0, posinf=0.0, neginf=0.0) for o in real(closed, args)]

    monkeypatch.setattr(locate_mod, "_run_compiled", fused)


def test_the_where_trap_whose_compiled_gradient_is_finite_is_a_latent_warning_with_line_and_fix(finite_compiler):
    report = locate(jax.grad(trap_loss), W, H)
    assert report is not None and report.latent and not report.xla_only
    o = report.origins[0]
    assert o.code == "nonfinite.latent" and o.phase == "backward", o.summary()
    assert os.path.abspath(o.file) == HERE and o.line == line_of("trap"), o.summary()
    assert "double where" in o.fix and "jnp.where(cond, x, 1.0)" in o.fix
    assert "latent" in o.cause and "eager" in o.cause and "double-where trap" in o.cause
    assert str(report).startswith("[jaxsane] locate: latent non-finite outputs")
    (f,) = latent_nan_findings(jax.grad(trap_loss), W, H)
    assert f.code == "nonfinite.latent" and severity_of(f.code) == "warning"
    assert f.line == line_of("trap") and "double where" in f.hint


def test_a_latent_nan_in_a_train_step_names_the_line(finite_compiler):
    tx = optax.adam(1e-2)

    @jax.jit
    def step(w, opt_state, h):
        loss, grads = jax.value_and_grad(trap_loss)(w, h)
        updates, opt_state = tx.update(grads, opt_state, w)
        return optax.apply_updates(w, updates), opt_state, loss

    report = locate(step, W, tx.init(W), H)
    assert report is not None and report.latent, report
    assert report.origins[0].code == "nonfinite.latent" and report.origins[0].line == line_of("trap")


def test_the_double_where_fix_and_masked_forward_nans_give_nothing(finite_compiler):
    for loss in (fixed_loss, masked_forward_loss):
        assert locate(jax.grad(loss), W, H) is None, loss.__name__
        assert latent_nan_findings(jax.grad(loss), W, H) == [], loss.__name__
        assert np.isfinite(np.asarray(jax.grad(loss)(W, H))).all()  # finite compiled, as in the replay


def test_a_compiled_gradient_that_is_nan_too_is_a_real_backward_origin_not_latent():
    report = locate(jax.grad(trap_loss), W, H)  # XLA:CPU computes the NaN too
    assert report is not None and not report.latent and report.origins[0].code == "nonfinite.backward"
    assert latent_nan_findings(jax.grad(trap_loss), W, H) == []


def test_a_forward_nan_is_never_latent(finite_compiler):
    report = locate(lambda w, h: jnp.sum(jnp.log(h * w)), W, H)
    assert report is not None and not report.latent and report.origins[0].code == "nonfinite.forward"


def test_a_known_compiled_failure_is_located_without_compiling_again(monkeypatch):
    def refuse(closed, args):
        raise AssertionError("locate_failure compiled the program")

    monkeypatch.setattr(locate_mod, "_run_compiled", refuse)
    report = locate_failure(jax.grad(trap_loss), W, H)
    assert report is not None and not report.latent and report.origins[0].code == "nonfinite.backward"


def test_a_program_the_replay_cannot_trace_is_not_judged_and_does_not_crash():
    assert latent_nan_findings(lambda w: w.undefined_attribute, W) == []


def test_doctor_grads_stage_warns_of_a_latent_nan_the_compiled_gradients_do_not_show(finite_compiler, monkeypatch):
    """The wiring: when check_grads' compiled gradients are finite (simulated here, with the compiler that fuses
    the NaN away), the grads stage replays the gradient and warns, with the user's line."""
    import jaxsane
    from jaxsane._doctor import grads_stage as pipeline
    from jaxsane.examples import where_nan

    monkeypatch.setattr(pipeline, "check_grads", lambda *a, **k: [])
    diagnosis = jaxsane.doctor(where_nan.experiment(), stages=["grads"], progress=False)
    latent = [f for f in diagnosis.findings if f.code == "nonfinite.latent"]
    assert len(latent) == 1 and latent[0].severity == "warning", diagnosis.findings
    with open(where_nan.__file__) as fh:
        bug = next(i + 1 for i, text in enumerate(fh) if "jnp.sqrt(energy)" in text)
    assert latent[0].file == where_nan.__file__ and latent[0].line == bug and "double where" in latent[0].hint


def test_doctor_grads_stage_is_silent_on_a_healthy_model(finite_compiler):
    import jaxsane
    from jaxsane.examples import digits_optax

    diagnosis = jaxsane.doctor(digits_optax.experiment(), stages=["grads"], progress=False)
    assert not [f for f in diagnosis.findings if f.code.startswith("nonfinite.")], diagnosis.findings
