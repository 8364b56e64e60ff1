"""Gradient checks: wrong custom_vjp rules, stop_gradient and unused parameters are named by leaf;
correct programs (NNX, linen, pure optax; BatchNorm, dropout, a correct custom_vjp) stay silent."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxsane
from jaxsane import check_grads
from jaxsane._checks.grads_kink import KINK_BLOCKS, KINK_SETTLE
from jaxsane.examples import load
from jaxsane.testing import assert_grads_match

X = np.random.default_rng(0).normal(size=(8, 5)).astype(np.float32)
Y = (np.arange(8) % 3).astype(np.int32)


def _mlp_params(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "l1": {"w": jax.random.normal(k1, (5, 6)) * 0.5, "b": jnp.zeros(6) + 0.1},
        "l2": {"w": jax.random.normal(k2, (6, 3)) * 0.5, "b": jnp.zeros(3)},
    }


def _tanh_vjp(bug):
    """tanh with a hand-written VJP; ``bug`` plants one classic mistake."""

    @jax.custom_vjp
    def act(x):
        return jnp.tanh(x)

    def fwd(x):
        y = jnp.tanh(x)
        return y, (x if bug == "residual" else y)  # BUG("residual"): saves the input, bwd expects the output

    def bwd(r, g):
        if bug == "sign":
            return (-(1 - r**2) * g,)  # BUG: wrong sign
        if bug == "factor":
            return ((1 - r**2),)  # BUG: the cotangent g is dropped
        return ((1 - r**2) * g,)

    act.defvjp(fwd, bwd)
    return act


def _loss_with(act):
    def loss(params, batch):
        h = act(batch["x"] @ params["l1"]["w"] + params["l1"]["b"])
        logits = h @ params["l2"]["w"] + params["l2"]["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return loss


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["sign", "factor", "residual"])
def test_wrong_custom_vjp_is_named_by_leaf(bug):
    findings = check_grads(_loss_with(_tanh_vjp(bug)), _mlp_params(), {"x": X, "y": Y})
    mismatched = {f.path for f in findings if f.code == "grad.mismatch"}
    # the custom_vjp sits between layer 1 and layer 2: layer 1's leaves are wrong, layer 2's are right
    assert mismatched == {"params['l1']['w']", "params['l1']['b']"}, findings
    f = next(f for f in findings if f.path == "params['l1']['w']")
    assert f.severity == "error" and "relative error" in f.message and "rtol=" in f.message
    assert f.extra["relative_error"] > f.extra["rtol"]
    assert f.extra["compute_dtype"] == "float64"
    assert "custom_vjp" in f.hint


def test_correct_custom_vjp_and_x64_stays_scoped():
    assert not jax.config.jax_enable_x64
    assert check_grads(_loss_with(_tanh_vjp(None)), _mlp_params(), {"x": X, "y": Y}) == []
    assert not jax.config.jax_enable_x64
    assert jnp.asarray(1.0).dtype == jnp.float32


def test_wrong_custom_jvp_caught_in_forward_mode_alone():
    @jax.custom_jvp
    def softplus(x):
        return jnp.logaddexp(x, 0.0)

    @softplus.defjvp
    def softplus_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return softplus(x), jax.nn.sigmoid(x) * t * 2.0  # BUG: factor 2

    def loss(params, x):
        return jnp.sum(softplus(x @ params["w"]))

    params = {"w": jnp.ones((5, 2)) * 0.3}
    findings = check_grads(loss, params, X, modes=("fwd",))
    assert [f.path for f in findings if f.code == "grad.mismatch"] == ["params['w']"]
    assert findings[0].extra["modes"] == ["fwd"]


def test_stop_gradient_on_a_linen_layer_is_grad_missing():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = jax.lax.stop_gradient(nn.relu(nn.Dense(6, name="encoder")(x)))  # BUG
            return nn.Dense(3, name="head")(h)

    model = Net()
    params = model.init(jax.random.key(0), X)["params"]

    def loss(p, batch):
        return optax.softmax_cross_entropy_with_integer_labels(
            model.apply({"params": p}, batch["x"]), batch["y"]
        ).mean()

    findings = check_grads(loss, params, {"x": X, "y": Y})
    missing = {f.path: f for f in findings if f.code == "grad.missing"}
    assert set(missing) == {"params['encoder']['kernel']", "params['encoder']['bias']"}
    assert missing["params['encoder']['kernel']"].extra["depends"] is True
    assert "stop_gradient" in missing["params['encoder']['kernel']"].hint
    assert not [f for f in findings if f.code == "grad.mismatch"]


class _NNXNet(nnx.Module):
    def __init__(self, rngs, use_extra=True, bn=False, dropout=False):
        self.l1 = nnx.Linear(5, 6, rngs=rngs)
        self.extra = nnx.Linear(6, 6, rngs=rngs)
        self.out = nnx.Linear(6, 3, rngs=rngs)
        self.use_extra = use_extra
        self.bn = nnx.BatchNorm(6, rngs=rngs) if bn else None
        self.drop = nnx.Dropout(0.3, rngs=rngs) if dropout else None

    def __call__(self, x):
        h = self.l1(x)
        if self.bn is not None:
            h = self.bn(h)
        h = nnx.tanh(h)
        if self.use_extra:
            h = nnx.tanh(self.extra(h))
        if self.drop is not None:
            h = self.drop(h)
        return self.out(h)


def _nnx_experiment(**kw):
    def init(key):
        model = _NNXNet(nnx.Rngs(params=key, dropout=jax.random.fold_in(key, 1)), **kw)
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    def loss(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()

    @nnx.jit
    def step(model, optimizer, batch):
        value, grads = nnx.value_and_grad(loss)(model, batch)
        optimizer.update(model, grads)
        return value

    return jaxsane.Experiment(
        init=init, step=step, train={"x": X, "y": Y}, loss=loss, apply=lambda m, x: m(x), num_classes=3, name="nnx-test"
    )


@pytest.mark.slow
def test_unused_nnx_layer_is_grad_missing_from_doctor():
    diagnosis = jaxsane.doctor(_nnx_experiment(use_extra=False), stages=["grads"], progress=False)
    missing = [f for f in diagnosis if f.code == "grad.missing"]
    assert {f.path for f in missing} == {"params['extra']['kernel']", "params['extra']['bias']"}
    assert all(f.extra["depends"] is False for f in missing)
    assert "unused" in missing[0].hint


@pytest.mark.slow
def test_clean_nnx_with_batchnorm_and_dropout_is_silent():
    diagnosis = jaxsane.doctor(_nnx_experiment(bn=True, dropout=True), stages=["grads"], progress=False)
    assert not diagnosis.by_code("grad"), diagnosis
    assert not diagnosis.by_code("doctor"), diagnosis


def test_clean_linen_batchnorm_train_mode_is_silent():
    class BNNet(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            h = nn.Dense(6)(x)
            h = nn.BatchNorm(use_running_average=not train)(h)
            return nn.Dense(3)(nn.relu(h))

    model = BNNet()
    variables = model.init(jax.random.key(0), X, train=False)

    def loss(params, batch):
        logits, _ = model.apply(
            {"params": params, "batch_stats": variables["batch_stats"]}, batch["x"], train=True, mutable=["batch_stats"]
        )
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    findings = check_grads(loss, variables["params"], {"x": X, "y": Y})
    # the Dense bias before BatchNorm is cancelled by the batch mean: its gradient is ~0 but not
    # identically 0, and finite differences agree
    assert findings == []


@pytest.mark.slow
@pytest.mark.parametrize("name", ["digits_optax", "digits_linen", "digits_nnx"])
def test_doctor_model_and_step_stages_silent_on_examples(name):
    """The bundled healthy programs: no finding at all from the init/grads/step/batch stages."""
    diagnosis = jaxsane.doctor(load(name), stages=["init", "grads", "step", "batch"], progress=False)
    assert list(diagnosis) == [], diagnosis
    assert [layer["name"] for layer in diagnosis.artifacts["init_activations"]][-1].endswith(
        ("[2]", "['Dense_2']", "['out']")
    )


def test_bfloat16_params_are_upcast():
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _mlp_params())
    loss = _loss_with(jnp.tanh)
    assert check_grads(loss, params, {"x": X.astype(jnp.bfloat16), "y": Y}) == []
    bad = check_grads(_loss_with(_tanh_vjp("sign")), params, {"x": X, "y": Y})
    assert {f.path for f in bad} == {"params['l1']['w']", "params['l1']['b']"}


def test_low_precision_compute_uses_its_dtype_tolerance():
    def loss(params, batch):  # computes in float32 whatever the parameters' dtype
        p = jax.tree.map(lambda a: a.astype(jnp.float32), params)
        h = jnp.tanh(batch["x"].astype(jnp.float32) @ p["l1"]["w"] + p["l1"]["b"])
        return jnp.mean(jnp.tanh(h @ p["l2"]["w"] + p["l2"]["b"]))

    params = _mlp_params()
    assert check_grads(loss, params, {"x": X, "y": Y}) == []
    bad = check_grads(lambda p, b: loss(p, b) + jnp.sum(_tanh_vjp("sign")(p["l1"]["b"])), params, {"x": X, "y": Y})
    assert [f.path for f in bad] == ["params['l1']['b']"] and bad[0].extra["compute_dtype"] == "float32"


@pytest.mark.slow
def test_order_two_and_non_scalar_output():
    def f(params, x):
        return jnp.tanh(x @ params["w"])  # (8, 2) output: projected on a random cotangent

    assert check_grads(f, {"w": jnp.ones((5, 2)) * 0.2}, X, order=2) == []


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(jaxsane.JaxsaneError, match="order must be >= 1"):
        check_grads(lambda p: jnp.sum(p), jnp.ones(3), order=0)
    with pytest.raises(jaxsane.JaxsaneError, match="modes"):
        check_grads(lambda p: jnp.sum(p), jnp.ones(3), modes=("sideways",))
    with pytest.raises(jaxsane.JaxsaneError, match="failed"):
        check_grads(lambda p, x: p @ x, jnp.ones(3), jnp.ones(4))


def test_assert_grads_match():
    assert_grads_match(_loss_with(_tanh_vjp(None)), _mlp_params(), {"x": X, "y": Y})
    with pytest.raises(jaxsane.GradCheckError, match=r"params\['l1'\]\['w'\]") as info:
        assert_grads_match(_loss_with(_tanh_vjp("sign")), _mlp_params(), {"x": X, "y": Y})
    assert {f.code for f in info.value.findings} == {"grad.mismatch"}
    with pytest.raises(AssertionError):  # GradCheckError is an AssertionError, as pytest expects
        assert_grads_match(lambda p, x: jnp.sum(x @ p["w"]), {"w": jnp.ones((5, 2)), "unused": jnp.ones(2)}, X)
    assert_grads_match(
        lambda p, x: jnp.sum(x @ p["w"]), {"w": jnp.ones((5, 2)), "unused": jnp.ones(2)}, X, allow_missing=True
    )


def test_grads_stage_skipped_without_loss():
    exp = load("digits_optax")
    exp = jaxsane.Experiment(init=exp.init, step=exp.step, train=exp.train, apply=exp.apply, num_classes=10)
    diagnosis = jaxsane.doctor(exp, stages=["grads"], progress=False)
    assert diagnosis.codes == ["doctor.skipped"] and diagnosis[0].severity == "info"


def test_nan_gradient_is_reported_as_backward_nonfinite_not_a_wrong_rule():
    import jax.numpy as jnp
    import numpy as np

    import jaxsane

    def loss(params, x):
        e = jnp.sum(x * x * params["g"])
        return jnp.where(e > 0, jnp.sqrt(e), 0.0) + jnp.sum(params["w"] * x)

    params = {"g": jnp.ones(3), "w": jnp.ones(3)}
    findings = jaxsane.check_grads(loss, params, np.zeros(3, np.float32))
    codes = {f.code for f in findings}
    assert "nonfinite.backward" in codes and "grad.mismatch" not in codes
    assert [f.path for f in findings if f.code == "nonfinite.backward"] == ["params['g']"]


def test_nan_loss_skips_the_comparison_with_one_nonfinite_finding():
    """Labels off by one make the loss NaN: one nonfinite.forward, no grad.mismatch flood, no grad.missing."""
    params = _mlp_params()
    bad = {"x": X, "y": Y + 1}  # labels 1..3 for 3 classes: 3 is out of range
    assert int(bad["y"].max()) == 3
    findings = check_grads(_loss_with(jnp.tanh), params, bad)
    assert [f.code for f in findings] == ["nonfinite.forward"], findings
    assert "nan" in findings[0].message and "skipped" in findings[0].message and "locate" in findings[0].hint
    # the same model on valid labels is checked leaf by leaf and is clean
    assert check_grads(_loss_with(jnp.tanh), params, {"x": X, "y": Y}) == []


def test_nonfinite_derivatives_are_never_a_mismatch_and_are_reported_once():
    # a finite loss whose autodiff gradient is NaN on two leaves: one nonfinite.backward naming both
    def loss(params, x):
        e = jnp.sum(x * x * params["g"]) + jnp.sum(x * x * params["h"])
        return jnp.where(e > 0, jnp.sqrt(e), 0.0) + jnp.sum(params["w"] * (x + 1))

    params = {"g": jnp.ones(3), "h": jnp.ones(3), "w": jnp.ones(3)}
    findings = check_grads(loss, params, np.zeros(3, np.float32))
    assert [f.code for f in findings] == ["nonfinite.backward"], findings
    assert findings[0].extra["leaves"] == ["params['g']", "params['h']"]
    # the loss goes NaN a finite-difference step away (log of a parameter at ~0): a forward fact, not a mismatch
    edge = {"p": jnp.full(4, 1e-9), "w": jnp.ones(4)}
    findings = check_grads(lambda p, x: jnp.sum(jnp.log(p["p"])) + jnp.sum(p["w"] * x), edge, np.ones(4, np.float32))
    assert [f.code for f in findings] == ["nonfinite.forward"], findings
    assert findings[0].path == "params['p']" and "finite-difference step" in findings[0].message
    # away from the edge the same function checks clean
    away = {"p": jnp.full(4, 0.5), "w": jnp.ones(4)}
    assert check_grads(lambda p, x: jnp.sum(jnp.log(p["p"])) + jnp.sum(p["w"] * x), away, np.ones(4, np.float32)) == []


# ------------------------------------------------------------------ kinks at the point: not a wrong rule
def _padded_graphs():
    """A jraph-style padded GraphsTuple dict: rings of 3, 4 and 5 nodes, three real nodes without attributes
    (all-zero rows) and 4 zero-filled padding nodes in one padding graph that the loss masks out."""
    rng = np.random.default_rng(0)
    sizes, senders, receivers, offset = [3, 4, 5], [], [], 0
    for n in sizes:
        s = np.arange(n) + offset
        r = (np.arange(n) + 1) % n + offset
        senders += [s, r]
        receivers += [r, s]
        offset += n
    nodes = rng.normal(1.0, 0.1, size=(offset, 3))
    nodes[[1, 5, 9]] = 0.0  # real nodes with no attributes
    pad_nodes, pad_edges = 4, 6
    senders = np.concatenate(senders + [np.full(pad_edges, offset)])
    receivers = np.concatenate(receivers + [np.full(pad_edges, offset)])
    return {
        "nodes": np.concatenate([nodes, np.zeros((pad_nodes, 3))]).astype(np.float32),
        "senders": senders.astype(np.int32),
        "receivers": receivers.astype(np.int32),
        "n_node": np.array(sizes + [pad_nodes], np.int32),
        "labels": np.array([0, 1, 0, 0], np.int32),
        "graph_mask": np.array([1, 1, 1, 0], np.float32),
    }


def _graph_params():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return {
        "encoder": {"w": jax.random.normal(k1, (3, 8)), "b": jnp.zeros(8)},  # zero-initialised biases
        "mp": {"w": jax.random.normal(k2, (16, 8)) * 0.3, "b": jnp.zeros(8)},
        "out": {"w": jax.random.normal(k3, (8, 2)) * 0.3, "b": jnp.zeros(2)},
    }


def _graph_loss(act, mp_act=jax.nn.relu):
    """Masked per-graph cross-entropy of a ReLU encoder (``act``) + one sum message-passing layer + mean readout."""

    def loss(params, g):
        num_nodes, num_graphs = g["nodes"].shape[0], g["n_node"].shape[0]
        h = act(g["nodes"] @ params["encoder"]["w"] + params["encoder"]["b"])  # zero rows: exactly relu(0)
        messages = jax.ops.segment_sum(h[g["senders"]], g["receivers"], num_nodes)
        h = mp_act(jnp.concatenate([h, messages / 2.0], -1) @ params["mp"]["w"] + params["mp"]["b"])
        graph_of_node = jnp.repeat(jnp.arange(num_graphs), g["n_node"], total_repeat_length=num_nodes)
        pooled = jax.ops.segment_sum(h, graph_of_node, num_graphs) / jnp.maximum(g["n_node"], 1)[:, None]
        logits = pooled @ params["out"]["w"] + params["out"]["b"]
        per_graph = optax.softmax_cross_entropy_with_integer_labels(logits, g["labels"])
        return jnp.sum(per_graph * g["graph_mask"]) / jnp.sum(g["graph_mask"])

    return loss


def _relu_vjp(bug):
    """ReLU with a hand-written VJP; ``bug`` plants a wrong backward."""

    @jax.custom_vjp
    def relu(x):
        return jnp.maximum(x, 0.0)

    def fwd(x):
        return relu(x), x

    def bwd(x, g):
        d = jnp.where(x > 0, g, 0.0)
        return ({"double": 2.0 * d, "sign": -d}.get(bug, d),)  # BUG("double", "sign")

    relu.defvjp(fwd, bwd)
    return relu


@pytest.mark.slow
def test_relu_on_zero_rows_of_a_padded_graph_batch_is_not_a_mismatch():
    """Zero rows through a zero bias put the encoder's ReLU exactly on its kink: autodiff returns one side
    (relu'(0) = 0), central differences the average at every step. Not judged (info), never an error."""
    loss, params, graphs = _graph_loss(jax.nn.relu), _graph_params(), _padded_graphs()
    before = check_grads(loss, params, graphs, kinks=False)  # the step ladder alone: a false alarm
    assert "params['encoder']['b']" in {f.path for f in before if f.code == "grad.mismatch"}, before
    findings = check_grads(loss, params, graphs)
    assert [f.code for f in findings] == ["grad.kink"], findings
    kink = findings[0]
    assert kink.severity == "info" and "params['encoder']['b']" in kink.extra["leaves"]
    verdict = kink.extra["kinks"]["params['encoder']['b']"]
    assert verdict["wrong"] is None and verdict["right"] != pytest.approx(verdict["left"], rel=1e-3)
    # the same model with a correct hand-written ReLU checks the same, and a custom ReLU is judged like jax.nn.relu
    assert [f.code for f in check_grads(_graph_loss(_relu_vjp(None)), params, graphs)] == ["grad.kink"]


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["double", "sign"])
def test_wrong_custom_relu_on_the_padded_graph_model_is_still_a_mismatch(bug):
    """The encoder's ReLU has the wrong backward; its weight sees no kink (a zero row times any weight is 0), so
    it is judged and named, while its bias sits on the kink (not judged) and the layers above are right."""
    findings = check_grads(_graph_loss(_relu_vjp(bug)), _graph_params(), _padded_graphs())
    errors = [(f.code, f.path) for f in findings if f.severity == "error"]
    assert errors == [("grad.mismatch", "params['encoder']['w']")], findings
    assert findings[0].extra["relative_error"] > 0.1 and "custom_vjp" in findings[0].hint
    # on every layer: every weight below the wrong rule is named
    findings = check_grads(_graph_loss(_relu_vjp(bug), _relu_vjp(bug)), _graph_params(), _padded_graphs())
    assert "params['mp']['w']" in {f.path for f in findings if f.code == "grad.mismatch"}, findings


