"""Every stage understands the models people write (issue 14): NNX train/eval modes, init.loss only
for C-way classifiers, masked NaN labels, batches that are not "leading axis = example", recurrent
cells in the float64 gradient check, and steps that return only the state. Each check has a faulty
and a healthy case."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _programs import optax_step_of

import jaxsane
from jaxsane._checks.init_loss import classification_of
from jaxsane._core.errors import ExampleAxisError, ExperimentError
from jaxsane._experiment.batches import count_examples, slice_examples
from jaxsane._experiment.contract import PureExperiment
from jaxsane._monitor.monitor import Monitor

pytestmark = pytest.mark.slow


def _codes(diagnosis):
    return [f.code for f in diagnosis]


def _mlp_init(sizes, key=0):
    keys = jax.random.split(jax.random.key(key), len(sizes))
    return [{"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
            for k, a, b in zip(keys, sizes[:-1], sizes[1:])]


def _mlp(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


_optax_step = optax_step_of


# ----------------------------------------------------------------------------- 1. NNX modes
def _nnx_experiment():
    from flax import nnx

    class Net(nnx.Module):  # mode never set by init: MHA(dropout_rate>0) has deterministic=None
        def __init__(self, rngs):
            self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=8, decode=False,
                                               dropout_rate=0.5, rngs=rngs)
            self.norm = nnx.BatchNorm(8, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.head = nnx.Linear(8, 3, rngs=rngs)

        def __call__(self, x):
            h = self.norm(x + self.attn(x))
            return self.head(self.drop(h)).mean(1)

    def init(key):
        model = Net(nnx.Rngs(params=key, dropout=jax.random.fold_in(key, 1)))
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    def loss(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()

    @nnx.jit
    def step(model, opt, batch):
        model.train()  # the mode is set only inside the user's step
        value, grads = nnx.value_and_grad(loss)(model, batch)
        opt.update(model, grads)
        return value

    x = np.random.default_rng(0).standard_normal((4, 5, 8)).astype(np.float32)
    batch = {"x": x, "y": np.array([0, 1, 2, 0], np.int32)}
    return jaxsane.Experiment(init=init, step=step, train=batch, loss=loss, apply=lambda m, x: m(x), num_classes=3)


def test_nnx_handles_fill_unset_modes_on_copies():
    exp = _nnx_experiment()
    adapted = PureExperiment(exp)
    state = adapted.init(jax.random.key(0))
    params, batch = adapted.params(state), exp.train
    model, _ = adapted.user_state(state)
    with pytest.raises(Exception, match="deterministic"):  # the user's own object, as left by init: unusable
        model.attn(batch["x"])
    train_loss = float(jax.jit(adapted.loss_fn)(params, batch))
    eval_out = jax.jit(adapted.apply_fn)(params, batch["x"])
    # apply fills only the flag the user left unset (attention's deterministic) with eval mode; the flags their
    # layers set themselves (Dropout's and BatchNorm's defaults) are theirs: a forgotten model.eval() stays visible
    model.attn.deterministic = True
    assert np.allclose(eval_out, model(batch["x"]), atol=1e-5)
    model.eval()  # the same model fully in eval mode by hand: the loss handle (training mode) must differ
    eval_loss = float(exp.loss(model, batch))
    assert np.isfinite(train_loss) and abs(train_loss - eval_loss) > 1e-4  # dropout / batch stats in train
    model2, _ = adapted.user_state(adapted.init(jax.random.key(0)))
    assert model2.attn.deterministic is None and model2.drop.deterministic is False  # never mutated


def test_nnx_doctor_stages_do_not_crash_on_unset_modes():
    d = jaxsane.doctor(_nnx_experiment(), stages=["init", "grads", "batch"], progress=False)
    assert "doctor.user_code_crashed" not in _codes(d)
    assert not [f for f in d if f.code.startswith("grad.")]


# ----------------------------------------------------------------------------- 2. init.loss
def _classifier_like(out_width, labels, scale=1.0):
    x = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    params = _mlp_init((8, 16, out_width))
    params[-1]["w"] = params[-1]["w"] * scale
    tx = optax.sgd(1e-2)
    ce = labels.dtype.kind == "i" and labels.ndim == 1
    loss = ((lambda p, b: optax.softmax_cross_entropy_with_integer_labels(_mlp(p, b["x"]), b["y"]).mean()) if ce
            else (lambda p, b: jnp.mean((_mlp(p, b["x"]) - b["y"]) ** 2)))
    return jaxsane.Experiment(init=lambda k: (params, tx.init(params)), step=_optax_step(loss, tx),
                              train={"x": x, "y": labels}, loss=loss, apply=_mlp)


@pytest.mark.parametrize("kind", ["regression", "multilabel", "reconstruction"])
def test_init_loss_is_not_compared_with_ln_width_for_non_classifiers(kind):
    rng = np.random.default_rng(1)
    labels = {"regression": rng.standard_normal((64, 3)).astype(np.float32) * 10,
              "multilabel": (rng.random((64, 16)) < 0.5).astype(np.int32),
              "reconstruction": rng.random((64, 8)).astype(np.float32)}[kind]
    exp = _classifier_like(labels.shape[1], labels)
    adapted = PureExperiment(exp)
    c, why = classification_of(adapted, adapted.init(jax.random.key(0)), exp.train)
    assert c is None and ("classification" in why or "cross-entropy" in why)
    d = jaxsane.doctor(exp, stages=["init"], progress=False)
    assert "init.loss" not in _codes(d)  # compared with the best constant prediction instead, and close to it
    baseline = d.artifacts["init_loss"]
    assert 0 < baseline["constant_loss"] < baseline["loss"] < 30 * baseline["constant_loss"]


def _regression(out_scale=1.0, target_scale=1.0, loss="mse", labels=None, stochastic=False):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, 8)).astype(np.float32)
    y = (np.tanh(x @ rng.standard_normal((8, 3)).astype(np.float32) / 3) * target_scale if labels is None
         else labels)
    params = _mlp_init((8, 32, y.shape[1]))
    params[-1]["w"] = params[-1]["w"] * out_scale
    per = {"mse": lambda o, t: (o - t) ** 2, "mae": lambda o, t: jnp.abs(o - t),
           "bce": optax.sigmoid_binary_cross_entropy}[loss]

    def loss_fn(p, b):
        x = b["x"]
        if stochastic:  # input noise the loss draws and apply does not: the model's outputs are not apply's
            x = x + 0.1 * jax.random.normal(jax.random.key(0), x.shape)
        return jnp.mean(per(_mlp(p, x), b["y"]))

    tx = optax.sgd(1e-2)
    return jaxsane.Experiment(init=lambda k: (params, tx.init(params)), step=_optax_step(loss_fn, tx),
                              train={"x": x, "y": y}, loss=loss_fn, apply=_mlp)


@pytest.mark.parametrize("loss,out_scale,target_scale", [("mse", 100.0, 1.0), ("mse", 1.0, 0.01), ("mae", 100.0, 1.0),
                                                         ("bce", 100.0, 1.0)])
def test_init_loss_fires_when_outputs_are_at_the_wrong_scale_for_the_targets(loss, out_scale, target_scale):
    labels = ((np.random.default_rng(3).random((64, 16)) < 0.3).astype(np.float32) if loss == "bce" else None)
    d = jaxsane.doctor(_regression(out_scale, target_scale, loss, labels), stages=["init"], progress=False)
    (found,) = [f for f in d if f.code == "init.loss"]
    assert found.severity == "warning" and "best constant prediction" in found.message
    assert found.extra["loss"] > 30 * found.extra["constant_loss"] > 0


@pytest.mark.parametrize("loss,frequency", [("mse", None), ("mae", None), ("bce", 0.3), ("bce", 0.01)])
def test_init_loss_is_quiet_on_healthy_regression_and_multilabel(loss, frequency):
    labels = (None if frequency is None else
              (np.random.default_rng(3).random((64, 16)) < frequency).astype(np.float32))
    d = jaxsane.doctor(_regression(loss=loss, labels=labels), stages=["init"], progress=False)
    assert "init.loss" not in _codes(d) and "doctor.skipped" not in _codes(d)
    baseline = d.artifacts["init_loss"]
    if loss == "mse":  # the best constant of an MSE is the mean target: its loss is the targets' variance
        y = _regression().train["y"]
        assert baseline["constant_loss"] == pytest.approx(float(np.var(y, axis=0).mean()), rel=1e-3)


def test_init_loss_vs_constant_skips_with_the_reason_when_the_loss_draws_its_own_noise():
    d = jaxsane.doctor(_regression(out_scale=100.0, stochastic=True), stages=["init"], progress=False)
    assert "init.loss" not in _codes(d)
    assert any(f.code == "doctor.skipped" and "not a value of the loss's forward pass" in f.message for f in d)


def test_init_loss_still_judges_c_way_classifiers():
    labels = np.random.default_rng(1).integers(0, 10, 64).astype(np.int32)
    healthy = _classifier_like(10, labels, scale=0.1)
    assert classification_of(PureExperiment(healthy), PureExperiment(healthy).init(jax.random.key(0)), healthy.train)[0] == 10
    assert "init.loss" not in _codes(jaxsane.doctor(healthy, stages=["init"], progress=False))
    overconfident = _classifier_like(10, labels, scale=100.0)
    assert "init.loss" in _codes(jaxsane.doctor(overconfident, stages=["init"], progress=False))


# ----------------------------------------------------------------------------- 3. masked NaN labels
def _nan_label_experiment(masked):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    y = x @ np.ones((4, 2), np.float32)
    y[::5, 1] = np.nan  # OGB style: NaN marks a missing label

    def loss(params, batch):
        err = _mlp(params, batch["x"]) - batch["y"]
        if masked:
            known = jnp.isfinite(batch["y"])
            return jnp.sum(jnp.where(known, err, 0.0) ** 2) / jnp.sum(known)
        return jnp.mean(err ** 2)

    params = _mlp_init((4, 8, 2))
    tx = optax.adam(1e-2)
    return jaxsane.Experiment(init=lambda k: (params, tx.init(params)), step=_optax_step(loss, tx),
                              train={"x": x, "y": y}, loss=loss, apply=_mlp)


def test_masked_nan_labels_are_not_an_input_error():
    d = jaxsane.doctor(_nan_label_experiment(masked=True), stages=["data", "run"], run_steps=5, progress=False)
    assert "nonfinite.input" not in _codes(d) and "data.masked_nonfinite" in _codes(d)
    assert not [f for f in d if f.severity == "error"]


def test_nan_labels_that_reach_the_loss_stay_errors():
    d = jaxsane.doctor(_nan_label_experiment(masked=False), stages=["data"], progress=False)
    assert "nonfinite.input" in _codes(d) and "data.masked_nonfinite" not in _codes(d)


def test_guard_reports_input_nan_only_when_an_output_is_nonfinite():
    exp = _nan_label_experiment(masked=True)
    state = exp.init(jax.random.key(0))
    guarded = jaxsane.guard(exp.step, sync=True, locate=False)
    state, metrics = guarded(state, exp.train)
    assert np.isfinite(float(metrics["loss"]))
    bad = _nan_label_experiment(masked=False)
    with pytest.raises(jaxsane.NonFiniteError) as info:
        jaxsane.guard(bad.step, sync=True, locate=False)(bad.init(jax.random.key(0)), bad.train)
    assert info.value.finding.code == "nonfinite.input"


# ----------------------------------------------------------------------------- 4. what an example is
def _graph_batch(num_graphs=8, seed=0):
    rng = np.random.default_rng(seed)
    n_node = rng.integers(3, 6, num_graphs)
    senders, receivers, offset = [], [], 0
    for n in n_node:
        s = np.arange(n)
        senders.append(s + offset); receivers.append((s + 1) % n + offset); offset += n
    senders, receivers = np.concatenate(senders), np.concatenate(receivers)
    return {"nodes": rng.standard_normal((offset, 4)).astype(np.float32),
            "edges": np.ones((len(senders), 1), np.float32), "senders": senders.astype(np.int32),
            "receivers": receivers.astype(np.int32), "n_node": n_node.astype(np.int32),
            "n_edge": n_node.astype(np.int32), "labels": rng.integers(0, 2, num_graphs).astype(np.int32)}


def _take_graphs(batch, n):
    nn_, ne = int(batch["n_node"][:n].sum()), int(batch["n_edge"][:n].sum())
    return {"nodes": batch["nodes"][:nn_], "edges": batch["edges"][:ne], "senders": batch["senders"][:ne],
            "receivers": batch["receivers"][:ne], "n_node": batch["n_node"][:n], "n_edge": batch["n_edge"][:n],
            "labels": batch["labels"][:n]}


def _graph_experiment(examples=None):
    def apply(params, g):
        num_nodes, num_graphs = g["nodes"].shape[0], g["n_node"].shape[0]
        msg = jax.ops.segment_sum(g["nodes"][g["senders"]], g["receivers"], num_nodes)
        h = jax.nn.relu(jnp.concatenate([g["nodes"], msg], -1) @ params[0]["w"] + params[0]["b"])
        seg = jnp.repeat(jnp.arange(num_graphs), g["n_node"], total_repeat_length=num_nodes)
        return jax.ops.segment_sum(h, seg, num_graphs) @ params[1]["w"] + params[1]["b"]

    loss = lambda p, b: optax.softmax_cross_entropy_with_integer_labels(apply(p, b), b["labels"]).mean()
    params = _mlp_init((8, 16, 2))
    tx = optax.adam(1e-2)
    return jaxsane.Experiment(init=lambda k: (params, tx.init(params)), step=_optax_step(loss, tx),
                              train=_graph_batch(), loss=loss, apply=apply, inputs=lambda b: b,
                              labels=lambda b: b["labels"], num_classes=2, examples=examples)


def test_graph_batches_are_never_sliced_along_the_node_axis():
    exp = _graph_experiment()
    with pytest.raises(ExampleAxisError, match=r"\[jaxsane\].*leading axis"):
        slice_examples(exp, exp.train, 4)
    assert count_examples(exp, exp.train) == 8  # the graph labels, not the nodes
    d = jaxsane.doctor(exp, stages=["data", "batch", "overfit"], progress=False)
    skipped = {f.message.split(" ")[0] for f in d if f.code == "doctor.skipped"}
    assert {"data", "batch", "overfit"} <= skipped
    assert not [f for f in d if f.severity == "error"]


def test_examples_option_cuts_graphs_and_the_overfit_stage_uses_it():
    exp = _graph_experiment(examples=_take_graphs)
    cut = slice_examples(exp, exp.train, 3)
    assert cut["labels"].shape == (3,) and cut["nodes"].shape[0] == int(exp.train["n_node"][:3].sum())
    d = jaxsane.doctor(exp, stages=["overfit"], overfit_steps=60, progress=False)
    assert not [f for f in d if f.code == "doctor.skipped" and f.message.startswith("overfit")]
    assert d.artifacts["overfit"].batch_size == 8  # 8 graphs (all of them: 16 were asked for), not nodes
    plain = jaxsane.Experiment(init=exp.init, step=exp.step, train={"x": np.ones((6, 2)), "y": np.zeros(6)})
    assert slice_examples(plain, plain.train, 2)["x"].shape == (2, 2)  # leading axis = example: sliced
    with pytest.raises(ExperimentError, match="examples"):
        jaxsane.Experiment(init=exp.init, step=exp.step, train=exp.train, examples="graphs")


# ----------------------------------------------------------------------------- 5. recurrent float64 grads
def _lstm_loss():
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.RNN(nn.LSTMCell(6))(x)[:, -1])

    model = Net()
    x = np.random.default_rng(0).standard_normal((4, 5, 3)).astype(np.float32)
    y = np.array([0, 1, 2, 1])
    params = model.init(jax.random.key(0), x)["params"]
    loss = lambda p, xb: optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, xb), y).mean()
    return loss, params, x


def test_float64_grad_check_runs_through_a_linen_lstm():
    loss, params, x = _lstm_loss()
    assert jaxsane.check_grads(loss, params, x) == []


def test_float64_grad_check_on_a_recurrent_model_still_finds_a_frozen_leaf():
    loss, params, x = _lstm_loss()
    frozen = lambda p, xb: loss(jax.tree_util.tree_map_with_path(
        lambda path, v: jax.lax.stop_gradient(v) if "Dense_0" in jax.tree_util.keystr(path) else v, p), xb)
    found = jaxsane.check_grads(frozen, params, x)
    assert found and all(f.code == "grad.missing" for f in found) and "Dense_0" in found[0].path
    assert "precision" in found[0].extra  # says it was checked as written (float32 carry), not in float64


# ----------------------------------------------------------------------------- 6. state-only steps
def _state_only_experiment(lr):
    x = np.random.default_rng(0).standard_normal((64, 4)).astype(np.float32)
    batch = {"x": x, "y": x @ np.ones((4, 1), np.float32)}
    loss = lambda p, b: jnp.mean((_mlp(p, b["x"]) - b["y"]) ** 2)
    tx = optax.sgd(lr)

    @jax.jit
    def step(state, b):  # returns only the new state: no loss metric
        params, opt_state = state
        grads = jax.grad(loss)(params, b)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = _mlp_init((4, 16, 1))
    return jaxsane.Experiment(init=lambda k: (params, tx.init(params)), step=step, train=batch, loss=loss)


def test_state_only_step_is_judged_on_experiment_loss():
    healthy = _state_only_experiment(0.05)
    adapted = PureExperiment(healthy)
    mon = Monitor(adapted, every=1, dead_every=0)
    state = adapted.init(jax.random.key(0))
    for i in range(3):
        state, metrics = mon.step(state, healthy.train, mon.mode_for(i))
        mon.record(i, metrics)
    losses = mon.pull().loss
    assert len(losses) == 3 and np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    d = jaxsane.doctor(healthy, stages=["run"], run_steps=20, progress=False)
    assert not [f for f in d if f.code.startswith("train.") and f.severity == "error"]
    ascent = _state_only_experiment(-0.5)  # gradient ascent: the loss rises, and only the loss handle shows it
    d = jaxsane.doctor(ascent, stages=["run"], run_steps=20, progress=False)
    assert {"train.diverging", "nonfinite.forward", "nonfinite.update"} & set(_codes(d))


def test_examples_that_only_count_never_slice():
    exp = _graph_experiment(examples=lambda batch: len(batch["labels"]))
    assert count_examples(exp, exp.train) == 8
    with pytest.raises(ExampleAxisError, match="counts examples"):
        slice_examples(exp, exp.train, 2)
    assert slice_examples(exp, exp.train, 2, whole=True) is exp.train  # the gradient check takes it whole


def test_a_per_batch_table_beside_the_examples_does_not_stop_slicing():
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((32, 4)).astype(np.float32), "y": rng.integers(0, 3, 32).astype(np.int32),
             "class_weights": np.ones(3, np.float32)}  # [C], not per example
    loss = lambda p, b: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(_mlp(p, b["x"]), b["y"])
                                 * b["class_weights"][b["y"]])
    params = _mlp_init((4, 8, 3))
    tx = optax.adam(1e-2)
    exp = jaxsane.Experiment(init=lambda k: (params, tx.init(params)), step=_optax_step(loss, tx), train=batch,
                             loss=loss, apply=_mlp, num_classes=3)
    cut = slice_examples(exp, batch, 8)
    assert cut["x"].shape == (8, 4) and cut["class_weights"].shape == (3,)
    d = jaxsane.doctor(exp, stages=["batch", "overfit"], overfit_steps=30, progress=False)
    assert not [f for f in d if f.code == "doctor.skipped"] and d.artifacts["overfit"].batch_size == 16


# ----------------------------------------------------------------------------- graph batches: cross talk
def test_graph_batches_cut_by_examples_are_checked_for_cross_talk():
    from benchmarks.faults import c43_healthy_graph, f65_graph_wrong_segments

    healthy = jaxsane.doctor(c43_healthy_graph.experiment(), stages=["batch"], progress=False)
    assert not [f for f in healthy if f.code in ("batch.cross_talk", "doctor.skipped")]
    leaking = jaxsane.doctor(f65_graph_wrong_segments.experiment(), stages=["batch"], progress=False)
    (found,) = [f for f in leaking if f.code == "batch.cross_talk"]
    assert found.severity == "error" and "Experiment.examples" in found.message and found.extra["examples"]


def _node_graph(n=60, e=240, classes=3, seed=0):
    """One graph for node classification, full batch: node features and labels are the rows, the senders and
    receivers (integer arrays of another length) index into them."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n).astype(np.int32)
    x = (np.eye(classes)[y] @ rng.normal(size=(classes, 8)) + rng.normal(size=(n, 8))).astype(np.float32)
    src = rng.integers(0, n, e)
    return {"x": x, "y": y, "senders": src.astype(np.int32), "receivers": rng.integers(0, n, e).astype(np.int32)}


