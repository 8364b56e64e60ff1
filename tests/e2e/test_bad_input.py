"""Bad input to the public API: a clear ``[jaxsane]`` error (a JaxsaneError, nothing else leaks) or a
``data.*`` finding, each with a correct counterpart that passes.

The table rows are ``(id, call, expected exception class, substring of the message)``; every call is
cheap because arguments are validated at the public boundary, before any work.
"""

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _programs import TX, batch, optax_apply, optax_experiment, optax_init, optax_loss, optax_step

import jaxsane
from jaxsane import ArgumentError, DataError, ExperimentError, JaxsaneError, check_data
from jaxsane._data.scan import DEFAULT_MAX_BATCHES
from jaxsane._experiment.contract import PureExperiment

X = batch()["x"]                       # (8, 4) float32
Y = batch()["y"]                       # (8,) int32 in [0, 3)
PARAMS = optax_init(jax.random.key(0))[0]


def _exp(**kw):
    base = dict(init=optax_init, step=optax_step, train=batch())
    base.update(kw)
    return jaxsane.Experiment(**base)


def _diag():
    return jaxsane.Diagnosis([], name="demo")


def _bad_history():
    h = jaxsane.History()
    h.steps, h.loss = [0, 1, 2], [1.0, 0.9]
    return h


CASES = [
    # ---- Experiment: every field of the wrong kind
    ("exp-name-int", lambda: _exp(name=123), ExperimentError, "Experiment.name must be a str"),
    ("exp-init-int", lambda: _exp(init=3), ExperimentError, "Experiment.init must be callable"),
    ("exp-init-state", lambda: _exp(init=optax_init(jax.random.key(0))), ExperimentError, "init=lambda key"),
    ("exp-step-none", lambda: _exp(step=None), ExperimentError, "Experiment.step must be callable"),
    ("exp-loss-str", lambda: _exp(loss="nope"), ExperimentError, "Experiment.loss must be a callable"),
    ("exp-apply-array", lambda: _exp(apply=np.ones(3)), ExperimentError, "Experiment.apply must be a callable"),
    ("exp-params-int", lambda: _exp(params=1), ExperimentError, "Experiment.params must be a callable"),
    ("exp-inputs-key", lambda: _exp(inputs="x"), ExperimentError, "inputs=lambda batch: batch['x']"),
    ("exp-labels-int", lambda: _exp(labels=0), ExperimentError, "Experiment.labels must be a callable"),
    ("exp-mask-list", lambda: _exp(mask=[1]), ExperimentError, "Experiment.mask must be a callable"),
    ("exp-classes-1", lambda: _exp(num_classes=1), ExperimentError, "Experiment.num_classes must be an int >= 2"),
    ("exp-classes-float", lambda: _exp(num_classes=3.0), ExperimentError, "got float 3.0"),
    ("exp-classes-str", lambda: _exp(num_classes="10"), ExperimentError, "config file"),
    ("exp-classes-bool", lambda: _exp(num_classes=True), ExperimentError, "got bool True"),
    ("exp-train-none", lambda: _exp(train=None), ExperimentError, "Experiment.train is required"),
    ("exp-train-path", lambda: _exp(train="data/train.npz"), ExperimentError, "Experiment.train must be data"),
    ("exp-eval-int", lambda: _exp(eval=5), ExperimentError, "Experiment.eval must be data"),
    ("exp-train-object", lambda: _exp(train=object()), ExperimentError, "neither a batch, an iterable"),
    ("exp-train-scalar", lambda: _exp(train=np.float32(0.5)), ExperimentError, "a scalar, which has no batch axis"),
    # ---- fit, load_dump, doctor (found by the fuzz tier, tests/fuzz)
    ("fit-resume-str", lambda: jaxsane.fit(optax_experiment(), steps=1, resume="no"), ArgumentError,
     "fit(resume=...) must be True or False"),
    ("fit-key-int", lambda: jaxsane.fit(optax_experiment(), steps=1, key=0), ArgumentError, "fit(key=...)"),
    ("fit-hang-array", lambda: jaxsane.fit(optax_experiment(), steps=1, hang_timeout=np.ones(2)), ArgumentError,
     "fit(hang_timeout=...)"),
    ("dump-max-bytes-none", lambda: jaxsane.load_dump(".", max_bytes=None), ArgumentError, "load_dump(max_bytes=...)"),
    ("dump-path-int", lambda: jaxsane.load_dump(3), ArgumentError, "load_dump(path=...)"),
    ("doctor-stages-bool", lambda: jaxsane.doctor(optax_experiment(), stages=True), ArgumentError,
     "doctor(stages=...) must be a stage name"),
    ("step-batch-str", lambda: jaxsane.check_step(optax_experiment(), batch="b"), ArgumentError, "check_step(batch=...)"),
    # ---- check_data arguments
    ("data-classes-str", lambda: check_data((X, Y), num_classes="3"), ArgumentError, "check_data(num_classes=...)"),
    ("data-classes-0", lambda: check_data((X, Y), num_classes=0), ArgumentError, "an int >= 1 or None"),
    ("data-max-batches-0", lambda: check_data([(X, Y)], max_batches=0), ArgumentError, "max_batches"),
    ("data-max-batches-float", lambda: check_data([(X, Y)], max_batches=2.5), ArgumentError, "float"),
    ("data-inputs-int", lambda: check_data((X, Y), inputs=5), DataError, "check_data(inputs=...)"),
    ("data-apply-str", lambda: check_data((X, Y), apply="model"), ArgumentError, "check_data(apply=...)"),
    ("data-dup-frac", lambda: check_data((X, Y), max_duplicate_fraction=2), ArgumentError, "in [0.0, 1.0]"),
    ("data-scale-range", lambda: check_data((X, Y), scale_range=(10, 1)), DataError, "0 <= low < high"),
    ("data-int-features", lambda: check_data((X, Y), integer_features="yes"), ArgumentError, "True or False"),
    ("data-label-length", lambda: check_data((X, Y[:5])), DataError, "has 5 rows but"),
    ("data-dict-label-length", lambda: check_data({"x": X, "y": Y[:3]}, num_classes=3), DataError, "['y'] has 3 rows"),
    ("data-int", lambda: check_data(42), DataError, "cannot read train data of type int"),
    ("data-str", lambda: check_data("train.csv"), DataError, "cannot read train data of type str"),
    # ---- check_init / activation_stats
    ("init-apply-none", lambda: jaxsane.check_init(None, PARAMS, X), ArgumentError, "check_init(apply=...)"),
    ("init-label-length", lambda: jaxsane.check_init(optax_apply, PARAMS, X, Y[:5]), ArgumentError,
     "inputs has 8 examples but labels has 5"),
    ("init-classes-1", lambda: jaxsane.check_init(optax_apply, PARAMS, X, Y, num_classes=1), ArgumentError,
     "num_classes"),
    ("init-saturated", lambda: jaxsane.check_init(optax_apply, PARAMS, X, max_saturated=2), ArgumentError,
     "max_saturated"),
    ("stats-apply-str", lambda: jaxsane.activation_stats("f", PARAMS, X), ArgumentError, "activation_stats(apply=...)"),
    # ---- check_training
    ("train-history-str", lambda: jaxsane.check_training("history"), ArgumentError, "jaxsane.History"),
    ("train-history-list", lambda: jaxsane.check_training([1.0, 0.5]), ArgumentError, "check_training(history=...)"),
    ("train-history-ragged", lambda: jaxsane.check_training(_bad_history()), ArgumentError, "3 entries but"),
    ("train-min-steps", lambda: jaxsane.check_training(jaxsane.History(), min_steps=0), ArgumentError, "min_steps"),
    # ---- Monitor
    ("monitor-str", lambda: jaxsane.Monitor("adapted"), ExperimentError, "Monitor(adapted=...)"),
    ("monitor-every-0", lambda: jaxsane.Monitor(PureExperiment(optax_experiment()), every=0), ArgumentError, "every"),
    ("monitor-every-str", lambda: jaxsane.Monitor(PureExperiment(optax_experiment()), every="5"), ArgumentError,
     "not converted"),
    ("monitor-grads-str", lambda: jaxsane.Monitor(PureExperiment(optax_experiment()), grads="no"), ArgumentError, "grads"),
    # ---- check_grads
    ("grads-f-int", lambda: jaxsane.check_grads(3, PARAMS, batch()), ArgumentError, "check_grads(f=...)"),
    ("grads-order-float", lambda: jaxsane.check_grads(optax_loss, PARAMS, batch(), order=1.5), ArgumentError,
     "order"),
    ("grads-order-0", lambda: jaxsane.check_grads(optax_loss, PARAMS, batch(), order=0), JaxsaneError,
     "order must be >= 1"),
    ("grads-eps-neg", lambda: jaxsane.check_grads(optax_loss, PARAMS, batch(), eps=-1.0), ArgumentError, "eps"),
    ("grads-aux-str", lambda: jaxsane.check_grads(optax_loss, PARAMS, batch(), has_aux="yes"), ArgumentError,
     "has_aux"),
    # ---- check_step
    ("step-fn-not-exp", lambda: jaxsane.check_step(optax_step), ExperimentError, "a step function was passed"),
    ("step-calls-str", lambda: jaxsane.check_step(optax_experiment(), calls="3"), ArgumentError, "calls"),
    ("step-calls-1", lambda: jaxsane.check_step(optax_experiment(), calls=1), JaxsaneError, "calls must be >= 2"),
    # ---- check_batch_independence
    ("batch-apply-none", lambda: jaxsane.check_batch_independence(None, PARAMS, X), ArgumentError, "apply"),
    ("batch-probes-0", lambda: jaxsane.check_batch_independence(optax_apply, PARAMS, X, probes=0), ArgumentError,
     "probes"),
    ("batch-probes-str", lambda: jaxsane.check_batch_independence(optax_apply, PARAMS, X, probes="ab"),
     ArgumentError, "a list of ints"),
    ("batch-rtol-neg", lambda: jaxsane.check_batch_independence(optax_apply, PARAMS, X, rtol=-1), ArgumentError,
     "rtol"),
    # ---- overfit
    ("overfit-str", lambda: jaxsane.overfit("exp"), ExperimentError, "overfit(experiment=...)"),
    ("overfit-steps-str", lambda: jaxsane.overfit(optax_experiment(), steps="100"), ArgumentError, "not converted"),
    ("overfit-steps-float", lambda: jaxsane.overfit(optax_experiment(), steps=3.5), ArgumentError, "3.5 steps"),
    ("overfit-seeds-0", lambda: jaxsane.overfit(optax_experiment(), seeds=0), ArgumentError, "seeds"),
    ("overfit-lrs-str", lambda: jaxsane.overfit(optax_experiment(), learning_rates="1e-3,1e-2"), ArgumentError,
     "character by character"),
    ("overfit-lrs-neg", lambda: jaxsane.overfit(optax_experiment(), learning_rates=[1e-3, -1]), ArgumentError,
     "learning_rates[1]"),
    ("overfit-accuracy", lambda: jaxsane.overfit(optax_experiment(), target_accuracy=2), ArgumentError,
     "target_accuracy"),
    ("overfit-baseline-str", lambda: jaxsane.overfit(optax_experiment(), baseline="no"), ArgumentError, "baseline"),
    ("overfit-scale-leaves", lambda: jaxsane.overfit(optax_experiment(), scale_leaves=5), JaxsaneError,
     "scale_leaves"),
    ("overfit-groups-0", lambda: jaxsane.overfit(optax_experiment(), groups=0, steps=1), JaxsaneError,
     "overfit(groups"),
    # ---- init_scale_sweep
    ("sweep-none", lambda: jaxsane.init_scale_sweep(None), ExperimentError, "init_scale_sweep(experiment=...)"),
    ("sweep-scales-empty", lambda: jaxsane.init_scale_sweep(optax_experiment(), scales=[]), ArgumentError, "empty"),
    ("sweep-scales-neg", lambda: jaxsane.init_scale_sweep(optax_experiment(), scales=[1, -2]), ArgumentError,
     "scales[1]"),
    ("sweep-scales-nan", lambda: jaxsane.init_scale_sweep(optax_experiment(), scales=[float("nan")]), ArgumentError,
     "scales[0]"),
    # ---- locate, check_replicas
    ("locate-int", lambda: jaxsane.locate(5, X), JaxsaneError, "locate needs a callable"),
    ("replicas-root-int", lambda: jaxsane.check_replicas(PARAMS, root=3), ArgumentError, "root"),
    ("replicas-step-neg", lambda: jaxsane.check_replicas(PARAMS, step=-1), ArgumentError, "step"),
    # ---- write_html
    ("html-missing-dir", lambda: jaxsane.write_html("/nonexistent/dir/r.html", _diag()), ArgumentError,
     "does not exist"),
    ("html-dir", lambda: jaxsane.write_html(os.getcwd(), _diag()), ArgumentError, "is a directory"),
    ("html-path-none", lambda: jaxsane.write_html(None, _diag()), ArgumentError, "a file path"),
    ("html-diagnoses-str", lambda: jaxsane.write_html("r.html", "diag"), ArgumentError, "jaxsane.Diagnosis"),
]


