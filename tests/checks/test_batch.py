"""Batch independence: a softmax or mean over the batch axis, or BatchNorm left on batch statistics,
is named by example pairs; eval-mode BatchNorm and per-example models stay silent."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _programs import nnx_classifier_experiment, optax_step_of
from flax import nnx

import jaxsane
from jaxsane import check_batch_independence
from jaxsane.testing import CheckFailed, assert_batch_independent

X = np.random.default_rng(0).normal(size=(8, 5)).astype(np.float32)
Y = (np.arange(8) % 3).astype(np.int32)
W = jnp.asarray(np.random.default_rng(1).normal(size=(5, 3)).astype(np.float32))


def test_softmax_over_the_batch_axis_is_cross_talk():
    apply = lambda p, x: jax.nn.softmax(x @ p, axis=0)  # BUG: normalises over examples, not classes
    findings = check_batch_independence(apply, W, X)
    assert [f.code for f in findings] == ["batch.cross_talk"]
    pairs = {(i, j) for i, j, _ in findings[0].extra["pairs"]}
    assert {(0, j) for j in range(1, 8)} <= pairs and {(7, j) for j in range(7)} <= pairs
    assert "axis" in findings[0].hint and "output 0 <- input" in findings[0].message


def test_a_single_leaking_pair_is_named():
    def apply(p, x):  # BUG: example 3 gets a bit of example 0 (a wrong roll/reshape in disguise)
        return (x + 0.5 * jnp.zeros_like(x).at[3].set(x[0])) @ p

    findings = check_batch_independence(apply, W, X, probes=[3, 5])
    assert [(i, j) for i, j, _ in findings[0].extra["pairs"]] == [(3, 0)]
    assert findings[0].path == "example 3 <- example 0"


@pytest.mark.slow
def test_per_example_model_is_silent_and_assert_helper():
    apply = lambda p, x: jax.nn.softmax(jnp.tanh(x @ p), axis=-1)
    assert check_batch_independence(apply, W, X, probes=4) == []
    assert_batch_independent(apply, W, X)
    with pytest.raises(CheckFailed, match="batch.cross_talk"):
        assert_batch_independent(lambda p, x: (x - x.mean(0)) @ p, W, X)  # BUG: centring over the batch


class _BN(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        h = nn.Dense(6)(x)
        h = nn.BatchNorm(use_running_average=not train)(h)
        return nn.Dense(3)(nn.relu(h))


@pytest.mark.slow
def test_linen_batchnorm_eval_mode_is_silent_train_mode_is_not():
    """BatchNorm trains on batch statistics (that is not a bug); apply in eval mode must not."""
    model = _BN()
    variables = model.init(jax.random.key(0), X, train=False)
    tx = optax.adam(1e-2)

    def init(key):
        v = model.init(key, X, train=False)
        return {"params": v["params"], "batch_stats": v["batch_stats"]}, tx.init(v["params"])

    @jax.jit
    def step(state, batch):
        (variables, opt_state) = state

        def loss(p):
            logits, upd = model.apply(
                {"params": p, "batch_stats": variables["batch_stats"]}, batch["x"], train=True, mutable=["batch_stats"]
            )
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), upd

        (value, upd), grads = jax.value_and_grad(loss, has_aux=True)(variables["params"])
        updates, opt_state = tx.update(grads, opt_state)
        return ({"params": optax.apply_updates(variables["params"], updates), **upd}, opt_state), {"loss": value}

    def apply_eval(params, x):
        return model.apply({"params": params, "batch_stats": variables["batch_stats"]}, x, train=False)

    exp = jaxsane.Experiment(
        init=init, step=step, train={"x": X, "y": Y}, apply=apply_eval, params=lambda s: s[0]["params"], num_classes=3
    )
    diagnosis = jaxsane.doctor(exp, stages=["batch"], progress=False)
    assert list(diagnosis) == []

    def apply_train(params, x):  # BUG: batch statistics at evaluation
        return model.apply(
            {"params": params, "batch_stats": variables["batch_stats"]}, x, train=True, mutable=["batch_stats"]
        )[0]

    assert [f.code for f in check_batch_independence(apply_train, variables["params"], X)] == ["batch.cross_talk"]


class _NNXBN(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(5, 6, rngs=rngs)
        self.bn = nnx.BatchNorm(6, rngs=rngs)
        self.out = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.bn(self.l1(x))))


def _nnx_experiment(apply):
    return nnx_classifier_experiment(_NNXBN, X, Y, lr=1e-2, apply=apply, num_classes=3)


def _eval_apply(model, x):
    model.eval()
    out = model(x)
    model.train()
    return out


@pytest.mark.slow
def test_nnx_batchnorm_without_eval_is_cross_talk_in_doctor():
    diagnosis = jaxsane.doctor(_nnx_experiment(lambda m, x: m(x)), stages=["batch"], progress=False)
    assert diagnosis.codes == ["batch.cross_talk"], diagnosis
    clean = jaxsane.doctor(_nnx_experiment(_eval_apply), stages=["batch"], progress=False)
    assert list(clean) == [], clean


def test_integer_inputs_are_probed_forward():
    table = jnp.asarray(np.random.default_rng(2).normal(size=(20, 4)).astype(np.float32))
    tokens = np.random.default_rng(3).integers(0, 20, size=(6, 7)).astype(np.int32)
    per_example = lambda p, t: p[t].mean(axis=1)
    assert check_batch_independence(per_example, table, tokens) == []
    mixing = lambda p, t: p[t].mean(axis=1) - p[t].mean(axis=(0, 1))  # BUG: mean over the batch too
    findings = check_batch_independence(mixing, table, tokens)
    assert [f.code for f in findings] == ["batch.cross_talk"] and "forward probe" in findings[0].message


def test_batch_stage_skipped_without_apply():
    exp = _nnx_experiment(None)
    diagnosis = jaxsane.doctor(exp, stages=["batch"], progress=False)
    assert diagnosis.codes == ["doctor.skipped"] and diagnosis[0].severity == "info"


# ----------------------------------------------------------------------------- graph batches cut by Experiment.examples


def _node_batch(sizes=(3, 5, 4, 2), pad_to=None):
    """A disjoint union of chain graphs (nodes [N, 2], a message along each edge), node labels, a node mask; padded
    with one padding graph of ``pad_to - N`` isolated nodes when asked."""
    rng = np.random.default_rng(0)
    senders, receivers, offset = [], [], 0
    for n in sizes:
        senders += list(range(offset, offset + n - 1))
        receivers += list(range(offset + 1, offset + n))
        offset += n
    pad = 0 if pad_to is None else pad_to - offset
    n_node = list(sizes) + ([pad] if pad else [])
    total = offset + pad
    return {
        "nodes": rng.normal(size=(total, 2)).astype(np.float32),
        "senders": np.asarray(senders, np.int32), "receivers": np.asarray(receivers, np.int32),
        "labels": np.zeros(total, np.int32), "mask": np.asarray([1.0] * offset + [0.0] * pad, np.float32),
        "n_node": np.asarray(n_node, np.int32), "n_edge": np.asarray([n - 1 for n in sizes] + ([0] if pad else []), np.int32),
    }  # fmt: skip


def _take_graphs(batch, k, pad_to=None):
    """The first k graphs; with ``pad_to`` padded back to that many nodes with isolated padding nodes."""
    n, e = int(batch["n_node"][:k].sum()), int(batch["n_edge"][:k].sum())
    cut = {"nodes": batch["nodes"][:n], "senders": batch["senders"][:e], "receivers": batch["receivers"][:e],
           "labels": batch["labels"][:n], "mask": batch["mask"][:n], "n_node": batch["n_node"][:k],
           "n_edge": batch["n_edge"][:k]}  # fmt: skip
    if pad_to is not None and n < pad_to:
        extra = pad_to - n
        cut = {**cut, "nodes": np.concatenate([cut["nodes"], np.ones((extra, 2), np.float32)]),
               "labels": np.concatenate([cut["labels"], np.zeros(extra, np.int32)]),
               "mask": np.concatenate([cut["mask"], np.zeros(extra, np.float32)]),
               "n_node": np.concatenate([cut["n_node"], [extra]]).astype(np.int32)}  # fmt: skip
    return cut


def _node_model(pool_over_batch: bool):
    """Per-node outputs from each node and its predecessor; ``pool_over_batch`` plants the bug of a feature
    normalised over every node of the batch (other graphs leak in)."""

    def apply(params, b):
        h = b["nodes"] @ params
        msg = jax.ops.segment_sum(h[b["senders"]], b["receivers"], num_segments=h.shape[0])
        out = h + msg
        return out - out.mean(axis=0) if pool_over_batch else out

    return apply


@pytest.mark.parametrize("pad_to", [None, 16])
def test_node_level_outputs_are_compared_row_by_row_on_graph_cuts(pad_to):
    """Node classification on a graph batch: the outputs have a row per node, not per graph. The cut's rows are
    compared with the whole batch's first rows (its padding rows, by the mask, not at all)."""
    from jaxsane._checks.batch import check_example_slices
    from jaxsane._experiment.batches import examples_by_cutting

    batch, params = _node_batch(pad_to=pad_to), np.eye(2, dtype=np.float32)
    take = (lambda b, k: _take_graphs(b, k, pad_to)) if pad_to else _take_graphs
    count = examples_by_cutting(_take_graphs, batch)
    assert count == (5 if pad_to else 4), "the graphs the cuts find (the padding graph is one)"
    args = (params, batch, take, lambda b: b, count)
    assert check_example_slices(_node_model(False), *args, real_rows=lambda b: b["mask"]) == []
    (f,) = check_example_slices(_node_model(True), *args, real_rows=lambda b: b["mask"])
    assert f.code == "batch.cross_talk" and "row" in f.message and f.extra["rows"], f