def _gcn_experiment(graph):
    n = graph["x"].shape[0]

    def apply(p, g):
        agg = jax.ops.segment_sum(g["x"][g["senders"]] @ p["w1"], g["receivers"], num_segments=n)
        return jax.nn.relu(g["x"] @ p["w1"] + agg) @ p["w2"]

    def loss(p, g):
        return optax.softmax_cross_entropy_with_integer_labels(apply(p, g), g["y"]).mean()

    tx = optax.adam(1e-2)

    def init(key):
        k1, k2 = jax.random.split(key)
        p = {"w1": jax.random.normal(k1, (8, 16)) / 3, "w2": jax.random.normal(k2, (16, 3)) / 4}
        return p, tx.init(p)

    @jax.jit
    def step(s, g):
        value, grads = jax.value_and_grad(loss)(s[0], g)
        updates, opt = tx.update(grads, s[1], s[0])
        return (optax.apply_updates(s[0], updates), opt), {"loss": value}

    return jaxsane.Experiment(init=init, step=step, train=[graph], loss=loss, name="gcn")  # "x", "y": the rows


def test_a_full_batch_graph_whose_rows_are_nodes_is_not_cut_and_gets_no_false_error():
    """Node features and labels agree on the leading axis; the edge index arrays do not. Taking some nodes would
    leave the edges pointing at nodes that are gone (the user's code then crashes or reads clamped indices), so
    doctor cuts nothing, says why, and finds no error; a float table beside the examples is no index array."""
    graph = _node_graph()
    exp = _gcn_experiment(graph)
    with pytest.raises(ExampleAxisError, match="index arrays"):
        slice_examples(exp, graph, 4)
    d = jaxsane.doctor(exp, progress=False, overfit_steps=60, run_steps=10)
    assert not [f for f in d if f.severity in ("error", "warning")], d
    skipped = " ".join(f.message for f in d if f.code == "doctor.skipped")
    assert "overfit sweep not run" in skipped and "senders" in skipped, skipped
    weighted = {"x": np.ones((6, 2), np.float32), "y": np.zeros(6, np.int32), "w": np.ones(3, np.float32)}
    plain = jaxsane.Experiment(init=exp.init, step=exp.step, train=weighted)
    assert slice_examples(plain, weighted, 2)["x"].shape == (2, 2)  # class weights [C] beside: still cut


def test_the_parameters_of_a_trainstate_and_rng_tuple_are_the_trainstates():
    from flax.training import train_state

    def init(key):
        params = {"w": jax.random.normal(key, (4, 2))}
        return train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1)), jax.random.key(1)

    def loss(params, batch):  # as a (TrainState, rng) program writes it: the TrainState's params
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

    @jax.jit
    def step(state, batch):
        ts, key = state
        value, grads = jax.value_and_grad(loss)(ts.params, batch)
        return (ts.apply_gradients(grads=grads), jax.random.split(key)[0]), {"loss": value}

    batch = {"x": np.ones((8, 4), np.float32), "y": np.zeros((8, 2), np.float32)}
    exp = jaxsane.Experiment(init=init, step=step, train=batch, loss=loss)
    adapted = PureExperiment(exp)
    state = adapted.init(jax.random.key(0))
    assert adapted.params(state) is state[0].params
    assert float(adapted.loss_fn(adapted.params(state), batch)) > 0
    d = jaxsane.doctor(exp, stages=["init", "grads"], progress=False)
    assert not [f for f in d if f.code == "doctor.user_code_crashed"], d
