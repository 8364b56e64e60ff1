"""fit under damage: broken checkpoints, lost metrics, full disks, bad arguments, data that runs out, rollbacks."""

import errno
import glob
import json
import os
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_fit as T

import jaxsane
from jaxsane import CheckpointError, FitArgumentError
from jaxsane._experiment.contract import PureExperiment
from jaxsane._fit import checkpoint as _checkpoint

FIT = dict(T.FIT, eval_every=0)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """Checkpoints at steps 1, 3 and 6 of a 6-step run, and that run's result."""
    ckpt = str(tmp_path_factory.mktemp("pristine") / "ckpt")
    first = jaxsane.fit(T.experiment(n=12), steps=6, checkpoint_dir=ckpt, checkpoint_every=3, **FIT)
    assert sorted(int(d) for d in os.listdir(ckpt) if d.isdigit()) == [1, 3, 6]
    return ckpt, first


def _copy(pristine, tmp_path) -> str:
    dst = str(tmp_path / "ckpt")
    shutil.copytree(pristine[0], dst)
    return dst


def _like():
    return PureExperiment(T.experiment(n=1), key=jax.random.key(0)).init(jax.random.key(0))


def _data_files(step_dir):
    return [f for f in glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True) if os.path.isfile(f)]


def _truncate(d):
    for f in _data_files(d):
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)


def _zero_fill(d):
    for f in _data_files(d):
        size = os.path.getsize(f)
        with open(f, "wb") as fh:
            fh.write(b"\0" * size)


def _bit_flip(d):
    for f in _data_files(d):
        data = bytearray(open(f, "rb").read())
        data[len(data) // 2] ^= 0x40
        open(f, "wb").write(bytes(data))


def _checksum_mismatch(d):
    """The data no longer matches the checksum written with it (as after a flip that the store does not see)."""
    path = os.path.join(d, "meta", "metadata")
    meta = json.load(open(path))
    meta["checksums"][1] = "%08x" % (int(meta["checksums"][1], 16) ^ 1)
    json.dump(meta, open(path, "w"))


def _missing_state_item(d):
    shutil.rmtree(os.path.join(d, "state"))


def _missing_meta_item(d):
    shutil.rmtree(os.path.join(d, "meta"))


def _garbled_meta_json(d):
    open(os.path.join(d, "meta", "metadata"), "w").write('{"position": 6, "check')


def _deleted_meta_metadata(d):
    os.remove(os.path.join(d, "meta", "metadata"))


DAMAGE = [_truncate, _zero_fill, _bit_flip, _checksum_mismatch, _missing_state_item, _missing_meta_item,
          _garbled_meta_json, _deleted_meta_metadata]


def _tree(root):
    return sorted((os.path.relpath(os.path.join(d, f), root), os.path.getsize(os.path.join(d, f)))
                  for d, _, fs in os.walk(root) for f in fs)


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__.strip("_"))
def test_a_damaged_newest_checkpoint_is_skipped_for_the_newest_intact_one(pristine, tmp_path, damage):
    ckpt = _copy(pristine, tmp_path)
    damage(os.path.join(ckpt, "6"))
    store = _checkpoint.Checkpoints(ckpt, 3, _like())
    try:
        step, state, meta, skipped = store.restore_verified()
    finally:
        store.close()
    assert step == 3 and meta["position"] == 3
    assert [s for s, _ in skipped] == [6] and skipped[0][1]
    # set aside, never deleted
    assert not os.path.exists(os.path.join(ckpt, "6")) and os.path.isdir(os.path.join(ckpt, "6.jaxsane-damaged"))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))


def test_intact_checkpoints_and_orbax_tmp_dirs_resume_from_the_newest(pristine, tmp_path):
    ckpt = _copy(pristine, tmp_path)
    # a half-written step directory as orbax leaves it when killed mid-save: ignored
    shutil.copytree(os.path.join(ckpt, "6"), os.path.join(ckpt, "9.orbax-checkpoint-tmp-1234"))
    _truncate(os.path.join(ckpt, "9.orbax-checkpoint-tmp-1234"))
    store = _checkpoint.Checkpoints(ckpt, 3, _like())
    try:
        step, _, _, skipped = store.restore_verified()
    finally:
        store.close()
    assert step == 6 and skipped == []