@pytest.mark.parametrize("model", ["nodes", "nodes_pooled_over_batch", "one_vector"])
def test_doctors_batch_stage_on_a_node_classification_graph_batch(model):
    """doctor on a node-level GNN whose Experiment.examples cuts graphs: the batch stage compares node rows (a
    model that pools over the whole batch is batch.cross_talk); an apply whose output is one vector for the whole
    batch matches neither graphs nor nodes: an info that it could not judge, never an error or a failed stage."""
    batch = _node_batch(pad_to=16)
    tx = optax.sgd(0.1)
    if model == "one_vector":

        def apply(params, b):
            return jnp.tile((b["nodes"] @ params).mean(axis=0), 4)  # 8 values: neither 5 graphs nor 16 nodes

    else:
        apply = _node_model(pool_over_batch=model == "nodes_pooled_over_batch")

    def init(key):
        params = jnp.eye(2)
        return params, tx.init(params)

    def loss(params, b):
        return jnp.sum(apply(params, b) ** 2)

    step = optax_step_of(loss, tx)

    exp = jaxsane.Experiment(init=init, step=step, train=[batch], loss=loss, apply=apply, inputs=lambda b: b,
                             labels=lambda b: b["labels"], mask=lambda b: b["mask"],
                             examples=lambda b, k: _take_graphs(b, k, 16))  # fmt: skip
    d = jaxsane.doctor(exp, stages=["batch"], progress=False)
    status = [s["status"] for s in d.stages]
    if model == "nodes":
        assert status == ["ran"] and not [f for f in d if f.severity != "info"], [str(f) for f in d]
    elif model == "nodes_pooled_over_batch":
        assert status == ["ran"] and [f.code for f in d if f.severity == "error"] == ["batch.cross_talk"]
    else:
        assert status == ["not applicable"] and not [f for f in d if f.severity != "info"], [str(f) for f in d]
        assert any(f.code == "doctor.skipped" and "batch independence not checked" in f.message for f in d)


