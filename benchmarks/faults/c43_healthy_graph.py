"""Correct: a message-passing graph classifier on a jraph-style ``GraphsTuple`` dict batch.

Each batch packs 16 small graphs, padded to fixed sizes with one padding graph as jraph does: ``nodes [N, F]``, ``edges [E, F]``, ``senders/receivers [E]``,
``n_node/n_edge [G]`` and graph labels ``[G]``; node features are pooled per graph with
``segment_sum`` (written in plain jax, the way jraph does it). The leaves disagree on the leading
axis, so no stage may slice "the first k examples" along the node axis; the Experiment says what an
example is (one graph) with ``examples=``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxsane
from benchmarks.faults._common import dense_params, message_passing, mlp_apply, optax_step

EXPECTED = []
STYLE = "optax"
STAGES = ["data", "init", "grads", "step", "batch", "overfit", "run"]
OPTIONS = {"run_steps": 30, "overfit_steps": 150}
GRAPHS, FEATURES, CLASSES = 16, 4, 2
MAX_NODES, MAX_EDGES = 9 * GRAPHS + 1, 2 * 9 * GRAPHS
MAX_DEGREE = 8.0  # sum messages scaled by the largest degree: they still tell a star from a ring
tx = optax.adam(3e-3)


def random_graphs(rng, count):
    """Ring or star graphs (the class) of 5..9 nodes with noisy node features (sum messages see degrees)."""
    nodes, senders, receivers, n_node, labels = [], [], [], [], []
    offset = 0
    for _ in range(count):
        n, label = int(rng.integers(5, 10)), int(rng.integers(0, 2))
        if label == 0:
            s = np.arange(n); r = (s + 1) % n                   # ring
        else:
            s = np.zeros(n - 1, int); r = np.arange(1, n)      # star around node 0
        s, r = np.concatenate([s, r]), np.concatenate([r, s])  # undirected
        nodes.append(rng.standard_normal((n, FEATURES)).astype(np.float32) * 0.1 + 1.0)
        senders.append(s + offset); receivers.append(r + offset); n_node.append(n); labels.append(label)
        offset += n
    senders, receivers = np.concatenate(senders).astype(np.int32), np.concatenate(receivers).astype(np.int32)
    return {"nodes": np.concatenate(nodes), "edges": np.ones((len(senders), 1), np.float32),
            "senders": senders, "receivers": receivers, "n_node": np.array(n_node, np.int32),
            "n_edge": np.bincount(np.searchsorted(np.cumsum(n_node), senders, side="right"),
                                  minlength=count).astype(np.int32),
            "labels": np.array(labels, np.int32)}


def pad_graphs(batch, max_nodes=MAX_NODES, max_edges=MAX_EDGES):
    """jraph.pad_with_graphs in numpy: one padding graph takes the spare nodes and edges, so every batch
    has one shape (the step compiles once); ``graph_mask`` marks the real graphs."""
    n, e = len(batch["nodes"]), len(batch["senders"])
    pad_edges = np.full(max_edges - e, n, np.int32)  # padding edges connect padding nodes
    return {"nodes": np.concatenate([batch["nodes"], np.zeros((max_nodes - n, FEATURES), np.float32)]),
            "edges": np.concatenate([batch["edges"], np.zeros((max_edges - e, 1), np.float32)]),
            "senders": np.concatenate([batch["senders"], pad_edges]),
            "receivers": np.concatenate([batch["receivers"], pad_edges]),
            "n_node": np.append(batch["n_node"], max_nodes - n).astype(np.int32),
            "n_edge": np.append(batch["n_edge"], max_edges - e).astype(np.int32),
            "labels": np.append(batch["labels"], 0).astype(np.int32),
            "graph_mask": np.append(np.ones(len(batch["labels"]), np.float32), 0.0).astype(np.float32)}


def take_graphs(batch, n):
    """The first ``n`` graphs of a batch (what one example is, for jaxsane's stages)."""
    n_nodes, n_edges = int(np.sum(batch["n_node"][:n])), int(np.sum(batch["n_edge"][:n]))
    return {"nodes": batch["nodes"][:n_nodes], "edges": batch["edges"][:n_edges],
            "senders": batch["senders"][:n_edges], "receivers": batch["receivers"][:n_edges],
            "n_node": batch["n_node"][:n], "n_edge": batch["n_edge"][:n], "labels": batch["labels"][:n],
            "graph_mask": batch["graph_mask"][:n]}


def batches(seed, make=random_graphs):
    """An endless stream of padded batches of ``make(rng, GRAPHS)`` graphs."""
    def stream():
        rng = np.random.default_rng(seed)
        while True:
            yield pad_graphs(make(rng, GRAPHS))
    return stream


def graph_mean(h, graph):
    """Per-graph mean of the node states ``h`` (``segment_sum`` over the node-to-graph ids, as jraph does)."""
    num_nodes, num_graphs = h.shape[0], graph["n_node"].shape[0]
    graph_of_node = jnp.repeat(jnp.arange(num_graphs), graph["n_node"], total_repeat_length=num_nodes)
    return jax.ops.segment_sum(h, graph_of_node, num_graphs) / jnp.maximum(graph["n_node"], 1)[:, None]


def apply(params, graph):
    h = message_passing(params["mp"], graph, MAX_DEGREE, act=jax.nn.relu)
    return mlp_apply(params["head"], graph_mean(h, graph))


def masked_loss(apply_fn):
    """The mean cross-entropy over the real graphs (the padding graph masked out) of ``apply_fn``."""
    def loss(params, batch):
        per_graph = optax.softmax_cross_entropy_with_integer_labels(apply_fn(params, batch), batch["labels"])
        return jnp.sum(per_graph * batch["graph_mask"]) / jnp.sum(batch["graph_mask"])
    return loss


loss = masked_loss(apply)


def init(key):
    k1, k2, k3 = jax.random.split(key, 3)
    params = {"mp": [dense_params(k1, (2 * FEATURES, 32))[0], dense_params(k2, (64, 32))[0]],
              "head": dense_params(k3, (32, 32, CLASSES))}
    params["head"][-1]["w"] = params["head"][-1]["w"] * 0.1  # a smaller output layer: loss at init near ln 2
    return params, tx.init(params)


def experiment_with(apply_fn, name):
    """This program's Experiment around another ``apply`` (the faulty graph programs reuse it)."""
    loss_fn = masked_loss(apply_fn)
    return jaxsane.Experiment(init=init, step=optax_step(loss_fn, tx), train=batches(0),
                              eval=pad_graphs(random_graphs(np.random.default_rng(1), GRAPHS)), loss=loss_fn,
                              apply=apply_fn, inputs=lambda batch: batch, labels=lambda batch: batch["labels"],
                              num_classes=CLASSES, examples=take_graphs, name=name)


def experiment():
    return experiment_with(apply, "c43_healthy_graph")
