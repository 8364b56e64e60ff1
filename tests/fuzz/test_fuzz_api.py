"""Fuzzed arguments of the public API: each field of ``Experiment`` and each argument of the public
functions gets random values of the wrong type or range. Every one is a JaxsaneError subclass whose message
names the field or argument, raised before any work (so each call takes milliseconds)."""

import math
import numbers
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _fuzz import Hang, fuzz_settings, time_limit
from _programs import batch, optax_experiment, optax_init, optax_loss, optax_step
from hypothesis import assume, event, given
from hypothesis import strategies as st

import jaxsane
from jaxsane import JaxsaneError

pytestmark = pytest.mark.slow


def _named(value, label):
    return st.just(value).map(lambda v: v)  # noqa: B023  (each value stands for itself)


# values of every kind users pass by mistake; objects are built fresh per example (never shared)
ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.integers(-3, 3), max_size=3),
    st.tuples(st.floats(allow_nan=False, allow_infinity=False)),
    st.dictionaries(st.text(max_size=3), st.integers(-3, 3), max_size=2),
    st.builds(object),
    st.just(int),
    st.just(1 + 2j),
    st.builds(lambda: (lambda *a, **k: None)),
    st.builds(lambda n: np.ones(n, np.float32), st.integers(0, 3)),
    st.builds(lambda: np.float32(0.5)),
    st.builds(lambda: np.int64(3)),
    st.builds(lambda: np.bool_(True)),
    st.builds(lambda: np.array(2)),
    st.builds(lambda: np.array(["a", "b"])),
    st.builds(lambda: {"x": "text"}),
)


# ----------------------------------------------------------------------------- what counts as valid

def _ambiguous(v) -> bool:
    """numpy scalars and 0-d arrays: some functions take them for numbers, some refuse; neither is a bug."""
    return isinstance(v, (np.generic, np.ndarray)) and np.ndim(v) == 0


def _int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def int_ge(lo, none=False):
    return lambda v: (none and v is None) or (_int(v) and v >= lo)


def real(lo=None, positive=False, hi=None, none=False):
    return lambda v: (none and v is None) or (
        _real(v) and (lo is None or v >= lo) and (not positive or v > 0) and (hi is None or v <= hi)
    )


def boolean(v):
    return isinstance(v, bool)


def path_like(v):  # any str is a path: the fuzz gives paths the wrong *type* only (a str path would be created)
    return v is None or isinstance(v, (str, os.PathLike))


def choice(*words):
    return lambda v: isinstance(v, str) and v in words


def callable_or_none(v):
    return v is None or callable(v)


def numbers_seq(lo=None, none=False):
    def ok(v):
        if none and v is None:
            return True
        if isinstance(v, (str, bytes, dict)) or not hasattr(v, "__iter__"):
            return False
        items = list(v)
        return bool(items) and all(_real(x) and (lo is None or x >= lo) for x in items)
    return ok


def key_or_none(v):
    return v is None or (hasattr(v, "dtype") and (jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key)
                                                  or (v.dtype == np.uint32 and np.shape(v)[-1:] == (2,))))


def either(*preds):
    return lambda v: any(p(v) for p in preds)


# ----------------------------------------------------------------------------- the table

EXP = optax_experiment(eval=batch(seed=1))
HISTORY = jaxsane.History()
PARAMS = optax_init(jax.random.key(0))[0]


def _fit(**kw):
    return jaxsane.fit(EXP, steps=kw.pop("steps", 2), progress=kw.pop("progress", False), **kw)


FIT_ARGS = {
    "steps": int_ge(1), "eval_every": int_ge(0, True), "checkpoint_every": int_ge(1), "keep": int_ge(1),
    "resume": boolean, "key": key_or_none, "on_nonfinite": choice("rollback", "skip", "raise"),
    "max_rollbacks": int_ge(0), "patience": int_ge(1, True), "min_delta": real(0), "eval_batches": int_ge(1),
    "telemetry_every": int_ge(1, True), "dead_every": int_ge(0, True), "log_every": int_ge(1),
    "metrics_path": path_like, "tensorboard_dir": path_like, "progress": boolean, "report": path_like,
    "dump_dir": path_like, "thresholds": lambda v: v is None or isinstance(v, dict), "restore_best": boolean,
    "repeat": boolean, "rollback_every": int_ge(1, True), "checks": boolean, "checkpoint_dir": path_like,
    "hang_timeout": either(real(positive=True, none=True), choice("auto")),
}

