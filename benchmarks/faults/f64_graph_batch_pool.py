"""A graph classifier whose readout averages over every node of the batch instead of per graph.

``jnp.mean(h, axis=0)``, broadcast to every graph: each graph's vector is the batch's, so its output
depends on all the other graphs of the batch (the "mean over the batch axis" bug, where the batch
axis is the node axis of a ``GraphsTuple``). Fix: ``jax.ops.segment_sum(h, graph_of_node,
num_graphs) / n_node``.
"""

import jax.numpy as jnp

from benchmarks.faults._common import gelu_mlp_apply, message_passing
from benchmarks.faults.c43_healthy_graph import MAX_DEGREE, experiment_with

EXPECTED = ["batch.cross_talk"]
STYLE = "optax"
STAGES = ["data", "init", "grads", "step", "batch"]


def apply(params, graph):
    h = message_passing(params["mp"], graph, MAX_DEGREE)
    pooled = jnp.broadcast_to(jnp.mean(h, axis=0), (graph["n_node"].shape[0], h.shape[-1]))  # FAULT: pools the whole batch
    return gelu_mlp_apply(params["head"], pooled)


def experiment():
    return experiment_with(apply, "f64_graph_batch_pool")
