"""An ignore index in the labels (-100 at the unlabelled positions of a masked LM) judged by the loss: one that
weighs its terms by a test of the labels leaves it out (no finding); one that reads it keeps the warning."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsane
from jaxsane._checks.ignore_index import loss_masks_labels

V, T = 20, 8


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, V, size=(16, T)).astype(np.int32)
    labels = np.where(rng.random((16, T)) < 0.3, ids, -100).astype(np.int32)
    labels[:, 0] = ids[:, 0]  # (a class id in every row)
    return {"ids": ids, "labels": labels}


def _logits(p, ids):
    return p["emb"][ids] @ p["w"]


def _per_token(p, b, labels):
    return optax.softmax_cross_entropy_with_integer_labels(_logits(p, b["ids"]), labels)


LOSSES = {  # name -> (loss, leaves the ignore index out)
    "weights_ne": (
        lambda p, b: (
            jnp.sum(_per_token(p, b, jnp.where(b["labels"] != -100, b["labels"], 0)) * (b["labels"] != -100))
            / jnp.sum(b["labels"] != -100)
        ),
        True,
    ),
    "where_positive": (
        lambda p, b: jnp.mean(jnp.where(b["labels"] >= 0, _per_token(p, b, jnp.maximum(b["labels"], 0)), 0.0)),
        True,
    ),
    "one_hot": (
        lambda p, b: optax.softmax_cross_entropy(_logits(p, b["ids"]), jax.nn.one_hot(b["labels"], V)).mean(),
        True,
    ),
    "raw": (lambda p, b: _per_token(p, b, b["labels"]).mean(), False),  # -100 wraps to class V - 100 % V
    "clipped": (lambda p, b: _per_token(p, b, jnp.maximum(b["labels"], 0)).mean(), False),
}


def _params():
    rng = np.random.default_rng(1)
    return {
        "emb": jnp.asarray(rng.normal(size=(V, 8)), jnp.float32),
        "w": jnp.asarray(rng.normal(size=(8, V)) * 0.3, jnp.float32),
    }


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_a_loss_is_read_for_the_test_that_leaves_its_ignore_index_out(name):
    loss, masks = LOSSES[name]
    b = _batch()
    assert loss_masks_labels(loss, _params(), b, b["labels"]) is masks


def _experiment(name):
    loss = LOSSES[name][0]
    tx = optax.adam(1e-2)
    params = _params()

    def step(state, b):
        p, o = state
        value, g = jax.value_and_grad(loss)(p, b)
        u, o = tx.update(g, o, p)
        return (optax.apply_updates(p, u), o), {"loss": value}

    return jaxsane.Experiment(
        init=lambda k: (params, tx.init(params)),
        step=step,
        train=_batch(),
        loss=loss,
        apply=_logits,
        inputs=lambda b: b["ids"],
        labels=lambda b: b["labels"],
        num_classes=V,
    )


def test_doctor_drops_the_ignore_index_warning_where_the_loss_masks_it_and_keeps_it_where_it_reads_it():
    masked = jaxsane.doctor(_experiment("weights_ne"), stages=["data"], progress=False)
    assert "data.label_range" not in [f.code for f in masked], [str(f) for f in masked]
    raw = jaxsane.doctor(_experiment("raw"), stages=["data"], progress=False)
    kept = [f for f in raw if f.code == "data.label_range"]
    assert kept and all(f.severity == "warning" and f.extra["ignore_index"] == -100 for f in kept), [
        str(f) for f in raw
    ]
