"""Correct: f93's model and data without the corrupt examples: no loss spike."""

from benchmarks.faults import f93_corrupt_examples_spike as f93

EXPECTED = []
STYLE = "optax"


def experiment():
    return f93.experiment(corrupt=False)


def check():
    return f93.check(corrupt=False)
