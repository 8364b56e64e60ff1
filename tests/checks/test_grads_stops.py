"""A leaf whose value flows into lax.stop_gradient differs from finite differences by design (a VQ-VAE's
straight-through estimator): one grad.mismatch warning naming the stop_gradient's line, no error; a wrong
custom_vjp rule beside a stop_gradient (log_softmax's) stays the error."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxsane
from jaxsane._checks.grads_stops import stop_gradient_crossings

RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.normal(size=(16, 4)), jnp.float32)
Y = jnp.asarray(RNG.integers(0, 3, 16))


def _vq_params():
    return {
        "enc": jnp.asarray(RNG.normal(size=(4, 3)), jnp.float32),
        "code": jnp.asarray(RNG.normal(size=(8, 3)), jnp.float32),
        "dec": jnp.asarray(RNG.normal(size=(3, 4)), jnp.float32),
    }


def _vq_loss(p, x):
    z = x @ p["enc"]
    q = p["code"][jnp.argmin(jnp.sum((z[:, None, :] - p["code"][None]) ** 2, -1), -1)]
    st = z + jax.lax.stop_gradient(q - z)  # straight-through: the decoder's gradient goes to the encoder
    commit = jnp.mean((z - jax.lax.stop_gradient(q)) ** 2) + jnp.mean((jax.lax.stop_gradient(z) - q) ** 2)
    spread = 1e-3 * jnp.sum(jax.nn.softmax(z) ** 2)  # (softmax's own stop_gradient: not the one to name)
    return jnp.mean((st @ p["dec"] - x) ** 2) + 0.25 * commit + spread


def test_a_straight_through_estimator_is_one_warning_naming_its_stop_gradient():
    found = jaxsane.check_grads(_vq_loss, _vq_params(), X)
    assert [f.severity for f in found if f.code == "grad.mismatch"] == ["warning"], [str(f) for f in found]
    f = next(f for f in found if f.code == "grad.mismatch")
    lines, start = inspect.getsourcelines(_vq_loss)
    written = {start + i for i, line in enumerate(lines) if "lax.stop_gradient(" in line}  # not softmax's own
    named = {int(w.rsplit(":", 1)[1]) for w in f.extra["stop_gradient"]}
    assert named and named <= written and all("test_grads_stops.py" in w for w in f.extra["stop_gradient"]), f.extra


@jax.custom_vjp
def _act(x):
    return jnp.tanh(x)


_act.defvjp(lambda x: (jnp.tanh(x), x), lambda x, g: (-g * (1 - jnp.tanh(x) ** 2),))  # FAULT: the sign


def test_a_wrong_custom_vjp_beside_log_softmaxs_stop_gradient_stays_the_error():
    p = {
        "w1": jnp.asarray(RNG.normal(size=(4, 8)), jnp.float32),
        "w2": jnp.asarray(RNG.normal(size=(8, 3)), jnp.float32),
    }

    def loss(p, x):
        return optax.softmax_cross_entropy_with_integer_labels(_act(x @ p["w1"]) @ p["w2"], Y).mean()

    assert "stop_gradient" in str(jax.make_jaxpr(loss)(p, X))  # (log_softmax's max, subtracted)
    found = jaxsane.check_grads(loss, p, X)
    assert [(f.severity, f.path) for f in found if f.code == "grad.mismatch"] == [("error", "params['w1']")], found


def test_the_leaves_that_flow_into_a_stop_gradient_are_found_inside_nested_jits():
    inner = jax.jit(lambda a: jax.lax.stop_gradient(a) * 2.0)
    jaxpr = jax.make_jaxpr(lambda a, b, c: jnp.sum(inner(a) + b) + jnp.sum(c))(1.0, 2.0, 3.0)
    crossings = stop_gradient_crossings(jaxpr, 3)
    assert [bool(c) for c in crossings] == [True, False, False], crossings


def _target_experiment(ema: bool):
    """BYOL's shape in small: an online network regressed onto a target network's output through stop_gradient.
    ``ema``: the step keeps the target as an average of the online weights (the recipe); else a layer of the
    model is cut off by a misplaced stop_gradient and adamw's weight decay is all that moves it (a bug)."""
    tx = optax.adamw(1e-2, weight_decay=1e-2)
    online = {"w": jnp.asarray(RNG.normal(size=(4, 4)), jnp.float32)}
    target = {"w": jnp.asarray(RNG.normal(size=(4, 4)), jnp.float32)}

    def loss(params, x):
        on, tg = params
        return jnp.mean((x @ on["w"] - jnp.tanh(x @ jax.lax.stop_gradient(tg["w"]))) ** 2)

    def step(state, x):
        params, opt = state
        g = jax.grad(loss)(params, x)
        if ema:
            upd, opt = tx.update(g[0], opt, params[0])
            on = optax.apply_updates(params[0], upd)
            tg = optax.incremental_update(on, params[1], 0.01)
            return ((on, tg), opt), {}
        upd, opt = tx.update(g, opt, params)
        return (optax.apply_updates(params, upd), opt), {}

    def init(key):
        params = (online, target)
        return params, tx.init(params[0] if ema else params)

    return jaxsane.Experiment(init=init, step=jax.jit(step), train=X, loss=loss, params=lambda s: s[0])


def test_a_target_network_the_step_averages_is_no_missing_gradient_error():
    averaged = jaxsane.doctor(_target_experiment(ema=True), stages=["grads"], progress=False)
    assert not [f for f in averaged.by_code("grad.missing") if f.severity == "error"], averaged
    assert any(f.extra.get("updated_by_step") for f in averaged.by_code("grad.missing")), averaged
    decayed = jaxsane.doctor(_target_experiment(ema=False), stages=["grads"], progress=False)
    assert [f.severity for f in decayed.by_code("grad.missing")] == ["error"], decayed