@pytest.mark.parametrize("call, error, text", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_a_clear_jaxsane_error(call, error, text):
    with pytest.raises(Exception) as info:
        call()
    err = info.value
    assert isinstance(err, JaxsaneError), f"{type(err).__name__} leaked: {err}"
    assert isinstance(err, error), f"expected {error.__name__}, got {type(err).__name__}: {err}"
    message = str(err)
    assert message.startswith("[jaxsane] ")
    assert text in message, message
    if isinstance(err, ArgumentError):  # the four parts: what, where (fn(name=...)), cause when known, fix
        assert "Fix:" in message or "fix" in message.lower(), message


def test_there_are_many_cases():
    assert len(CASES) >= 50


def test_argument_error_keeps_old_except_clauses_working():
    with pytest.raises(ValueError):
        jaxsane.Monitor(PureExperiment(optax_experiment()), every=0)
    with pytest.raises(TypeError):
        jaxsane.overfit(optax_experiment(), steps="100")


# ----------------------------------------------------------------------------- correct counterparts

def test_good_arguments_pass_the_same_validators(tmp_path):
    exp = _exp(name="ok", num_classes=3, eval=batch(seed=1), inputs=lambda b: b["x"], labels=lambda b: b["y"])
    assert exp.name == "ok"
    assert jaxsane.Experiment(init=optax_init, step=optax_step, train=batch(), num_classes=np.int64(3)).num_classes == 3
    assert jaxsane.check_init(optax_apply, PARAMS, X, Y, num_classes=3) is not None
    assert jaxsane.check_replicas(PARAMS, root="params", step=0) == []
    mon = jaxsane.Monitor(optax_experiment(), every=np.int64(2))  # an Experiment is adapted; numpy ints work
    assert mon.every == 2 and isinstance(mon.adapted, PureExperiment)
    path = jaxsane.write_html(tmp_path / "r.html", _diag())
    assert os.path.exists(path)
    assert jaxsane.check_batch_independence(optax_apply, PARAMS, X, probes=[0, 7]) == []


def test_check_training_reads_a_history_dict():
    h = jaxsane.History()
    h.steps = list(range(40))
    h.loss = [1.0 + 0.1 * i for i in range(40)]  # rising: train.diverging
    from_history = [f.code for f in jaxsane.check_training(h)]
    from_dict = [f.code for f in jaxsane.check_training(h.to_dict())]
    assert "train.diverging" in from_history and from_dict == from_history


# ----------------------------------------------------------------------------- data.* findings

def _codes(d, code):
    return [f for f in d if f.code == code]


def test_train_and_eval_with_different_feature_shapes_is_data_shape():
    rng = np.random.default_rng(0)
    x16, x8 = rng.normal(size=(32, 16)).astype(np.float32), rng.normal(size=(32, 8)).astype(np.float32)
    y = rng.integers(0, 3, 32)
    bad = _codes(check_data((x16, y), (x8, y), num_classes=3), "data.shape")
    assert len(bad) == 1 and bad[0].severity == "error"
    assert "(8,)" in bad[0].message and "(16,)" in bad[0].message and bad[0].path.startswith("eval")
    good = check_data((x16, y), (rng.normal(size=(32, 16)).astype(np.float32), y), num_classes=3)
    assert _codes(good, "data.shape") == []


def test_train_and_eval_with_different_dtypes():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    pixels = rng.integers(0, 256, (32, 4)).astype(np.uint8)
    kind = _codes(check_data(x, pixels), "data.shape")
    assert len(kind) == 1 and kind[0].severity == "error" and "uint8" in kind[0].message
    x64 = rng.normal(size=(32, 4))
    assert _codes(check_data(x, x64), "data.shape") == []  # jax runs both in float32
    with jax.enable_x64(True):
        width = _codes(check_data(x, x64), "data.shape")  # now the eval runs in float64
    assert len(width) == 1 and width[0].severity == "warning"


def test_padded_sequences_of_another_length_in_eval_are_a_warning():
    rng = np.random.default_rng(0)

    def seqs(length):
        tokens = rng.integers(1, 50, (16, length)).astype(np.int32)
        return {"tokens": tokens, "mask": np.ones_like(tokens)}
    found = _codes(check_data(seqs(12), seqs(20)), "data.shape")
    assert len(found) == 1 and found[0].severity == "warning"
    assert _codes(check_data(seqs(12), seqs(12)), "data.shape") == []


def test_zero_rows_is_data_empty():
    d = check_data((X[:0], Y[:0]), num_classes=3)
    assert d.codes == ["data.empty"] and d[0].severity == "error"
    assert _codes(check_data((X, Y), (X[:0], Y[:0]), num_classes=3), "data.empty")[0].path == "eval"
    assert _codes(check_data((X, Y), num_classes=3), "data.empty") == []


def test_an_empty_batch_in_a_stream_is_a_warning():
    d = check_data([(X, Y), (X[:0], Y[:0]), (X, Y)])
    found = _codes(d, "data.empty")
    assert len(found) == 1 and found[0].severity == "warning" and found[0].extra["batches"] == [1]
    assert _codes(check_data([(X, Y), (X, Y)]), "data.empty") == []


def test_an_endless_generator_is_read_up_to_the_default_limit():
    read = []

    def endless():
        rng = np.random.default_rng(0)
        while True:
            read.append(1)
            yield {"x": rng.normal(size=(4, 3)).astype(np.float32)}
    d = check_data(endless())
    partial = _codes(d, "data.partial")
    assert len(partial) == 1 and partial[0].severity == "info"
    assert f"first {DEFAULT_MAX_BATCHES} batches" in partial[0].message
    assert len(read) == DEFAULT_MAX_BATCHES + 1  # the limit, plus one batch to learn that there was more
    assert d.artifacts["data"]["train"]["batches"] == DEFAULT_MAX_BATCHES

    read.clear()  # an explicit limit is the user's choice: no extra batch read, no finding
    assert _codes(check_data(endless(), max_batches=5), "data.partial") == [] and len(read) == 5


def test_a_finite_stream_is_read_whole_without_data_partial():
    assert _codes(check_data([(X, Y)] * 3), "data.partial") == []


def test_negative_labels_are_data_label_range_with_or_without_num_classes():
    y = Y.copy()
    y[2] = -1
    for kwargs in ({}, {"num_classes": 3}):
        found = _codes(check_data((X, y), **kwargs), "data.label_range")
        assert len(found) == 1 and found[0].extra["indices"] == [2] and "-1" in found[0].message
        assert _codes(check_data((X, Y), **kwargs), "data.label_range") == []


def _masked_loss(params, b):
    valid = b["y"] >= 0
    per = optax.softmax_cross_entropy_with_integer_labels(optax_apply(params, b["x"]), jnp.where(valid, b["y"], 0))
    return jnp.sum(jnp.where(valid, per, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


def _masked_step(state, b):
    params, opt_state = state
    value, grads = jax.value_and_grad(_masked_loss)(params, b)
    updates, opt_state = TX.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), {"loss": value}


def _labelled(y, **kw):
    b = batch()
    b["y"] = y
    return jaxsane.Experiment(init=optax_init, step=jax.jit(_masked_step), train=[b] * 3, loss=_masked_loss,
                              apply=optax_apply, num_classes=3, **kw)


def test_fit_refuses_out_of_range_labels_before_the_first_step():
    for bad, what in ((-1, "-1"), (3, "3")):
        y = Y.copy()
        y[2] = bad
        with pytest.raises(DataError, match=r"fit: train batch 0 has labels out of range") as info:
            jaxsane.fit(_labelled(y), steps=2, progress=False)
        assert what in str(info.value) and "Experiment(mask=" in str(info.value)


@pytest.mark.slow
def test_fit_trains_on_in_range_labels_and_on_a_masked_ignore_index():
    assert jaxsane.fit(_labelled(Y.copy()), steps=2, progress=False).step == 2
    y = Y.copy()
    y[2] = -100                                   # an ignore index the declared mask covers
    valid = (y != -100).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxsane.JaxsaneWarning)   # no rollback, no warning
        result = jaxsane.fit(_labelled(y, mask=lambda b: b["y"] >= 0), steps=2, progress=False)
    assert result.step == 2 and result.rollbacks == 0
