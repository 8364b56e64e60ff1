"""class_accuracy: a label that is not a class (the -100 a masked-LM loss ignores) or a padded position is not a
miss; accuracy_fn, the overfit sweep's accuracy, scores a token model that way."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsane
from jaxsane._core.accuracy import class_accuracy
from jaxsane._experiment.contract import PureExperiment
from jaxsane._overfit.setup import accuracy_fn


def _one_hot_logits(ids, classes):
    return jax.nn.one_hot(jnp.asarray(ids), classes) * 10.0


def test_ignored_labels_and_padding_are_not_scored():
    predicted = np.array([[1, 2, 3, 0], [4, 4, 0, 0]])
    labels = np.array([[1, 2, -100, 0], [4, 3, -100, 7]])  # two ignored, one miss (3), one out of range
    logits = _one_hot_logits(predicted, 5)
    assert float(class_accuracy(logits, labels)) == pytest.approx(4 / 5)  # scored: 1, 2, 0 | 4, 3
    mask = np.array([[1, 1, 1, 1], [1, 0, 0, 0]])
    assert float(class_accuracy(logits, labels, mask)) == 1.0  # the miss sits in padding
    assert float(class_accuracy(logits, np.full((2, 4), -100))) == 0.0  # nothing scored
    assert float(class_accuracy(logits, np.array([[1, 2, 3, 1], [4, 4, 0, 1]]))) == pytest.approx(6 / 8)  # plain misses count


def test_overfit_accuracy_of_a_masked_token_model_ignores_minus_100():
    vocab, T = 6, 5
    tokens = np.array([[1, 2, 3, 4, 5], [5, 4, 3, 2, 1]], np.int32)
    labels = np.where(np.arange(T) % 2 == 0, tokens, -100).astype(np.int32)  # only every other token is a target

    def apply(params, x):  # a perfect predictor of every token, whatever the params
        return _one_hot_logits(x, vocab) + 0.0 * params["w"]

    def loss(params, b):
        logits = apply(params, b["tokens"])
        valid = b["labels"] != -100
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.maximum(b["labels"], 0)[..., None], -1)[..., 0]
        return jnp.sum(ce * valid) / jnp.sum(valid)

    def step(params, b):
        return params, {"loss": loss(params, b)}

    batch = {"tokens": tokens, "labels": labels}
    exp = jaxsane.Experiment(
        init=lambda key: {"w": jnp.zeros(())},
        step=step,
        train=batch,
        loss=loss,
        apply=apply,
        inputs=lambda b: b["tokens"],
        labels=lambda b: b["labels"],
        params=lambda state: state,
    )
    adapted = PureExperiment(exp)
    params = adapted.params(adapted.init(jax.random.key(0)))
    accuracy = accuracy_fn(adapted, params, batch)
    assert accuracy is not None
    assert float(accuracy(params, batch)) == 1.0  # was 0.6: the ignored positions counted as misses