def test_deleted_orbax_metadata_with_intact_data_still_resumes_from_it(pristine, tmp_path):
    """orbax restores the arrays without its metadata files; the checksums prove them intact."""
    ckpt = _copy(pristine, tmp_path)
    os.remove(os.path.join(ckpt, "6", "_CHECKPOINT_METADATA"))
    os.remove(os.path.join(ckpt, "6", "state", "_METADATA"))
    store = _checkpoint.Checkpoints(ckpt, 3, _like())
    try:
        step, _, meta, skipped = store.restore_verified()
    finally:
        store.close()
    assert step == 6 and skipped == [] and meta["position"] == 6


def test_a_half_written_numbered_step_dir_is_skipped(pristine, tmp_path):
    ckpt = _copy(pristine, tmp_path)
    os.makedirs(os.path.join(ckpt, "9", "state"))
    open(os.path.join(ckpt, "9", "state", "partial"), "w").write("x")
    store = _checkpoint.Checkpoints(ckpt, 3, _like())
    try:
        step, _, _, skipped = store.restore_verified()
    finally:
        store.close()
    assert step == 6 and [s for s, _ in skipped] == [9]


def test_a_checkpoint_holding_inf_is_not_trusted(tmp_path):
    """A state that went to Inf on disk (a flipped exponent bit) is rejected even with matching checksums."""
    like = _like()
    store = _checkpoint.Checkpoints(str(tmp_path / "ckpt"), 3, like)
    store.save(1, like, {"position": 1})
    bad = jax.tree.map(lambda x: x, like)
    bad[0]["h"]["w"] = bad[0]["h"]["w"].at[0, 0].set(jnp.inf)
    store.save(2, bad, {"position": 2})
    store.manager.wait_until_finished()
    step, _, _, skipped = store.restore_verified()
    store.close()
    assert step == 1 and skipped[0][0] == 2 and "NaN/Inf" in skipped[0][1] and "['h']['w']" in skipped[0][1]


def test_no_intact_checkpoint_is_an_error_that_touches_no_file(pristine, tmp_path):
    ckpt = _copy(pristine, tmp_path)
    for step in (1, 3, 6):
        _truncate(os.path.join(ckpt, str(step)))
    before = _tree(ckpt)
    with pytest.raises(CheckpointError, match=r"no intact checkpoint") as info:
        jaxsane.fit(T.experiment(n=12), steps=8, checkpoint_dir=ckpt, checkpoint_every=3, **FIT)
    assert "step 6" in str(info.value) and "step 1" in str(info.value) and str(info.value).startswith("[jaxsane]")
    assert [s for s, _ in info.value.skipped] == [6, 3, 1]
    assert _tree(ckpt) == before


def _train_steps(path):
    return [json.loads(line)["step"] for line in open(path) if '"train"' in line]


@pytest.mark.slow
def test_fit_falls_back_past_a_damaged_checkpoint_and_rebuilds_deleted_metrics(pristine, tmp_path):
    ckpt = _copy(pristine, tmp_path)
    _truncate(os.path.join(ckpt, "6"))
    os.remove(os.path.join(ckpt, "metrics.jsonl"))
    with pytest.warns(jaxsane.JaxsaneWarning, match=r"resuming from checkpoint step 3.*step 6: cannot be restored"):
        resumed = jaxsane.fit(T.experiment(n=12), steps=7, checkpoint_dir=ckpt, checkpoint_every=3, **FIT)
    assert resumed.resumed_from == 3 and [s for s, _ in resumed.skipped_checkpoints] == [6]
    assert resumed.history.steps == list(range(7))
    np.testing.assert_allclose(resumed.losses[:6], pristine[1].losses, rtol=1e-6)
    assert _train_steps(os.path.join(ckpt, "metrics.jsonl")) == list(range(7))