CASES = [("fit", name, (lambda name: lambda v: _fit(**{name: v}))(name), ok) for name, ok in FIT_ARGS.items()]
CASES += [
    ("check_step", "calls", lambda v: jaxsane.check_step(EXP, calls=v), int_ge(2)),
    ("check_step", "check_rng", lambda v: jaxsane.check_step(EXP, check_rng=v), boolean),
    ("check_step", "key", lambda v: jaxsane.check_step(EXP, key=v), key_or_none),
    ("check_step", "experiment", lambda v: jaxsane.check_step(v), lambda v: False),
    ("overfit", "steps", lambda v: jaxsane.overfit(EXP, steps=v), int_ge(1)),
    ("overfit", "seeds", lambda v: jaxsane.overfit(EXP, seeds=v),
     lambda v: v is None or int_ge(1)(v) or (numbers_seq()(v) and all(_int(x) for x in v))),
    ("overfit", "learning_rates", lambda v: jaxsane.overfit(EXP, learning_rates=v), numbers_seq(0, True)),
    ("overfit", "init_scales", lambda v: jaxsane.overfit(EXP, init_scales=v), numbers_seq(0, True)),
    ("overfit", "target_accuracy", lambda v: jaxsane.overfit(EXP, target_accuracy=v), real(0, hi=1)),
    ("overfit", "batch_size", lambda v: jaxsane.overfit(EXP, batch_size=v), int_ge(1)),
    ("overfit", "baseline", lambda v: jaxsane.overfit(EXP, baseline=v), boolean),
    ("overfit", "progress", lambda v: jaxsane.overfit(EXP, progress=v), boolean),
    ("init_scale_sweep", "scales", lambda v: jaxsane.init_scale_sweep(EXP, scales=v), numbers_seq(0)),
    ("check_grads", "order", lambda v: jaxsane.check_grads(optax_loss, PARAMS, batch(), order=v), int_ge(1)),
    ("check_grads", "eps", lambda v: jaxsane.check_grads(optax_loss, PARAMS, batch(), eps=v), real(positive=True, none=True)),
    ("check_grads", "has_aux", lambda v: jaxsane.check_grads(optax_loss, PARAMS, batch(), has_aux=v), boolean),
    ("check_grads", "f", lambda v: jaxsane.check_grads(v, PARAMS, batch()), callable),
    ("check_data", "num_classes", lambda v: jaxsane.check_data(batch(), num_classes=v), int_ge(1, True)),
    ("check_data", "max_batches", lambda v: jaxsane.check_data([batch()], max_batches=v), int_ge(1, True)),
    ("check_data", "max_duplicate_fraction", lambda v: jaxsane.check_data(batch(), max_duplicate_fraction=v),
     real(0, hi=1)),
    ("check_data", "integer_features", lambda v: jaxsane.check_data(batch(), integer_features=v),
     lambda v: v is None or isinstance(v, bool)),
    ("check_data", "apply", lambda v: jaxsane.check_data(batch(), apply=v), callable_or_none),
    ("check_training", "min_steps", lambda v: jaxsane.check_training(HISTORY, min_steps=v), int_ge(1)),
    ("check_training", "history", lambda v: jaxsane.check_training(v), lambda v: isinstance(v, (jaxsane.History, dict))),
    ("guard", "on_nonfinite", lambda v: jaxsane.guard(optax_step, on_nonfinite=v), choice("raise", "skip", "warn")),
    ("guard", "max_lag", lambda v: jaxsane.guard(optax_step, max_lag=v), int_ge(0)),
    ("guard", "sync", lambda v: jaxsane.guard(optax_step, sync=v), boolean),
    ("guard", "step", lambda v: jaxsane.guard(v), callable),
    ("guard", "hang_timeout", lambda v: jaxsane.guard(optax_step, hang_timeout=v), real(positive=True, none=True)),
    ("doctor", "progress", lambda v: jaxsane.doctor(EXP, progress=v), boolean),
    ("doctor", "stages", lambda v: jaxsane.doctor(EXP, stages=v), lambda v: v is None),
    ("doctor", "run_steps", lambda v: jaxsane.doctor(EXP, run_steps=v), int_ge(1)),
    ("doctor", "init_loss_rtol", lambda v: jaxsane.doctor(EXP, init_loss_rtol=v), real(0)),
    ("load_dump", "max_bytes", lambda v: jaxsane.load_dump(_DUMP, max_bytes=v), int_ge(1)),
    ("load_dump", "max_depth", lambda v: jaxsane.load_dump(_DUMP, max_depth=v), int_ge(1)),
    ("load_dump", "path", lambda v: jaxsane.load_dump(v), path_like),
    ("write_html", "path", lambda v: jaxsane.write_html(v, jaxsane.Diagnosis([], name="d")), path_like),
]
_DUMP = os.path.join(tempfile.mkdtemp(prefix="jaxsane-fuzz-api-"), "dump")
jaxsane.save_dump(_DUMP, (np.ones(2, np.float32),))