@pytest.mark.parametrize("case", ["relu", "max_tie", "abs"])
def test_kinks_at_the_point_are_not_judged(case):
    """The smallest reproductions: relu of zero rows through a zero bias, a jnp.max tie over zero rows, abs(0)."""
    x = np.random.default_rng(0).normal(size=(6, 3))
    x[3:] = 0.0  # zero-filled rows
    params = {"w": jnp.asarray(np.random.default_rng(1).normal(size=(3, 4))), "b": jnp.zeros(4)}
    loss = {
        "relu": lambda p, x: jnp.sum(jax.nn.relu(x @ p["w"] + p["b"])),
        "max_tie": lambda p, x: jnp.sum(jnp.max(x @ p["w"] + p["b"], axis=1)),
        "abs": lambda p, x: jnp.sum(jnp.abs(p["b"]) + 2.0 * p["b"]) + jnp.sum(jnp.tanh(x @ p["w"])),
    }[case]
    assert [f.path for f in check_grads(loss, params, x, kinks=False)] == ["params['b']"]
    findings = check_grads(loss, params, x)
    assert [(f.code, f.path) for f in findings] == [("grad.kink", "params['b']")], findings
    if case == "abs":  # abs'(0) = 0 plus 2 lies between the one-sided slopes 1 and 3 of every coordinate
        verdict = findings[0].extra["kinks"]["params['b']"]
        assert verdict["kinked"] == verdict["consistent"] == verdict["blocks"] == 4


