"""The step's signature is checked before its first call: a step jaxsane cannot call is an ExperimentError that
names the signature jaxsane calls it with, not Python's TypeError from inside a jaxsane frame."""

import functools
import inspect

import jax
import pytest
from _programs import batch, optax_init, optax_step

import jaxsane
from jaxsane import ExperimentError
from jaxsane._experiment.contract import PureExperiment


def _exp(step, init=optax_init):
    return jaxsane.Experiment(init=init, step=step, train=batch())


@pytest.mark.parametrize("step, needle", [
    (lambda s: s, "takes 1 positional argument (s), not 2"),
    (lambda: None, "takes 0 positional arguments (), not 2"),
    (lambda s, b, *, lr: s, "requires the keyword-only argument lr"),
    (lambda a, b, c, d: a, "requires 4 positional arguments (a, b, c, d), more than the 2"),
])
def test_a_step_of_the_wrong_signature_is_named_before_it_runs(step, needle):
    with pytest.raises(ExperimentError) as info:
        PureExperiment(_exp(step))
    message = str(info.value)
    assert message.startswith("[jaxsane] Experiment.step (<lambda>) cannot be called as step(state, batch)")
    assert needle in message and "def step(state, batch)" in message, message


def test_fit_names_the_signature_it_expects():
    with pytest.raises(ExperimentError, match=r"cannot be called as step\(state, batch\): it takes 1 positional"):
        jaxsane.fit(_exp(lambda s: s), steps=2, progress=False)


def test_a_spread_tuple_state_is_called_with_each_item():
    def step(params, opt_state, b, extra):  # a 2-tuple state spread: 3 arguments, not 4
        return params
    with pytest.raises(ExperimentError, match="requires 4 positional arguments"):
        PureExperiment(_exp(step))


def _spread(params, opt_state, b):
    (params, opt_state), metrics = optax_step((params, opt_state), b)
    return params, opt_state, metrics["loss"]


@pytest.mark.parametrize("step", [
    optax_step,
    jax.jit(optax_step),
    _spread,
    lambda *args: optax_step(*args),
    functools.partial(lambda s, b, scale: optax_step(s, b), scale=2.0),
    lambda s, b, lr=0.1: optax_step(s, b),
])
def test_steps_jaxsane_can_call_pass(step):
    adapted = PureExperiment(_exp(step))
    state, metrics = adapted.step(adapted.init(jax.random.key(0)), batch())
    assert "loss" in metrics or metrics


class _Unreadable:
    """A callable whose signature inspect cannot read (as some C callables): its first call's binding is checked."""

    __signature__ = "not a signature"

    def __call__(self, state):
        return state


class _Broken:
    __signature__ = "not a signature"

    def __call__(self, state, b):
        raise TypeError("the user's own TypeError, with positional argument in its text")


def test_an_unreadable_signature_is_checked_at_the_first_call_only_for_the_binding():
    with pytest.raises(TypeError):
        inspect.signature(_Unreadable())
    adapted = PureExperiment(_exp(_Unreadable()))
    with pytest.raises(ExperimentError, match=r"cannot be called as step\(state, batch\): .*positional argument"):
        adapted.step(adapted.init(jax.random.key(0)), batch())
    adapted = PureExperiment(_exp(_Broken()))
    with pytest.raises(TypeError, match="the user's own TypeError") as info:  # raised inside the user's code
        adapted.step(adapted.init(jax.random.key(0)), batch())
    assert not isinstance(info.value, ExperimentError)


def _with_rng(fn):
    """A decorator that injects an argument into the function it wraps (its own signature is the call's)."""
    @functools.wraps(fn)
    def wrapper(state, b):
        return fn(state, b, jax.random.key(1))
    return wrapper


@_with_rng
def _injected(state, b, rng):
    return optax_step(state, b)


def test_a_decorator_that_injects_an_argument_is_read_by_its_own_signature():
    adapted = PureExperiment(_exp(_injected))
    _, metrics = adapted.step(adapted.init(jax.random.key(0)), batch())
    assert "loss" in metrics


def test_nnx_and_equinox_jit_wrappers_are_read_through():
    from flax import nnx
    with pytest.raises(ExperimentError, match="takes 1 positional argument"):
        PureExperiment(_exp(nnx.jit(lambda s: s)))
    eqx = pytest.importorskip("equinox")
    with pytest.raises(ExperimentError, match="takes 1 positional argument"):
        PureExperiment(_exp(eqx.filter_jit(lambda s: s)))
