"""doctor's data stage on streams: an endless stream is read until it starts over or its time budget runs
out (rare corrupt rows far into it are found), a finite one to its end; a one-shot iterator still feeds
the later stages; chance collisions in low-dimensional data are not leakage."""

import dataclasses
import itertools

import numpy as np
import pytest

import jaxsane
from jaxsane import check_data


def _digits_experiment():
    from jaxsane.examples import load
    return load("digits_nnx")


def glitchy_stream(batch_size=32, every=300, seed=0):
    """Endless fresh sensor rows; one row in ``every`` is a glitch (NaN), the first at row 1300 (batch 40)."""
    rng = np.random.default_rng(seed)
    row = 0
    while True:
        x = rng.normal(size=(batch_size, 64)).astype(np.float32)
        for i in range(batch_size):
            if (row + i) >= 1300 and (row + i - 1300) % every == 0:
                x[i, 3] = np.nan
        yield {"x": x, "y": rng.integers(0, 10, batch_size).astype(np.int32)}
        row += batch_size


@pytest.mark.slow
def test_doctor_reads_an_endless_stream_past_its_first_batches_and_finds_rare_corrupt_rows():
    exp = dataclasses.replace(_digits_experiment(), train=glitchy_stream(), eval=None)
    d = jaxsane.doctor(exp, stages=["data"], progress=False, data_max_seconds=1.0)
    [f] = d.by_code("nonfinite.input")
    assert f.extra["indices"][0] == 1300, f
    [partial] = d.by_code("data.partial")  # says how much was read, and why it stopped
    assert "time limit" in partial.message and partial.extra["batches"] > 40
    summary = d.artifacts["data"]["train"]
    assert summary["stopped"] == "time" and summary["batches"] == partial.extra["batches"]
    # the old reading (20 batches) missed it: an explicit batch limit still applies
    d = jaxsane.doctor(dataclasses.replace(exp, train=glitchy_stream()), stages=["data"], progress=False,
                       data_max_batches=20)
    assert not d.by_code("nonfinite.input")


def test_check_data_time_limit_and_no_batch_limit():
    d = check_data(glitchy_stream(), max_seconds=0.3)
    summary = d.artifacts["data"]["train"]
    assert summary["stopped"] == "time" and d.by_code("data.partial")[0].extra["seconds"] >= 0.3


@pytest.mark.slow
def test_a_finite_one_shot_stream_is_read_to_its_end_and_still_feeds_the_later_stages():
    exp = _digits_experiment()
    x, y = exp.train.x, exp.train.y
    batches = [{"x": x[s:s + 64], "y": y[s:s + 64]} for s in range(0, 64 * 22, 64)]
    one_shot = iter(batches)
    d = jaxsane.doctor(dataclasses.replace(exp, train=one_shot, eval=None), stages=["data", "run"],
                       progress=False, run_steps=25)
    summary = d.artifacts["data"]["train"]
    assert summary["stopped"] == "end" and summary["batches"] == 22 and summary["rows"] == 22 * 64
    assert not d.by_code("data.partial") and not d.by_code("data.empty")
    assert not [f for f in d if f.severity == "error"], d


def test_a_reshuffled_endless_stream_is_one_epoch_but_a_repeated_batch_is_a_duplicate():
    exp = _digits_experiment()
    d = check_data(exp.train, max_seconds=5.0)
    assert d.codes == ["data.epoch"] and d.artifacts["data"]["train"]["rows"] == 1408
    x, y = exp.train.x, exp.train.y
    b0, b1 = {"x": x[:32], "y": y[:32]}, {"x": x[32:64], "y": y[32:64]}
    assert check_data(iter([b0, b1, b0]), max_seconds=5.0).codes == ["data.duplicates"]


def test_the_data_stage_keeps_only_the_first_batches_of_a_one_shot_stream():
    from jaxsane._experiment.batches import Replayable
    source = Replayable(itertools.count())
    read = list(itertools.islice(source.reading(keep=3), 10))
    assert read == list(range(10))
    assert list(itertools.islice(iter(source), 5)) == [0, 1, 2, 10, 11]  # the kept ones, then the source goes on


# ----------------------------------------------------------------------------- chance collisions


def _regression(n_train=4096, n_eval=1024, features=1, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n_train, features)).astype(np.float32)
    xe = rng.normal(size=(n_eval, features)).astype(np.float32)
    return x, x.sum(1), xe, xe.sum(1)


def test_one_chance_collision_in_one_feature_float_data_is_not_leakage():
    x, y, xe, ye = _regression()
    xe[5] = x[17]  # one coincidence among 4 million pairs of 1-feature values
    assert check_data((x, y), (xe, ye)).codes == []
    x[300] = x[7]  # and one within train
    assert check_data((x, y), (xe, ye)).codes == []
    # low precision (3 decimals): about a thousand coincidences, all chance
    assert check_data((np.round(x, 3), y), (np.round(xe, 3), ye)).codes == []


def test_copied_rows_and_multi_feature_leakage_are_still_errors():
    x, y, xe, ye = _regression()
    xe[:40] = x[100:140]
    [f] = check_data((x, y), (xe, ye)).by_code("data.leakage")
    assert f.severity == "error" and f.extra["count"] >= 40  # (seed 0 holds one real coincidence too)
    x[1000:1040] = x[2000:2040]
    assert check_data((x, y)).by_code("data.duplicates")
    x3, y3, xe3, ye3 = _regression(features=3)
    xe3[5] = x3[17]  # a single copied row of 3 features: no coincidence
    assert check_data((x3, y3), (xe3, ye3)).codes == ["data.leakage"]
    tokens = np.random.default_rng(1).integers(1, 50, (512, 12)).astype(np.int32)
    eval_tokens = np.random.default_rng(2).integers(1, 50, (128, 12)).astype(np.int32)
    eval_tokens[3] = tokens[9]
    assert check_data(tokens, eval_tokens).codes == ["data.leakage"]