@pytest.mark.slow
def test_a_truncated_metrics_file_is_rebuilt_from_the_checkpoint(pristine, tmp_path):
    ckpt = _copy(pristine, tmp_path)
    path = os.path.join(ckpt, "metrics.jsonl")
    text = open(path).read()
    open(path, "w").write(text[: len(text) // 3])    # a partial last line, most of the history gone
    resumed = jaxsane.fit(T.experiment(n=12), steps=7, checkpoint_dir=ckpt, checkpoint_every=3, **FIT)
    assert resumed.resumed_from == 6 and resumed.history.steps == list(range(7))
    np.testing.assert_allclose(resumed.losses[:6], pristine[1].losses, rtol=1e-6)
    assert _train_steps(path) == list(range(7))
    assert all(line.endswith("}") for line in open(path).read().splitlines())


def test_metrics_replace_is_atomic(tmp_path, monkeypatch):
    """A failure half-way through the rewrite leaves the old file whole."""
    path = str(tmp_path / "m.jsonl")
    _checkpoint.replace_lines(path, ['{"a": 1}'])
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(OSError):
        _checkpoint.replace_lines(path, ['{"b": 2}'] * 100)
    assert open(path).read() == '{"a": 1}\n' and os.listdir(tmp_path) == ["m.jsonl"]


# ----------------------------------------------------------------------------- full and read-only disks

@pytest.mark.slow
def test_a_full_disk_stops_fit_after_the_last_good_checkpoint(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp
    ckpt = str(tmp_path / "ckpt")
    real_save = ocp.CheckpointManager.save

    def save(self, step, *a, **kw):
        if step >= 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(self, step, *a, **kw)
    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    with pytest.raises(CheckpointError, match=r"disk is full") as info:
        jaxsane.fit(T.experiment(n=12), steps=8, checkpoint_dir=ckpt, checkpoint_every=2, **FIT)
    assert "last complete checkpoint is step 2" in str(info.value)
    monkeypatch.setattr(ocp.CheckpointManager, "save", real_save)
    resumed = jaxsane.fit(T.experiment(n=12), steps=5, checkpoint_dir=ckpt, checkpoint_every=2, **FIT)
    assert resumed.resumed_from == 2 and resumed.skipped_checkpoints == [] and resumed.history.steps == list(range(5))


_FULL_DISK_CHILD = """
import errno, sys
sys.path.insert(0, {here!r})
import test_fit as T, jaxsane
from orbax.checkpoint._src.handlers import json_checkpoint_handler as J
real = J.JsonCheckpointHandler._save_fn
async def full(self, x, directory):  # the disk fills up while orbax writes step 4 in its background threads
    if int(str(directory.parent.name).split(".")[0]) >= 4:
        raise OSError(errno.ENOSPC, "No space left on device")
    return await real(self, x, directory)
J.JsonCheckpointHandler._save_fn = full
try:
    jaxsane.fit(T.experiment(n=12), steps=8, checkpoint_dir={ckpt!r}, checkpoint_every=2, eval_every=0, **T.FIT)
except jaxsane.CheckpointError as e:
    print(e, file=sys.stderr)
    sys.exit(3)
"""


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_disk_that_fills_during_a_background_save_gives_one_clear_error_and_no_exit_noise(tmp_path):
    import subprocess
    import sys
    script = tmp_path / "full.py"
    script.write_text(_FULL_DISK_CHILD.format(here=os.path.dirname(os.path.abspath(T.__file__)),
                                              ckpt=str(tmp_path / "ckpt")))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root})
    assert proc.returncode == 3, proc.stderr[-3000:]
    err = proc.stderr
    assert err.count("[jaxsane]") == 1 and "the disk is full" in err and "last complete checkpoint is step 2" in err
    # orbax's own per-thread error logs, and a save thread dying at interpreter exit, are gone
    for noise in ("Traceback", "ImportError", "sys.meta_path", "cannot schedule new futures", "ERROR:absl"):
        assert noise not in err, err[-3000:]


@pytest.mark.slow
def test_a_read_only_metrics_file_is_a_clear_error(tmp_path, monkeypatch):
    def append(path, lines):
        raise OSError(errno.EROFS, "Read-only file system", path)
    monkeypatch.setattr(_checkpoint, "append_lines", append)
    with pytest.raises(CheckpointError, match=r"read-only") as info:
        jaxsane.fit(T.experiment(n=4), steps=2, metrics_path=str(tmp_path / "m.jsonl"), **FIT)
    assert "m.jsonl" in str(info.value) and "fix:" in str(info.value)


# ----------------------------------------------------------------------------- bad arguments

def test_bad_arguments_are_refused_before_any_work(tmp_path):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    exp = T.experiment(n=4)
    cases = [
        (dict(steps="100"), r"steps=.*must be an int"),
        (dict(steps=3.5), r"steps=.*must be an int"),
        (dict(steps=True), r"steps=.*must be an int"),
        (dict(steps=2, checkpoint_dir=str(a_file)), r"existing file, not a directory"),
        (dict(steps=2, checkpoint_dir=str(a_file / "ckpt")), r"cannot be created"),
        (dict(steps=2, report=str(tmp_path / "missing" / "r.html")), r"does not exist"),
        (dict(steps=2, metrics_path=str(a_file / "m.jsonl")), r"cannot be created"),
        (dict(steps=2, dump_dir=str(a_file / "dumps")), r"cannot be created: .*file\.txt is a file"),
        (dict(steps=2, checkpoint_dir=123), r"must be a path"),
        (dict(steps=2, on_nonfinite="ignore"), r"'rollback', 'skip', 'raise'"),
        (dict(steps=2, eval_every=-1), r"eval_every"),
        (dict(steps=2, eval_every=2.5), r"eval_every"),
        (dict(steps=2, checkpoint_every=0), r"checkpoint_every"),
        (dict(steps=2, patience="3"), r"patience"),
        (dict(steps=2, min_delta=-1.0), r"min_delta"),
        (dict(steps=2, rollback_every=0), r"rollback_every"),
    ]
    for kwargs, match in cases:
        with pytest.raises(FitArgumentError, match=match) as info:
            jaxsane.fit(exp, progress=False, **kwargs)
        assert str(info.value).startswith("[jaxsane]"), kwargs
        assert isinstance(info.value, jaxsane.ExperimentError)
    assert sorted(os.listdir(tmp_path)) == ["file.txt"]      # nothing was created


# ----------------------------------------------------------------------------- data and dtypes

@pytest.mark.slow
def test_data_that_runs_out_says_so_unless_asked_to_repeat():
    with pytest.warns(jaxsane.JaxsaneWarning, match=r"ran out after 5 batches.*repeat=True"):
        short = jaxsane.fit(T.experiment(n=5), steps=8, **FIT)
    assert short.step == 5 and short.data_exhausted_at == 5
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxsane.JaxsaneWarning)
        cycled = jaxsane.fit(T.experiment(n=5), steps=8, repeat=True, **FIT)
    assert cycled.step == 8 and cycled.data_exhausted_at is None and cycled.history.steps == list(range(8))
    # a one-shot iterator cannot be read again: it runs out even with repeat=True
    one_shot = T.experiment(train=iter(list(T.Batches(n=3))))
    with pytest.warns(jaxsane.JaxsaneWarning, match=r"ran out after 3"):
        assert jaxsane.fit(one_shot, steps=6, repeat=True, **FIT).data_exhausted_at == 3