def test_a_kink_through_every_coordinate_of_a_leaf_settles_after_a_few_sub_directions():
    """Every unit of a 64-wide ReLU layer sits at 0 (its pre-activation is a zero bias): each sub-direction of the
    bias crosses the kink, so probing stops after KINK_SETTLE of them, not 32 (a healthy NNX ResNet's BatchNorm
    leaves took 1024 evaluations of its loss that way); the leaf is still a grad.kink info, not judged."""
    findings = check_grads(lambda p: jnp.sum(jax.nn.relu(p["b"])) * 3.0 + 2.0 * jnp.sum(p["b"]), {"b": jnp.zeros(64)})
    assert [(f.code, f.path) for f in findings] == [("grad.kink", "params['b']")], findings
    verdict = findings[0].extra["kinks"]["params['b']"]
    assert verdict["blocks"] == verdict["kinked"] == KINK_SETTLE < KINK_BLOCKS


def test_a_wrong_rule_beside_a_kink_in_the_same_leaf_is_found_on_a_sub_direction():
    """Half of a leaf sits on a ReLU kink, the other half goes through a wrong VJP: the whole direction
    crosses the kink, its sub-directions off the kink still show the wrong rule."""

    def loss(p):
        return jnp.sum(jax.nn.relu(p["b"][:4])) * 3.0 + jnp.sum(_tanh_vjp("sign")(p["b"][4:] + 0.5))

    findings = check_grads(loss, {"b": jnp.zeros(8)})
    assert [f.code for f in findings] == ["grad.mismatch"], findings
    assert "sub-direction off a kink" in findings[0].message and findings[0].extra["kink"]["coordinates"] == 1
    # the correct rule there: the leaf is not judged, no error
    ok = lambda p: jnp.sum(jax.nn.relu(p["b"][:4])) * 3.0 + jnp.sum(_tanh_vjp(None)(p["b"][4:] + 0.5))
    assert [f.code for f in check_grads(ok, {"b": jnp.zeros(8)})] == ["grad.kink"]


