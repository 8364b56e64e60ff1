"""A graph classifier whose readout pools nodes with the wrong segment ids: it assumes every graph has
the largest size (9 nodes), so graph g's vector sums nodes 9g..9g+8, which belong to other graphs.

A batch holds graphs of 5..9 nodes, so each graph reads its neighbours' nodes: its output depends on
the other graphs of the batch (and on their order). It still trains somewhat. Fix: node-to-graph ids
from ``n_node``, ``jnp.repeat(jnp.arange(num_graphs), graph["n_node"], total_repeat_length=num_nodes)``.
"""

import jax
import jax.numpy as jnp

from benchmarks.faults._common import gelu_mlp_apply, message_passing
from benchmarks.faults.c43_healthy_graph import MAX_DEGREE, experiment_with

EXPECTED = ["batch.cross_talk"]
STYLE = "optax"
STAGES = ["data", "init", "grads", "step", "batch"]


def apply(params, graph):
    num_nodes, num_graphs = graph["nodes"].shape[0], graph["n_node"].shape[0]
    h = message_passing(params["mp"], graph, MAX_DEGREE)
    graph_of_node = jnp.minimum(jnp.arange(num_nodes) // 9, num_graphs - 1)  # FAULT: assumes 9 nodes per graph
    pooled = jax.ops.segment_sum(h, graph_of_node, num_graphs) / jnp.maximum(graph["n_node"], 1)[:, None]
    return gelu_mlp_apply(params["head"], pooled)


def experiment():
    return experiment_with(apply, "f65_graph_wrong_segments")