@pytest.mark.slow
def test_a_step_that_changes_a_parameter_dtype_is_flagged_once():
    @jax.jit
    def half_step(state, batch):
        (params, opt_state), metrics = T.step(state, batch)
        params = dict(params, out=dict(params["out"], w=params["out"]["w"].astype(jnp.float16)))
        return (params, opt_state), metrics

    exp = jaxsane.Experiment(init=T.init, step=half_step, train=T.Batches(n=4), loss=T.loss, name="f16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jaxsane.fit(exp, steps=4, **FIT)
    flagged = [w for w in caught if "changed the dtype" in str(w.message)]
    assert len(flagged) == 1 and "params['out']['w']: float32 -> float16" in str(flagged[0].message)


# ----------------------------------------------------------------------------- rollback keeps good work

@pytest.mark.slow
def test_rollback_loses_only_the_offending_batches():
    """Bad batches at steps 30 and 38 with checkpoints every 100 steps: the result equals a run on the same
    data without those two batches."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = jaxsane.fit(T.experiment(n=45, poison_at=(30, 38)), steps=45, checkpoint_every=100, **FIT)
    assert result.rollbacks == 2 and result.skipped_batches == [30, 38] and result.step == 45
    notices = [str(w.message) for w in caught if "rolled back" in str(w.message)]
    assert len(notices) == 2 and "\n" in notices[0] and "\n" not in notices[1]   # full report once, then a line
    assert result.history.steps == [i for i in range(45) if i not in (30, 38)]
    (nan,) = result.diagnosis.by_code("nonfinite")   # the same failure twice: one finding with a count
    assert (nan.first_step, nan.last_step, nan.count) == (30, 38, 2)
    clean = [b for i, b in enumerate(T.Batches(n=45)) if i not in (30, 38)]
    reference = jaxsane.fit(T.experiment(train=clean), steps=43, **FIT)
    np.testing.assert_allclose(result.losses, reference.losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(result.state), jax.tree.leaves(reference.state)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_failing_fit_still_writes_its_report_and_names_it(tmp_path):
    path = str(tmp_path / "fit.html")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(jaxsane.NonFiniteError, match=r"report: .*fit\.html") as info:
            jaxsane.fit(T.experiment(n=12, poison_at=(3, 5)), steps=12, max_rollbacks=1, report=path, **FIT)
    assert os.path.exists(path) and "nonfinite" in open(path).read()
    assert info.value.finding is not None and info.value.finding.code.startswith("nonfinite")


@pytest.mark.slow
def test_an_interrupted_fit_still_writes_its_report_and_metrics(tmp_path):
    class Interrupted(T.Batches):
        def __iter__(self):
            for i, batch in enumerate(super().__iter__()):
                if i == 3:
                    raise KeyboardInterrupt
                yield batch

    path, metrics = str(tmp_path / "fit.html"), str(tmp_path / "m.jsonl")
    with pytest.raises(KeyboardInterrupt) as info:
        jaxsane.fit(T.experiment(train=Interrupted(n=10)), steps=10, report=path, metrics_path=metrics, **FIT)
    assert os.path.exists(path) and any(path in note for note in info.value.__notes__)
    assert _train_steps(metrics) == [0, 1, 2]


@pytest.mark.slow
def test_nnx_rollback_restores_the_kept_state():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            return self.b(nnx.relu(self.a(x)))

    def nnx_init(key):
        model = Net(nnx.Rngs(params=key))
        return model, nnx.Optimizer(model, T.optax.adam(1e-2), wrt=nnx.Param)

    def nnx_loss(model, batch):
        value = T.optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()
        return value + jnp.where(batch["poison"] > 0, jnp.nan, 0.0)     # a poisoned batch: NaN grads

    @nnx.jit
    def nnx_step(model, optimizer, batch):
        value, grads = nnx.value_and_grad(nnx_loss)(model, batch)
        optimizer.update(model, grads)
        return value

    with pytest.warns(jaxsane.JaxsaneWarning, match="rolled back"):
        result = jaxsane.fit(jaxsane.Experiment(init=nnx_init, step=nnx_step, train=T.Batches(n=12, poison_at=(6,)),
                                                loss=nnx_loss, name="nnx"), steps=12, rollback_every=4, **FIT)
    assert result.rollbacks == 1 and result.skipped_batches == [6] and result.step == 12
    model, _ = result.user_state
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert np.isfinite(result.losses).all() and len(result.losses) == 11