def test_zero_initialised_relu_layer_is_grad_missing_across_a_kink():
    """All pre-activations exactly 0: the layer's gradient is identically 0 (relu'(0) = 0) and it never trains,
    while the output moves on one side: still grad.missing, said to be a kink rather than a stop_gradient."""
    x = np.random.default_rng(0).normal(size=(6, 3))
    v = jnp.asarray(np.random.default_rng(1).normal(size=(4,)))
    findings = check_grads(
        lambda p, x: jnp.sum(jax.nn.relu(x @ p["w"] + p["b"]) @ v), {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)}, x
    )
    assert {f.path for f in findings if f.code == "grad.missing"} == {"params['w']", "params['b']"}, findings
    assert all(f.extra.get("kink") for f in findings) and "kink" in findings[0].hint
    assert "stop_gradient" not in findings[0].hint


def test_a_layer_zeroed_further_on_is_said_not_blamed_but_an_unused_one_is_grad_missing():
    """A zero-initialised head (the MLP-Mixer/ViT recipe) or LoRA's B = 0: every leaf before it gets an exactly
    zero gradient at init, though the output reads it (an info); a layer whose output nothing reads is unused."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(6, 3)))
    params = {"body": jnp.asarray(np.random.default_rng(1).normal(size=(3, 4))), "head": jnp.zeros((4, 2))}
    findings = check_grads(lambda p, x: jnp.sum((jnp.tanh(x @ p["body"]) @ p["head"] + 1.0) ** 2), params, x)
    (f,) = [f for f in findings if f.code == "grad.missing"]
    assert f.path == "params['body']" and f.severity == "info" and f.extra["zeroed_downstream"] == [f.path], findings
    assert not [f for f in findings if f.severity == "error"], findings
    unused = check_grads(lambda p, x: jnp.sum((jnp.tanh(x @ p["body"]) + 1.0) ** 2), params, x)
    (f,) = [f for f in unused if f.code == "grad.missing" and f.path == "params['head']"]
    assert f.severity == "error" and "unused" in f.hint, unused
    # read, but always through a constant zero (an RNN whose carry is reset to zeros): no point nearby moves it
    reset = check_grads(lambda p, x: jnp.sum((jnp.zeros((6, 4)) @ p["head"] + jnp.tanh(x @ p["body"])[:, :2]) ** 2),
                        params, x)  # fmt: skip
    (f,) = [f for f in reset if f.code == "grad.missing"]
    assert f.path == "params['head']" and f.severity == "error", reset


def test_a_zeroed_layer_is_told_from_an_unused_one_with_the_given_gradient_and_no_compile_of_its_own():
    """With doctor's compiled gradient (the run's telemetry), the point nearby is differentiated by that program:
    the same verdicts as above, and the check compiles no backward pass of its own for it."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(6, 3)), jnp.float32)
    params = {"body": jnp.asarray(np.random.default_rng(1).normal(size=(3, 4)), jnp.float32), "head": jnp.zeros((4, 2))}
    kw = dict(dtype=jnp.float32, modes=("rev",))
    zeroed = lambda p, x: jnp.sum((jnp.tanh(x @ p["body"]) @ p["head"] + 1.0) ** 2)  # noqa: E731
    reset = lambda p, x: jnp.sum((jnp.zeros((6, 4)) @ p["head"] + jnp.tanh(x @ p["body"])[:, :2]) ** 2)  # noqa: E731
    for loss, path, severity in ((zeroed, "params['body']", "info"), (reset, "params['head']", "error")):
        calls = []
        gradient = jax.jit(jax.grad(loss))
        counted = lambda p, b, g=gradient: calls.append(1) or g(p, b)  # noqa: E731
        compiled = []
        listener = lambda event, _s, **kw: compiled.append(kw.get("fun_name")) if "backend_compile" in event else None  # noqa: E731
        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            findings = check_grads(loss, params, x, gradient=counted, **kw)
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
        (f,) = [f for f in findings if f.code == "grad.missing"]
        assert (f.path, f.severity) == (path, severity), findings
        assert len(calls) == 2, calls  # at the point and nearby
        assert "scalar" not in compiled, compiled  # (the check's own gradient program is named after its scalar)


