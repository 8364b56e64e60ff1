"""Correct: a ReLU message-passing graph classifier whose ReLUs sit exactly on their kink at init.

The batch is a jraph-style ``GraphsTuple`` dict padded as ``jraph.pad_with_graphs`` does (zero-filled
padding nodes and edges in one padding graph, masked out of the loss, as in c43), and about a third
of the real nodes carry no attributes: their feature rows are all zero. A ReLU node encoder with a
zero-initialised bias maps every zero row (padding or real) to ``relu(0 @ W + 0) = relu(0)``: the
pre-activation is exactly 0, on the kink, and the real ones reach the loss through the per-graph
readout. Autodiff returns one side there (``relu'(0) = 0``) and central differences the average of
both sides at any step, so a gradient check that only shrinks its step reports a false
``grad.mismatch`` on the encoder bias. Nothing here is wrong; the check must stay silent (errors).
"""

import jax
import numpy as np

from benchmarks.faults._common import dense_params, message_passing, mlp_apply, optax_step
from benchmarks.faults.c43_healthy_graph import (CLASSES, FEATURES, GRAPHS, MAX_DEGREE, batches, graph_mean,
                                                 masked_loss, pad_graphs, random_graphs, take_graphs, tx)
import jaxsane

EXPECTED = []
STYLE = "optax"
STAGES = ["data", "init", "grads", "step", "batch", "overfit", "run"]
OPTIONS = {"run_steps": 30, "overfit_steps": 150}
HIDDEN = 32


def graphs_without_some_attributes(rng, count):
    """c43's ring/star graphs, with the attributes of about a third of the real nodes missing (all-zero rows)."""
    batch = random_graphs(rng, count)
    batch["nodes"] = batch["nodes"] * (rng.random(len(batch["nodes"])) > 0.3)[:, None].astype(np.float32)
    return batch


def apply(params, graph):
    h = jax.nn.relu(graph["nodes"] @ params["encoder"]["w"] + params["encoder"]["b"])  # zero rows: exactly relu(0)
    h = message_passing(params["mp"], graph, MAX_DEGREE, act=jax.nn.relu, h=h)
    return mlp_apply(params["head"], graph_mean(h, graph))


loss = masked_loss(apply)


def init(key):
    k0, k1, k2, k3 = jax.random.split(key, 4)
    params = {"encoder": dense_params(k0, (FEATURES, HIDDEN))[0],
              "mp": [dense_params(k1, (2 * HIDDEN, HIDDEN))[0], dense_params(k2, (2 * HIDDEN, HIDDEN))[0]],
              "head": dense_params(k3, (HIDDEN, HIDDEN, CLASSES))}
    params["head"][-1]["w"] = params["head"][-1]["w"] * 0.1  # a smaller output layer: loss at init near ln 2
    return params, tx.init(params)


def experiment():
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=batches(0, graphs_without_some_attributes),
                              eval=pad_graphs(graphs_without_some_attributes(np.random.default_rng(1), GRAPHS)),
                              loss=loss, apply=apply, inputs=lambda batch: batch, labels=lambda batch: batch["labels"],
                              num_classes=CLASSES, examples=take_graphs, name="c45_healthy_graph_relu_padding")
