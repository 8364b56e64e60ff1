"""chex and guard: a guarded chexified step's failed finite assertion is a jaxsane finding (origin, dump,
chex's error as the cause); healthy chexified steps run as they do unguarded."""

import os
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsane
from jaxsane import GuardConfigError, NonFiniteError


@jax.jit
def log_step(state, batch):
    new = state - 0.1 * jnp.log(batch)  # LOG_LINE
    chex.assert_tree_all_finite(new)
    return new, {"loss": jnp.sum(new)}


@jax.jit
def masked_step(state, batch):
    lg = jnp.log(batch)
    chex.assert_tree_all_finite(lg)  # the NaN is asserted on, then masked out of the outputs
    return state - 0.1 * jnp.where(batch > 0, lg, 0.0), {"loss": jnp.sum(state)}


@jax.jit
def equal_step(state, batch):
    chex.assert_trees_all_equal(batch, jnp.ones_like(batch))
    return state + batch, {"loss": jnp.sum(state)}


GOOD, BAD = jnp.ones(3), jnp.array([1.0, 0.0, 2.0])
LOG_LINE = next(i for i, line in enumerate(open(__file__), 1) if "# LOG_LINE" in line)


@pytest.fixture(autouse=True)
def _no_leftover_chex_checks():
    yield
    try:  # a failed async check left behind must not fail the next test, nor chex's atexit hook
        chex.block_until_chexify_assertions_complete()
    except AssertionError:
        pass


def _run(guarded, batches):
    state = jnp.ones(3)
    for b in batches:
        state, _ = guarded(state, b)
    guarded.flush()
    return state


def test_a_failed_chex_finite_assertion_is_a_jaxsane_finding_with_the_origin(tmp_path):
    guarded = jaxsane.guard(chex.chexify(log_step, async_check=False), dump_dir=str(tmp_path))
    with pytest.raises(NonFiniteError) as info:
        _run(guarded, [GOOD, GOOD, BAD, GOOD])
    err = info.value
    assert isinstance(err.__cause__, AssertionError) and "[Chex] chexify assertion 'assert_tree_all_finite'" in str(err.__cause__)
    assert err.finding.step == 2 and err.finding.line == LOG_LINE and "chex" in err.finding.extra
    assert err.located.origins[0].primitive == "log"
    assert "assert_tree_all_finite" in str(err) and os.path.isdir(err.dump_path)
    dump = jaxsane.load_dump(err.dump_path)
    assert np.array_equal(dump.args[1], np.asarray(BAD))
    # locate replays a step with chex value assertions inside (they are switched off for the replay)
    assert jaxsane.locate(log_step, *dump.args).origins[0].line == LOG_LINE
    assert jaxsane.locate(chex.chexify(log_step), *dump.args).origins[0].line == LOG_LINE


@pytest.mark.parametrize("async_check", [True, False])
def test_healthy_chexified_steps_run_as_unguarded(async_check):
    fn = chex.chexify(log_step, async_check=async_check)
    state = jnp.ones(3)
    for _ in range(4):
        state, _ = fn(state, GOOD)
    fn.wait_checks()
    guarded = jaxsane.guard(fn)
    assert np.array_equal(_run(guarded, [GOOD] * 4), state) and not guarded.failures


def test_an_async_chex_failure_is_reported_with_its_step_at_a_later_call_or_flush():
    guarded = jaxsane.guard(chex.chexify(log_step))
    with pytest.raises(NonFiniteError) as info:
        _run(guarded, [GOOD, BAD, GOOD, GOOD])
    err = info.value
    assert err.finding.step == 1 and err.located.origins[0].line == LOG_LINE
    assert isinstance(err.__cause__, AssertionError) and "assert_tree_all_finite" in str(err.__cause__)


def test_a_masked_nan_that_chex_asserts_on_is_reported_with_chex_message():
    guarded = jaxsane.guard(chex.chexify(masked_step, async_check=False))
    with pytest.raises(NonFiniteError, match="a chex assertion failed in the guarded step") as info:
        _run(guarded, [GOOD, BAD])
    assert "asserted value may be masked" in str(info.value) and isinstance(info.value.__cause__, AssertionError)
    assert _run(jaxsane.guard(chex.chexify(masked_step, async_check=False)), [GOOD, GOOD]) is not None


def test_other_chex_assertions_propagate_as_chex_raised_them():
    guarded = jaxsane.guard(chex.chexify(equal_step, async_check=False))
    _run(guarded, [GOOD])
    with pytest.raises(AssertionError, match="assert_trees_all_equal") as info:
        _run(guarded, [BAD])
    assert not isinstance(info.value, NonFiniteError)


def test_chexify_outside_guard_runs_guard_in_its_traced_mode():
    outer = chex.chexify(jaxsane.guard(log_step), async_check=False)
    _run_plain = lambda batches: [outer(jnp.ones(3), b) for b in batches]  # noqa: E731
    _run_plain([GOOD, GOOD])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises((NonFiniteError, AssertionError)):
            _run_plain([BAD])
            outer.wait_checks()


def test_skip_cannot_be_honoured_for_a_chexified_step():
    with pytest.raises(GuardConfigError, match="chexified step runs outside guard's compiled program"):
        jaxsane.guard(chex.chexify(log_step), on_nonfinite="skip")


def test_a_chex_value_assertion_in_a_jitted_step_without_chexify_fails_at_trace_time_guarded_or_not():
    @jax.jit
    def step(state, batch):
        chex.assert_tree_all_finite(batch)
        return state + batch, {"loss": jnp.sum(state)}

    with pytest.raises(Exception, match="chexify|checkify"):
        step(jnp.ones(3), GOOD)
    with pytest.raises(Exception, match="chexify|checkify"):
        jaxsane.guard(step)(jnp.ones(3), GOOD)