def test_kink_options_are_validated():
    with pytest.raises(jaxsane.JaxsaneError, match="kink_rtol"):
        check_grads(lambda p: jnp.sum(p), jnp.ones(3), kink_rtol=-1.0)
    with pytest.raises(jaxsane.JaxsaneError, match="kinks"):
        check_grads(lambda p: jnp.sum(p), jnp.ones(3), kinks="yes")


@pytest.mark.slow
def test_big_models_are_sampled_and_say_so():
    params = {f"p{i:03d}": jnp.full((3,), 0.1 * (i + 1)) for i in range(200)}

    def loss(p):
        return sum(jnp.sum(jnp.sin(v)) for v in p.values())

    found = check_grads(loss, params, max_leaves=16)
    assert [f.code for f in found] == ["grad.sampled"]
    assert found[0].severity == "info" and found[0].extra["checked"] == 16 and found[0].extra["leaves"] == 200

    @jax.custom_vjp
    def wrong_sin(x):
        return jnp.sin(x)

    wrong_sin.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (2.0 * g * jnp.cos(x),))  # a factor 2 too many

    def bad_loss(p):
        return sum(jnp.sum(wrong_sin(v)) for v in p.values())

    codes = [f.code for f in check_grads(bad_loss, params, max_leaves=16, modes=("rev",))]
    assert codes.count("grad.mismatch") == 16 and codes[-1] == "grad.sampled"
    assert [f.code for f in check_grads(loss, {k: params[k] for k in list(params)[:20]}, max_leaves=16)] == [
        "grad.sampled"
    ]
    assert check_grads(loss, {k: params[k] for k in list(params)[:20]}, max_leaves=None) == []