def _one_graph(n=60, e=240, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(n, 4)).astype(np.float32),
        "senders": rng.integers(0, n, e).astype(np.int32),
        "receivers": rng.integers(0, n, e).astype(np.int32),
    }


def _mean_neighbours(params, g):
    n = g["x"].shape[0]
    msg = jax.ops.segment_sum(g["x"][g["senders"]], g["receivers"], n)
    deg = jax.ops.segment_sum(jnp.ones_like(g["receivers"], jnp.float32), g["receivers"], n)
    return (g["x"] + msg / jnp.maximum(deg, 1.0)[:, None]) @ params["w"]


def _first_nodes(g, k):
    keep = (g["senders"] < k) & (g["receivers"] < k)  # the subgraph the first k nodes induce
    return {"x": g["x"][:k], "senders": g["senders"][keep], "receivers": g["receivers"][keep]}


def test_the_nodes_of_one_graph_are_not_judged_as_independent_examples():
    """Node regression on one graph, examples= cutting the subgraph of the first k nodes: the kept nodes read
    removed neighbours by design (message passing), so batch independence is not judged; a batch of separate
    graphs cut whole is still judged (the zoo's wrong segment ids, f65)."""
    from jaxsane._checks.batch import check_example_slices

    params = {"w": jnp.asarray(np.random.default_rng(1).normal(size=(4, 2)), jnp.float32)}
    g = _one_graph()
    found = check_example_slices(_mean_neighbours, params, g, _first_nodes, lambda b: b, 60)
    assert [f.code for f in found] == ["doctor.skipped"] and "one graph" in found[0].message, found
    # the same nodes with no edge leaving the first 30 (two graphs, cut whole at 30): judged, and nothing moves
    two = dict(
        g,
        senders=np.where(g["senders"] < 30, g["senders"], g["senders"]),
        receivers=np.where((g["senders"] < 30) != (g["receivers"] < 30), g["senders"], g["receivers"]),
    )
    assert check_example_slices(_mean_neighbours, params, two, _first_nodes, lambda b: b, 60, cuts=[30]) == []
