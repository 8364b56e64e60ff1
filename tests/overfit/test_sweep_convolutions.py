"""The sweep of a step with convolutions on XLA:CPU loops on the host (a convolution in a loop body runs several
times slower there, jax-ml/jax#12868), with the results of the compiled while_loop program."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import jaxsane
from jaxsane._overfit import sweep_compile as _sweep
from jaxsane._overfit.sweep_program import per_configuration


class _CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        return nn.Dense(3)(x.reshape(x.shape[0], -1))


def _experiment():
    model = _CNN()
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(8, 6, 6, 1)).astype(np.float32), "y": np.arange(8) % 3}
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)

    def init(key):
        params = model.init(key, batch["x"][:1])["params"]
        return params, tx.init(params)

    def loss(params, b):
        logits = model.apply({"params": params}, b["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    def step(state, b):
        params, opt = state
        value, grads = jax.value_and_grad(loss)(params, b)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), {"loss": value}

    apply = lambda params, x: model.apply({"params": params}, x)  # noqa: E731
    return jaxsane.Experiment(init=init, step=step, train=batch, loss=loss, apply=apply, params=lambda s: s[0]), batch


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the host loop is the CPU backend's")
def test_a_convolution_step_sweeps_in_a_host_loop_with_the_while_loops_results(monkeypatch):
    exp, batch = _experiment()
    built = []
    real_init = _sweep.HostLooped.__init__

    def spy(self, *args, **kwargs):
        built.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(_sweep.HostLooped, "__init__", spy)
    looped = jaxsane.overfit(exp, batch, seeds=2, learning_rates=(1e-3, 1e-2), steps=60, progress=False)
    assert built, "a convolution step must run in the host loop on the CPU"
    monkeypatch.setattr(_sweep, "has_convolutions", lambda jaxpr: False)  # the while_loop program
    compiled = jaxsane.overfit(exp, batch, seeds=2, learning_rates=(1e-3, 1e-2), steps=60, progress=False)
    assert len(built) == 1
    assert looped.losses.shape == compiled.losses.shape
    np.testing.assert_allclose(looped.losses, compiled.losses, rtol=2e-4, atol=1e-5)
    assert list(looped.reached_at) == list(compiled.reached_at) and list(looped.verdicts) == list(compiled.verdicts)
    assert looped.compiles == compiled.compiles == 1


def test_only_convolutions_choose_the_host_loop():
    conv = jax.make_jaxpr(lambda x, w: jax.lax.conv(x, w, (1, 1), "SAME"))(jnp.ones((1, 1, 4, 4)), jnp.ones((2, 1, 3, 3)))
    dense = jax.make_jaxpr(lambda x, w: jnp.tanh(x @ w))(jnp.ones((2, 3)), jnp.ones((3, 4)))
    nested = jax.make_jaxpr(lambda x, w: jax.lax.scan(lambda c, _: (jax.lax.conv(c, w, (1, 1), "SAME"), None), x,
                                                     None, length=2)[0])(jnp.ones((1, 1, 4, 4)), jnp.ones((1, 1, 3, 3)))
    assert _sweep.has_convolutions(conv) and _sweep.has_convolutions(nested) and not _sweep.has_convolutions(dense)


def _dot_batch_dims(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args)
    return [e.params["dimension_numbers"][1] for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]


def test_a_single_configuration_runs_unbatched_and_several_vmapped():
    """per_configuration: one stacked configuration runs the step on its slice (no batched matrix product, which
    XLA:CPU compiles and runs slower), several run vmapped; both give vmap's results."""

    def step(state, batch):
        w = state["w"] - 0.1 * batch["x"].T @ (batch["x"] @ state["w"])
        return {"w": w}, jnp.sum(w**2)

    rng = np.random.default_rng(0)
    for size in (1, 3):
        states = {"w": jnp.asarray(rng.normal(size=(size, 4, 2)), jnp.float32)}
        batches = {"x": jnp.asarray(rng.normal(size=(size, 5, 4)), jnp.float32)}
        got = per_configuration(step)(states, batches)
        want = jax.vmap(step)(states, batches)
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            assert g.shape == w.shape
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)
        batch_dims = _dot_batch_dims(per_configuration(step), states, batches)
        assert batch_dims and all(bool(dims[0]) == (size > 1) for dims in batch_dims), (size, batch_dims)