# ----------------------------------------------------------------------------- float32 across ReLU kinks
def _relu_mlp_float32(seed, vjp_factor=1.0):
    """A 64-256-256-10 ReLU MLP on digits checked in float32 (dtype=None: no float64 promotion), with a
    hand-written VJP on its last hidden activations that multiplies the cotangent by ``vjp_factor`` (1: correct;
    -1: a flipped sign; 0.5: a missing factor)."""
    from jaxsane.examples._digits import load_digits_split

    x, y, _, _ = load_digits_split()
    batch = {"x": jnp.asarray(x[:64]), "y": jnp.asarray(y[:64])}
    key, params = jax.random.key(seed), []
    for a, b in zip((64, 256, 256), (256, 256, 10)):
        key, sub = jax.random.split(key)
        params.append({"w": jax.random.normal(sub, (a, b)) * (2 / a) ** 0.5, "b": jnp.full((b,), 0.01)})

    @jax.custom_vjp
    def identity(h):
        return h

    identity.defvjp(lambda h: (h, None), lambda _, g: (vjp_factor * g,))

    def loss(ps, b):
        h = b["x"]
        for p in ps[:-1]:
            h = jax.nn.relu(h @ p["w"] + p["b"])
        logits = identity(h) @ ps[-1]["w"] + ps[-1]["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    return loss, params, batch


@pytest.mark.parametrize("seed", [1, pytest.param(0, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_float32_quotients_across_relu_kinks_are_no_mismatch(seed):
    loss, params, batch = _relu_mlp_float32(seed)  # seed 1 gave a false grad.mismatch on params[1]['w']
    findings = check_grads(loss, params, batch, dtype=None, seed=seed)
    assert not [f for f in findings if f.code == "grad.mismatch"], [str(f) for f in findings]


@pytest.mark.parametrize("factor", [-1.0, 0.5], ids=["flipped_sign", "missing_factor"])
def test_a_wrong_custom_vjp_is_still_a_mismatch_in_float32(factor):
    loss, params, batch = _relu_mlp_float32(1, vjp_factor=factor)
    findings = check_grads(loss, params, batch, dtype=None, seed=1)
    mismatched = [f for f in findings if f.code == "grad.mismatch"]
    assert mismatched and all("float32" in f.message for f in mismatched), [str(f) for f in findings]


def test_check_grads_takes_reverse_mode_from_a_given_gradient_and_only_there():
    def loss(p, x):
        return jnp.sum(jnp.tanh(x @ p["w"]) ** 2)

    params = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(3, 2)), jnp.float32)}
    x = jnp.asarray(np.random.default_rng(1).normal(size=(5, 3)), jnp.float32)
    right = jax.jit(jax.grad(loss))
    wrong = jax.jit(lambda p, b: jax.tree_util.tree_map(lambda g: 2.0 * g, jax.grad(loss)(p, b)))
    kw = dict(dtype=jnp.float32, modes=("rev",))
    assert jaxsane.check_grads(loss, params, x, gradient=right, **kw) == []
    found = jaxsane.check_grads(loss, params, x, gradient=wrong, **kw)
    assert [f.code for f in found] == ["grad.mismatch"], [str(f) for f in found]
    # forward mode, or more than the first argument, differentiates on its own: the given gradient is not used
    assert jaxsane.check_grads(loss, params, x, gradient=wrong, dtype=jnp.float32) == []
    assert jaxsane.check_grads(loss, params, x, gradient=wrong, argnums=(0, 1), **kw) == []


def test_a_sub_direction_off_a_kink_disagrees_only_beyond_its_round_off():
    """An unnormalised regression's loss is about 3e9: its float64 difference quotients carry ~0.5 of round-off at
    a step of 1e-6, more than a 1e-5 tolerance of a slope of 8654. The sub-directions probed off a kink disagree
    only by more than that (a correct MLP on raw prices drew a false grad.mismatch); without it they would."""
    from jaxsane._checks.grads_kink import probe_sub_directions

    direction = np.ones(8)
    grad = np.full(8, 8654.6 / 8)  # autodiff: 0.1 above the true slope along the whole direction, inside round-off

    def value_along(sub, t):
        return np.float64(3e9) + np.float64(8654.5 / 8) * np.sum(sub) * np.float64(t)

    def probe(eps):
        return probe_sub_directions(value_along, grad, direction, np.random.default_rng(0), (1e-6, 1e-4), 0.0, 0.0,
                                    1e-5, 1e-5, 1e-3, blocks=4, machine_eps=eps)  # fmt: skip

    assert probe(float(np.finfo(np.float64).eps)).wrong is None
    assert probe(0.0).wrong is not None, "the round-off is what keeps them apart"


def test_batchnorm_running_statistics_passed_with_the_params_are_not_checked():
    """Flax's variables dict as the parameters ({"params", "batch_stats"}): the training-mode loss never reads the
    running means and variances (the step updates them by their own rule), so they are no grad.missing."""
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            x = nn.Dense(8)(x)
            x = nn.BatchNorm(use_running_average=not train)(x)
            return nn.Dense(3)(nn.relu(x))

    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    variables = Net().init(jax.random.key(0), x, train=False)

    def loss(v, x):
        out, _ = Net().apply(v, x, train=True, mutable=["batch_stats"])
        return jnp.mean(out**2)

    found = jaxsane.check_grads(loss, dict(variables), x)
    assert not [f for f in found if f.code == "grad.missing"], [str(f) for f in found]
    unused = dict(variables, params={**variables["params"], "unused": jnp.ones(3)})
    assert [f.path for f in jaxsane.check_grads(loss, unused, x) if f.code == "grad.missing"] == [
        "params['params']['unused']"
    ]


def test_a_jump_that_grows_as_the_step_shrinks_is_round_off_not_a_kink():
    """A float32 loss summed over many terms (a VAE's 550) carries round-off that makes the one-sided quotients
    differ by c / h: 0.55 at a step of 1e-3, 10.4 at 1e-4 there, and 11 of its leaves were called kinks (each
    probed in 32 sub-directions). A kink at the point makes the same jump at every step and stays one."""
    from jaxsane._checks.grads_kink import kink_at_every_step

    def round_off_like(t):  # slope 0.5 and a jump of 2e-4 between t = 0 and any t != 0: R - L = 4e-4 / h
        t = float(t)
        return np.float64(0.5 * t + (2e-4 if t != 0.0 else 0.0))

    def kink(t):  # |t| + 0.5 t: R - L = 2 at every step
        t = float(t)
        return np.float64(abs(t) + 0.5 * t)

    steps = (1e-3, 1e-4)
    assert not kink_at_every_step(round_off_like, steps, 0.5, 1e-3, 0.02)[0]
    assert kink_at_every_step(kink, steps, 0.5, 1e-3, 0.02)[0]


def test_leaves_the_loss_ignores_are_differenced_together_and_a_rounded_one_still_alone(monkeypatch):
    """Leaves with an identically zero gradient are differenced together first (two evaluations for them all): a
    zero-initialised head's body leaves, bitwise ignored, give the findings they gave one by one; a rounded leaf
    among them (zero gradient, yet the loss moves) sends every leaf back to its own differences and stays an
    error."""
    from jaxsane._checks.grads_leaf import LeafJudge

    together = []
    real = LeafJudge.unmoved_together
    monkeypatch.setattr(LeafJudge, "unmoved_together", lambda self, js: together.append(real(self, js)) or together[-1])
    x = jnp.asarray(np.random.default_rng(0).normal(size=(6, 3)))
    rng = np.random.default_rng(1)
    params = {f"body{i}": jnp.asarray(rng.normal(size=(3, 3))) for i in range(3)} | {"head": jnp.zeros((3, 2))}

    def zero_head(p, x):
        h = x
        for i in range(3):
            h = jnp.tanh(h @ p[f"body{i}"])
        return jnp.sum((h @ p["head"] + 1.0) ** 2)

    def rounded(p, x):  # BUG: the rounding has no gradient; body2 is unused
        return jnp.sum(jnp.tanh(x @ jnp.round(p["body0"] * 1e8) / 1e8) ** 2) + jnp.sum(x @ p["body1"]) * 0.0

    for loss, expected in ((zero_head, [True]), (rounded, [False])):
        together.clear()
        findings = check_grads(loss, params, x)
        assert together == expected, (loss.__name__, together)
        monkeypatch.setattr(LeafJudge, "unmoved_together", lambda self, js: False)  # one by one, as before
        alone = check_grads(loss, params, x)
        monkeypatch.setattr(LeafJudge, "unmoved_together", lambda self, js: together.append(real(self, js)) or together[-1])
        assert [(f.code, f.path, f.severity) for f in findings] == [(f.code, f.path, f.severity) for f in alone]
    missing = {f.path: f for f in findings if f.code == "grad.missing"}
    assert missing["params['body0']"].severity == "error" and missing["params['body0']"].extra["depends"], findings


def test_a_check_in_the_arguments_precision_reads_them_without_a_copy_and_a_replicated_one_on_one_device():
    # a large model's float32 check: a copy of every float32 parameter was host memory the user's run never holds
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxsane._checks.grads import _cast_host

    x = jnp.ones((4, 3), jnp.float32)
    assert _cast_host(x, jnp.float32, shared=True) is x
    assert _cast_host(x, jnp.float32) is not x  # (a batch: the user's step may donate it beside the check)
    with jax.enable_x64(True):  # (as the check's own float64 pass runs)
        assert _cast_host(x, jnp.float64, shared=True).dtype == jnp.float64
    if len(jax.devices()) > 1:  # replicated over a mesh: checked once, on one device, not on every replica
        spread = jax.device_put(x, NamedSharding(Mesh(np.array(jax.devices()), ("d",)), P()))
        assert len(_cast_host(spread, jnp.float32, shared=True).sharding.device_set) == 1
