"""check_grads(trust_autodiff=True): finite differences only where autodiff can be wrong (a derivative rule that is
not JAX's own, a stop_gradient the user wrote, a zero or non-finite gradient); JAX's own rules are trusted."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxsane import check_grads
from jaxsane._checks import grads_leaf
from jaxsane._checks.grads_trust import foreign_rules
from jaxsane._core.errors import ArgumentError

X = np.random.default_rng(0).normal(size=(8, 5)).astype(np.float32)
Y = (np.arange(8) % 3).astype(np.int32)
PARAMS = {
    "l1": {"w": jnp.asarray(np.random.default_rng(1).normal(size=(5, 6)) * 0.5, jnp.float32), "b": jnp.zeros(6) + 0.1},
    "l2": {"w": jnp.asarray(np.random.default_rng(2).normal(size=(6, 3)) * 0.5, jnp.float32), "b": jnp.zeros(3)},
}


def _loss(act):
    def loss(params, batch):
        h = act(batch["x"] @ params["l1"]["w"] + params["l1"]["b"])
        logits = h @ params["l2"]["w"] + params["l2"]["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return loss


def _jax_tanh_doubled():
    @jax.custom_vjp
    def act(x):
        return jnp.tanh(x)

    act.defvjp(lambda x: (jnp.tanh(x), x), lambda x, g: (2.0 * (1 - jnp.tanh(x) ** 2) * g,))  # BUG: factor 2
    return act


def _eqx_tanh_doubled():
    @eqx.filter_custom_vjp
    def act(x):
        return jnp.tanh(x)

    @act.def_fwd
    def fwd(perturbed, x):
        return jnp.tanh(x), None

    @act.def_bwd
    def bwd(residuals, g, perturbed, x):
        return 2.0 * (1 - jnp.tanh(x) ** 2) * g  # BUG: factor 2

    return act


@pytest.fixture
def judged(monkeypatch):
    """The paths finite differences judged in the checks run while the test runs."""
    seen: list[str] = []
    real = grads_leaf.LeafJudge.judge

    def spy(self, j, path, tally, **kw):
        seen.append(path)
        return real(self, j, path, tally, **kw)

    monkeypatch.setattr(grads_leaf.LeafJudge, "judge", spy)
    return seen


@pytest.mark.parametrize("act", [jax.nn.relu, jnp.tanh, jax.nn.gelu, jax.nn.softmax])
def test_jax_own_rules_are_trusted_and_nothing_is_differenced(act, judged):
    batch = {"x": X, "y": Y}
    assert check_grads(_loss(act), PARAMS, batch, trust_autodiff=True) == []
    assert judged == []
    assert check_grads(_loss(act), PARAMS, batch) == []  # the full check agrees, and compares every leaf
    assert len(judged) == 4


@pytest.mark.parametrize(
    "make", [_jax_tanh_doubled, _eqx_tanh_doubled], ids=["jax.custom_vjp", "eqx.filter_custom_vjp"]
)
def test_a_wrong_rule_of_the_users_is_still_found_on_every_leaf_it_touches(make, judged):
    findings = check_grads(_loss(make()), PARAMS, {"x": X, "y": Y}, trust_autodiff=True)
    assert {f.path for f in findings if f.code == "grad.mismatch"} == {"params['l1']['w']", "params['l1']['b']"}
    assert len(judged) == 4  # a rule not JAX's own: every leaf compared


def test_a_users_stop_gradient_and_a_zero_gradient_are_still_differenced(judged):
    def loss(params, batch):
        h = jnp.tanh(batch["x"] @ params["l1"]["w"] + jax.lax.stop_gradient(params["l1"]["b"]))  # BUG: b frozen
        logits = h @ params["l2"]["w"] + jnp.round(params["l2"]["b"] * 0)  # b of l2 gets no gradient at all
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    findings = check_grads(loss, PARAMS, {"x": X, "y": Y}, trust_autodiff=True)
    assert sorted(judged) == ["params['l1']['b']", "params['l2']['b']"]
    missing = {f.path: f for f in findings if f.code == "grad.missing"}
    assert missing["params['l1']['b']"].severity == "error" and missing["params['l1']['b']"].extra["depends"]
    assert missing["params['l2']['b']"].extra["depends"] is False
    assert findings == check_grads(loss, PARAMS, {"x": X, "y": Y})  # what the full check finds, no more


def test_a_non_finite_gradient_is_still_reported(judged):
    def loss(params, batch):
        b = params["l1"]["b"]
        return _loss(jnp.tanh)(params, batch) + jnp.sum(jnp.sqrt(jnp.abs(b - b)))  # sqrt at 0: a NaN gradient

    findings = check_grads(loss, PARAMS, {"x": X, "y": Y}, trust_autodiff=True)
    assert [f.code for f in findings] == ["nonfinite.backward"]
    assert "params['l1']['b']" in findings[0].message and judged == ["params['l1']['b']"]


def test_foreign_rules_names_the_rules_that_are_not_jax_own():
    x = jnp.ones(3)
    assert foreign_rules(jax.make_jaxpr(lambda w: jnp.sum(jax.nn.relu(w) + jax.nn.softmax(w)))(x)) == []
    user = jax.make_jaxpr(lambda w: jnp.sum(jax.jit(_jax_tanh_doubled())(w)))(x)  # inside a jit
    (where,) = foreign_rules(user)
    assert where.startswith("act at ") and __file__.rsplit("/", 1)[-1] in where
    scanned = jax.make_jaxpr(
        lambda w: jax.lax.scan(lambda c, v: (c + _eqx_tanh_doubled()(v * w).sum(), None), 0.0, x)[0]
    )
    assert foreign_rules(scanned(x))  # equinox's wrappers of the user's rule, inside a scan body


def test_trust_autodiff_is_validated():
    with pytest.raises(ArgumentError, match="trust_autodiff"):
        check_grads(_loss(jnp.tanh), PARAMS, {"x": X, "y": Y}, trust_autodiff="yes")