@given(case=st.sampled_from(CASES), value=ANY)
@fuzz_settings(1500)
def test_a_wrong_argument_is_a_jaxsane_error_naming_it(case, value):
    fn, name, call, valid = case
    assume(not _ambiguous(value))
    assume(not valid(value))  # a valid value would run the real work; the fuzz is for wrong ones
    event(f"{fn}({name}=...)")
    cwd = os.getcwd()
    os.chdir(os.path.dirname(_DUMP))  # anything a call creates lands in a scratch directory
    try:
        with time_limit(60):
            with pytest.raises(Exception) as info:
                call(value)
    except Hang:
        pytest.fail(f"{fn}({name}={value!r}) ran past 60 s instead of refusing the value")
    finally:
        os.chdir(cwd)
    err = info.value
    assert isinstance(err, JaxsaneError), f"{fn}({name}={value!r}): {type(err).__name__} leaked: {err}"
    assert str(err).startswith("[jaxsane]"), err
    assert name in str(err), f"{fn}({name}={value!r}): the message does not name {name}: {err}"


# ----------------------------------------------------------------------------- Experiment's fields

def _data_ok(v, required):
    if v is None:
        return not required
    if isinstance(v, (str, bytes, bool, numbers.Number)):
        return False
    return callable(v) or hasattr(v, "__iter__") or hasattr(v, "keys")


FIELDS = {
    "init": callable, "step": callable, "train": lambda v: _data_ok(v, True), "eval": lambda v: _data_ok(v, False),
    "loss": callable_or_none, "apply": callable_or_none, "params": callable_or_none, "inputs": callable_or_none,
    "labels": callable_or_none, "mask": callable_or_none, "examples": callable_or_none,
    "num_classes": lambda v: v is None or int_ge(2)(v), "name": lambda v: isinstance(v, str), "causal": lambda v: v is None or boolean(v),
}


@given(field=st.sampled_from(sorted(FIELDS)), value=ANY)
@fuzz_settings(800)
def test_a_wrong_experiment_field_is_an_experiment_error_naming_it(field, value):
    assume(not _ambiguous(value) or field in ("train", "eval"))
    assume(not FIELDS[field](value) or (field in ("train", "eval") and _ambiguous(value)))
    event(f"Experiment.{field}")
    base = dict(init=optax_init, step=optax_step, train=batch())
    with pytest.raises(jaxsane.ExperimentError, match=rf"Experiment\.{field}\b"):
        jaxsane.Experiment(**{**base, field: value})


@given(data=st.data())
@fuzz_settings(150)
def test_a_batch_of_the_wrong_shape_or_type_is_named_before_the_step_runs(data):
    """check_step(batch=...) and fit's eval data: batches of other structures, ranks, dtypes, feature sizes."""
    leaf = st.one_of(
        st.builds(lambda n, f: np.ones((n, f), np.float32), st.integers(1, 4), st.integers(1, 6)),
        st.builds(lambda n: np.ones((n, 4, 1), np.float32), st.integers(1, 4)),
        st.builds(lambda n: np.zeros(n, np.int32), st.integers(1, 4)),
        st.builds(lambda n: np.array(["a"] * n), st.integers(1, 3)),
        st.text(max_size=3), st.none(), st.builds(object),
    )
    wrong = data.draw(st.one_of(
        st.fixed_dictionaries({"x": leaf, "y": leaf}),
        st.fixed_dictionaries({"x": leaf}),
        st.fixed_dictionaries({"inputs": leaf, "y": leaf}),
        st.tuples(leaf, leaf),
        leaf,
    ))
    good = batch()
    same = jax.tree_util.tree_structure(wrong) == jax.tree_util.tree_structure(good) and all(
        isinstance(a, np.ndarray) and a.shape[1:] == b.shape[1:] and a.dtype == b.dtype
        for a, b in zip(jax.tree_util.tree_leaves(wrong), jax.tree_util.tree_leaves(good)))
    assume(not same)
    where = data.draw(st.sampled_from(["check_step", "fit eval"]))
    event(where)
    with time_limit(120):
        try:
            if where == "check_step":
                jaxsane.check_step(EXP, batch=wrong)
            else:
                exp = jaxsane.Experiment(init=optax_init, step=optax_step, train=batch(), eval=wrong, loss=optax_loss)
                jaxsane.fit(exp, steps=1, eval_every=1, progress=False)
        except JaxsaneError as e:
            assert str(e).startswith("[jaxsane]")
            event(type(e).__name__)
        except Hang:
            pytest.fail(f"{where} hung on {wrong!r}")
        else:  # accepted: then the batch must have been one the step (or the loss) can run on
            event("accepted")
