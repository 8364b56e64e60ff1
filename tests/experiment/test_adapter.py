"""The adapter layer's one NNX purifier (jaxsane._experiment.purify) and its shared helpers."""

import pytest
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsane._core.tree import is_key
from jaxsane._experiment.purify import (
    call_split,
    is_nnx_object,
    is_nnx_state,
    nnx_positions,
    positional_arity,
    positional_names,
    split_objects,
    split_whole,
    unwrap,
)


class Counter(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones((2,)))
        self.n = nnx.Variable(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.n[...] = self.n[...] + 1
        return (self.w[...] * x).sum()


def bump(model, scale, other, *, shift=0.0):
    """Mutates ``model`` and ``other`` in place, like an nnx step."""
    model.w[...] = model.w[...] * scale + shift
    other.w[...] = other.w[...] + 1.0
    return model(jnp.ones(2))


def test_split_and_call_is_a_pure_function_of_the_objects_state():
    a, b = Counter(), Counter()
    args = (a, 2.0, b)
    positions = nnx_positions(args)
    assert positions == (0, 2)
    layout, state = split_objects(args, positions)
    plain = (None, 2.0, None)
    out, new_state = jax.jit(lambda s, p: call_split(bump, layout, s, p, {"shift": 1.0}))(state, plain)
    # the live objects are untouched: the call ran on objects rebuilt from the state
    np.testing.assert_array_equal(a.w[...], jnp.ones(2))
    np.testing.assert_array_equal(b.w[...], jnp.ones(2))
    assert float(out) == 6.0
    np.testing.assert_array_equal(new_state[0]["w"][...], jnp.full(2, 3.0))
    np.testing.assert_array_equal(new_state[1]["w"][...], jnp.full(2, 2.0))
    assert int(new_state[0]["n"][...]) == 1
    # the same call again from the old state gives the same result (no hidden state)
    out2, new2 = call_split(bump, layout, state, plain, {"shift": 1.0})
    assert float(out2) == 6.0 and int(new2[0]["n"][...]) == 1


def test_call_split_without_objects_is_a_plain_call():
    args = (jnp.ones(2), 3.0)
    layout, state = split_objects(args, nnx_positions(args))
    assert layout is None and state is None
    out, new_state = call_split(lambda x, s: x * s, layout, state, args)
    assert new_state is None
    np.testing.assert_array_equal(out, jnp.full(2, 3.0))


def test_packed_layout_passes_the_whole_tuple_as_one_argument():
    objs = (Counter(), Counter())
    layout, state = split_whole(objs, (0,), packed=True)
    seen = []

    def step(pair, x):
        seen.append(type(pair))
        return pair[0](x) + pair[1](x)

    out, new_state = call_split(step, layout, state, (None, jnp.ones(2)))
    assert seen == [tuple] and float(out) == 4.0
    assert int(new_state[0]["n"][...]) == 1 and int(new_state[1]["n"][...]) == 1
    spread, state2 = split_whole(objs, (0, 1), packed=False)
    out2, _ = call_split(lambda m, o, x: m(x) - o(x), spread, state2, (None, None, jnp.ones(2)))
    assert float(out2) == 0.0


def test_object_detection():
    m = Counter()
    assert is_nnx_object(m) and not is_nnx_object(jnp.ones(1)) and not is_nnx_object({"w": 1})
    assert is_nnx_state(m) and is_nnx_state((m, 1)) and is_nnx_state([1, m])
    assert not is_nnx_state({"params": jnp.ones(1)}) and not is_nnx_state((jnp.ones(1), 2))


def test_signature_helpers_see_through_jit_wrappers():
    def step(state, batch, extra=None):
        return state

    wrapped = functools.wraps(step)(lambda *a, **k: step(*a, **k))
    for fn in (step, jax.jit(step), nnx.jit(step), wrapped):
        assert unwrap(fn) is step
        assert positional_names(fn) == ["state", "batch", "extra"]
        assert positional_arity(fn) == 3
    assert positional_arity(lambda *args: 0) is None


def test_is_key_is_true_only_for_typed_prng_keys():
    assert is_key(jax.random.key(0))
    assert not is_key(jax.random.PRNGKey(0))  # raw uint32 keys are plain arrays
    assert not is_key(jnp.ones(2)) and not is_key(3.0) and not is_key(None)

    class FakeDtype:
        dtype = "not a dtype"
    assert not is_key(FakeDtype())


@pytest.mark.slow
def test_the_pure_view_is_public_and_every_tool_takes_it():
    import doctest

    import jaxsane
    from jaxsane._experiment.contract import PureExperiment
    from jaxsane._monitor import monitor as _monitor

    assert "PureExperiment" in jaxsane.__all__ and jaxsane.PureExperiment is PureExperiment
    assert "jaxsane.PureExperiment" in (PureExperiment.__doc__ or "")
    assert "jaxsane._experiment.contract" not in (_monitor.Monitor.__doc__ + _monitor.__doc__)
    # the Monitor's own example runs on public names only
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in doctest.DocTestFinder().find(_monitor.Monitor, "Monitor", globs={"jax": jax}):
        runner.run(test)
    assert runner.failures == 0 and runner.tries >= 5


def test_one_on_nonfinite_vocabulary_for_guard_and_fit():
    import pytest

    from jaxsane import FitArgumentError
    from jaxsane._core.validate import NONFINITE_POLICIES, require_policy
    from jaxsane._fit.fit import POLICIES as FIT
    from jaxsane._guard.guard import POLICIES as GUARD

    assert set(FIT) | set(GUARD) == set(NONFINITE_POLICIES)  # every word either tool takes is defined once
    for p in FIT:
        assert require_policy("fit", p, FIT, FitArgumentError) == p
    with pytest.raises(FitArgumentError, match=r"another tool's policy.*cannot go on from a non-finite state"):
        require_policy("fit", "warn", FIT, FitArgumentError)
    with pytest.raises(FitArgumentError, match=r"misspelt.*'rollback': restore the last verified state"):
        require_policy("fit", "rolback", FIT, FitArgumentError)
    expected = r"\[jaxsane\] on_nonfinite must be one of 'raise', 'skip', 'warn' in guard.*only fit keeps"
    with pytest.raises(ValueError, match=expected):
        require_policy("guard", "rollback", GUARD)


def test_guard_bad_arguments_are_jaxsane_errors():
    import pytest

    import jaxsane

    def step(state, batch):
        return state

    for bad in ({"on_nonfinite": "rollback"}, {"on_nonfinite": True}, {"check_replicas": -1}, {"max_lag": -1}):
        with pytest.raises(jaxsane.ArgumentError):
            jaxsane.guard(step, **bad)
    with pytest.raises(jaxsane.ArgumentError, match="callable"):
        jaxsane.guard(None)
    for policy in ("raise", "skip", "warn"):
        assert jaxsane.guard(step, on_nonfinite=policy).on_nonfinite == policy


class Tiny(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        return self.lin(x)


def _nnx_and_pytree_experiments(traces):
    """The same step as an NNX (model, optimizer) step and as a pytree step; ``traces`` counts the user's calls."""
    import optax

    import jaxsane

    def nnx_step(model, opt, batch):
        traces.append("nnx")

        def loss_fn(m):
            return jnp.mean((m(batch["x"]) - batch["y"]) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return {"loss": loss}

    def nnx_init(key):
        model = Tiny(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def tree_step(state, batch):
        traces.append("tree")
        loss, g = jax.value_and_grad(lambda p: jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2))(state["params"])
        return {"params": jax.tree_util.tree_map(lambda p, d: p - 0.1 * d, state["params"], g)}, {"loss": loss}

    data = [{"x": jnp.ones((4, 3)), "y": jnp.zeros((4, 2))}]
    return (
        jaxsane.Experiment(init=nnx_init, step=nnx_step, train=data),
        jaxsane.Experiment(init=lambda key: {"params": {"w": jnp.ones((3, 2))}}, step=tree_step, train=data),
    )


def test_the_pure_step_is_traced_once_per_signature_and_runs_itself_eagerly():
    from jaxsane._experiment.contract import PureExperiment

    traces = []
    for exp in _nnx_and_pytree_experiments(traces):
        adapted = PureExperiment(exp, key=jax.random.key(0))
        state, batch = adapted.example_state, exp.train[0]
        if not adapted.nnx:  # a pytree step's output style: found once, by a trace of its own
            adapted.detect_style(state, batch)
        traces.clear()
        first = jax.make_jaxpr(adapted.step)(state, batch)
        jax.eval_shape(adapted.step, state, batch)
        again = jax.make_jaxpr(adapted.step)(state, batch)
        assert len(traces) == 1, "the checks' traces at one signature trace the user's step once"
        assert [e.primitive for e in again.jaxpr.eqns] == [e.primitive for e in first.jaxpr.eqns]
        jax.vmap(adapted.step)(*jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), (state, batch)))
        assert len(traces) == 1, "a vmapped call sees one configuration's shapes: the same signature"
        jax.eval_shape(adapted.step, state, jax.tree_util.tree_map(lambda x: x[:2], batch))
        assert len(traces) == 2, "two examples: another signature"
        replayed = float(jax.jit(adapted.step)(state, batch)[1]["loss"])  # the replayed jaxpr, compiled
        assert len(traces) == 2
        new_state, metrics = adapted.step(state, batch)  # eagerly: the user's step itself, every time
        adapted.step(new_state, batch)
        assert len(traces) == 4
        np.testing.assert_allclose(replayed, float(metrics["loss"]), rtol=1e-6)
