"""check_data: each data.* code (and nonfinite.input) triggered by faulty data, silent on clean data."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsane
from jaxsane import DataError, check_data
from jaxsane._data.row_hash import hash_rows
from jaxsane.examples._digits import load_digits_split, train_eval


def _digits():
    x, y, xe, ye = load_digits_split()
    return x.copy(), y.copy(), xe.copy(), ye.copy()


def _sequences(n=40, length=12, vocab=50, seed=0):
    """Token sequences of varying length, right-padded with 0, with a padding mask and next-token labels."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, length + 1, n)
    tokens = rng.integers(1, vocab, (n, length)).astype(np.int32)
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int32)
    tokens = tokens * mask
    labels = np.concatenate([tokens[:, 1:], np.zeros((n, 1), np.int32)], axis=1)
    return {"tokens": tokens, "labels": labels, "mask": mask}


def _stream(data, batch_size):
    """A single-pass generator of batches."""
    n = len(jax.tree_util.tree_leaves(data)[0])
    for s in range(0, n, batch_size):
        yield jax.tree_util.tree_map(lambda a: a[s:s + batch_size], data)


def _only(diagnosis, code):
    found = diagnosis.by_code(code)
    assert found, f"expected {code}, got {diagnosis}"
    return found


# ----------------------------------------------------------------------------- clean data: no findings

def test_digits_arrays_are_clean():
    x, y, xe, ye = _digits()
    d = check_data((x, y), (xe, ye), num_classes=10)
    assert list(d) == [], d
    assert d.artifacts["data"]["train"]["rows"] == len(x)
    assert sum(d.artifacts["data"]["train"]["class_counts"]) == len(y)


def test_digits_stream_and_dicts_are_clean():
    train, eval_ = train_eval()
    d = check_data(train, eval_, num_classes=10, max_batches=20)
    assert list(d) == [], d
    assert d.artifacts["data"]["train"]["batches"] == 20 and d.artifacts["data"]["train"]["stream"]


def test_digits_jax_arrays_are_clean():
    x, y, xe, ye = _digits()
    d = check_data({"x": jnp.asarray(x), "y": jnp.asarray(y)}, {"x": jnp.asarray(xe), "y": jnp.asarray(ye)},
                   num_classes=10)
    assert list(d) == [], d


def test_sequences_with_padding_are_clean():
    data = _sequences()
    assert list(check_data(data, _sequences(seed=1), num_classes=50)) == []
    assert list(check_data(_stream(data, 8), _stream(_sequences(seed=1), 8), num_classes=50)) == []


def test_clean_with_apply():
    x, y, _, _ = _digits()
    w = np.zeros((64, 10), np.float32)
    d = check_data((x, y), num_classes=10, apply=lambda p, inp: inp @ p, params=w)
    assert list(d) == [], d


# ----------------------------------------------------------------------------- labels

def test_label_out_of_range():
    x, y, _, _ = _digits()
    y[[3, 700]] = 10
    f = _only(check_data((x, y), num_classes=10), "data.label_range")[0]
    assert f.extra["count"] == 2 and f.extra["indices"] == [3, 700]
    assert "[0, 10)" in f.message and f.severity == "error" and f.hint


def test_negative_labels_without_num_classes():
    x, y, _, _ = _digits()
    y[5] = -1
    f = _only(check_data((x, y)), "data.label_range")[0]
    assert f.extra["indices"] == [5]


def test_one_ignore_value_out_of_range_is_a_warning_that_asks_for_the_mask():
    """Segmentation labels with 255 on the border pixels (masked by the loss, unknown to the checks) read as an
    ignore index: a warning that says to pass mask=, not an error; 1-based labels (C for C classes) stay one."""
    x, y, _, _ = _digits()
    y[[3, 700]] = 255
    f = _only(check_data((x, y), num_classes=10), "data.label_range")[0]
    assert f.severity == "warning" and f.extra["ignore_index"] == 255 and "mask=" in f.message, f
    y[[3, 700]] = 10
    assert _only(check_data((x, y), num_classes=10), "data.label_range")[0].severity == "error"
    y[[3]] = 255  # two values out of range: no single ignore index
    assert _only(check_data((x, y), num_classes=10), "data.label_range")[0].severity == "error"


def test_an_ignore_index_in_every_row_beside_class_ids_is_the_ignore_index_warning():
    """A masked LM's labels: -100 at every unmasked position of every row, class ids at the masked ones. No row is
    free of it, but class ids stand beside it in the same rows: the ignore-index warning, not the error."""
    data = _sequences()
    rng = np.random.default_rng(0)
    data["labels"] = np.where(rng.random(data["labels"].shape) < 0.15, data["labels"], -100)
    data["labels"][:, 0] = -100  # (every row holds it)
    f = _only(check_data(data, num_classes=50), "data.label_range")[0]
    assert f.severity == "warning" and f.extra["ignore_index"] == -100, f
    data["labels"][:] = -100  # nothing but the ignore value: no class id beside it
    assert _only(check_data(data, num_classes=50), "data.label_range")[0].severity == "error"


def test_float_labels_for_classification():
    x, y, _, _ = _digits()
    f = _only(check_data((x, y.astype(np.float32)), num_classes=10), "data.label_range")[0]
    assert "float" in f.message and "astype" in f.hint
    # one-hot labels are fine, soft labels outside [0, 1] are not
    onehot = np.eye(10, dtype=np.float32)[y]
    assert list(check_data((x, onehot), num_classes=10)) == []
    onehot[4] *= 3
    f = _only(check_data((x, onehot), num_classes=10), "data.label_range")[0]
    assert "[0, 1]" in f.message and "first indices [4]" in f.message


def test_masked_ignore_index_is_fine_but_unmasked_is_not():
    data = _sequences()
    data["labels"] = np.where(data["mask"] == 1, data["labels"], -100)
    assert list(check_data(data, num_classes=50)) == []
    data["labels"][2, 0] = -100  # an unmasked position
    f = _only(check_data(data, num_classes=50), "data.label_range")[0]
    assert f.extra["indices"] == [2]


# ----------------------------------------------------------------------------- shapes

def test_shape_change_across_batches():
    x, y, _, _ = _digits()
    batches = [{"x": x[:64], "y": y[:64]}, {"x": x[64:128], "y": y[64:128]},
               {"x": x[128:192, :32], "y": y[128:192]}]
    f = _only(check_data(batches, num_classes=10), "data.shape")[0]
    assert f.severity == "error" and "(32,)" in f.message and "batch 2" in f.message
    dtype_change = [{"x": x[:64], "y": y[:64]}, {"x": x[64:128].astype(np.float64), "y": y[64:128]}]
    assert _only(check_data(dtype_change, num_classes=10), "data.shape")[0].severity == "error"


def test_sequence_length_change_is_a_warning():
    a, b = _sequences(n=8, length=12), _sequences(n=8, length=10, seed=3)
    f = _only(check_data([a, b], num_classes=50), "data.shape")[0]
    assert f.severity == "warning" and "recompiles" in f.message


def test_column_labels_flagged_without_apply():
    x, y, _, _ = _digits()
    f = _only(check_data((x, y[:, None]), num_classes=10), "data.shape")[0]
    assert "(B, B)" in f.message


def test_predictions_broadcast_against_labels_with_apply():
    x, _, _, _ = _digits()
    target = x.sum(axis=1)  # a (B,) regression target
    w = np.ones((64, 1), np.float32)
    f = _only(check_data((x, target), apply=lambda p, inp: inp @ p, params=w), "data.shape")[0]
    assert "broadcast" in f.message and f.extra["predictions"] == (4, 1)
    # a (B,) output against (B,) targets is fine
    assert list(check_data((x / 10, target / 100), apply=lambda p, inp: (inp @ p)[:, 0], params=w)) == []
    # a model with the wrong number of classes
    y = np.arange(len(x)) % 10
    f = _only(check_data((x, y), num_classes=10, apply=lambda inp: inp[:, :7]), "data.shape")[0]
    assert "7 classes" in f.message


def test_apply_that_raises_is_reported_not_raised():
    x, y, _, _ = _digits()

    def broken(params, inp):
        raise RuntimeError("boom")
    d = check_data((x, y), num_classes=10, apply=broken, params={})
    assert d.codes == ["doctor.skipped"] and "boom" in d[0].message


# ----------------------------------------------------------------------------- leakage and duplicates

def test_leakage_reports_count_and_indices():
    x, y, xe, ye = _digits()
    xe[[7, 30, 200]] = x[[100, 5, 1000]]
    f = _only(check_data((x, y), (xe, ye), num_classes=10), "data.leakage")[0]
    assert f.extra["count"] == 3
    assert f.extra["eval_indices"] == [7, 30, 200] and f.extra["train_indices"] == [100, 5, 1000]
    assert "exact content match" in f.message and f.severity == "error"


def test_leakage_in_streams_and_across_chunks():
    x, y, xe, ye = _digits()
    xe[[11, 300]] = x[[1400, 2]]
    d = check_data(_stream({"x": x, "y": y}, 64), _stream({"x": xe, "y": ye}, 50), num_classes=10)
    f = _only(d, "data.leakage")[0]
    assert f.extra["eval_indices"] == [11, 300] and f.extra["train_indices"] == [1400, 2]
    assert "hash" in f.message
    # in-memory data forced into many small chunks gives the same global indices
    f = _only(check_data((x, y), (xe, ye), num_classes=10, chunk_bytes=4096), "data.leakage")[0]
    assert f.extra["eval_indices"] == [11, 300] and f.extra["train_indices"] == [1400, 2]


def test_duplicates_within_a_split():
    x, y, xe, ye = _digits()
    x[[900, 1200, 1300]] = x[[10, 10, 50]]
    d = check_data((x, y), (xe, ye), num_classes=10, chunk_bytes=10_000)
    f = _only(d, "data.duplicates")[0]
    assert f.extra["count"] == 3 and f.extra["indices"] == [900, 1200, 1300]
    assert f.extra["originals"] == [10, 10, 50] and f.path.startswith("train")
    assert not d.by_code("data.leakage")
    # a threshold above the observed fraction silences it
    assert not check_data((x, y), num_classes=10, max_duplicate_fraction=0.01).by_code("data.duplicates")


def _id_pairs(n, seed, users=50_000, items=50_000):
    """(user, item) id pairs drawn from a Zipf popularity, as a recommender's implicit feedback is."""
    rng = np.random.default_rng(seed)
    u = np.minimum(rng.zipf(1.3, n), users) - 1
    i = np.minimum(rng.zipf(1.3, n), items) - 1
    return {"x": np.stack([u, i], axis=1).astype(np.int32), "y": np.ones(n, np.float32)}


def test_ids_that_repeat_by_popularity_are_neither_leakage_nor_duplicates_but_copied_ids_are_leakage():
    train, ev = _id_pairs(20_000, 0), _id_pairs(256, 1)  # independent draws of one popularity
    d = check_data(train, ev)
    assert not d.by_code("data.leakage") and not d.by_code("data.duplicates"), d
    skipped = [f.message for f in d.by_code("doctor.skipped")]
    assert any("data.leakage not judged" in m and "Good-Turing" in m for m in skipped), skipped
    assert any("data.duplicates not judged" in m for m in skipped), skipped
    # ids spread evenly over a large range: rows seldom repeat, so eval rows copied from train are a leak
    rng = np.random.default_rng(2)
    wide = {"x": rng.integers(0, 10**6, (20_000, 2)).astype(np.int32), "y": np.ones(20_000, np.float32)}
    leaked = {"x": wide["x"][:256].copy(), "y": np.ones(256, np.float32)}
    assert check_data(wide, leaked).by_code("data.leakage")


def test_repeated_batches_in_a_stream_are_duplicates():
    x, y, _, _ = _digits()
    batch = {"x": x[:32], "y": y[:32]}
    f = _only(check_data(iter([batch, {"x": x[32:64], "y": y[32:64]}, batch]), num_classes=10),
              "data.duplicates")[0]
    assert f.extra["count"] == 32 and f.extra["indices"][:2] == [64, 65]


def test_a_stream_that_samples_with_replacement_is_not_duplicated_data():
    """A pipeline drawing each batch's indices with replacement repeats rows by chance (51% of 3456 rows drawn from
    2048): not judged, an info with the pool's size; a stream over data whose rows were copied once (each seen
    exactly twice, read without replacement) is still data.duplicates."""
    from jaxsane._data.with_replacement import sampled_with_replacement

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 8)).astype(np.float32)
    y = rng.integers(0, 4, 2048).astype(np.int32)
    draws = [rng.integers(0, 2048, 64) for _ in range(54)]
    d = check_data(iter([{"x": x[i], "y": y[i]} for i in draws]), num_classes=4)
    assert "data.duplicates" not in d.codes, d
    (f,) = [f for f in d if f.code == "doctor.skipped" and "data.duplicates not judged" in f.message]
    assert 1700 < f.extra["pool"] < 2400, f.extra
    copied = np.concatenate([x, x[:400]])[rng.permutation(2448)]  # 400 rows copied once, shuffled in
    assert sampled_with_replacement(np.unique(copied, axis=0, return_inverse=True)[1].ravel()) is None
    labels = np.zeros(2448, np.int32)
    d = check_data(iter([{"x": copied[s : s + 64], "y": labels[s : s + 64]} for s in range(0, 2448, 64)]), num_classes=4)
    assert "data.duplicates" in d.codes, d


def test_padding_rows_are_not_duplicates():
    data = _sequences()
    data["mask"][[4, 9]] = 0
    d = check_data(data, num_classes=50)
    assert d.codes == ["data.all_padding"], d


# ----------------------------------------------------------------------------- class balance

def test_class_imbalance():
    x, y, _, _ = _digits()
    yb = (y == 0).astype(np.int32)  # ~10% positives: 9:1, under the 10:1 threshold
    assert not check_data((x, yb), num_classes=2).by_code("data.imbalance")
    yb[np.flatnonzero(yb)[20:]] = 0  # 20 positives of 1438: ~71:1
    f = _only(check_data((x, yb), num_classes=2), "data.imbalance")[0]
    assert f.severity == "warning" and f.extra["ratio"] > 60 and "threshold 10:1" in f.message
    assert not check_data((x, yb), num_classes=2, max_imbalance_ratio=100).by_code("data.imbalance")


def test_missing_class():
    x, y, _, _ = _digits()
    keep = y != 3
    f = _only(check_data((x[keep], y[keep]), num_classes=10), "data.imbalance")[0]
    assert "classes [3]" in f.message


# ----------------------------------------------------------------------------- padding

def test_all_padding_examples_and_batches():
    data = _sequences()
    data["mask"][[6, 33]] = 0
    f = _only(check_data(data, num_classes=50), "data.all_padding")[0]
    assert f.extra["count"] == 2 and f.extra["indices"] == [6, 33]
    data = _sequences()
    data["mask"][8:16] = 0  # the whole second batch of 8
    fs = _only(check_data(_stream(data, 8), num_classes=50), "data.all_padding")
    assert any("batches [1]" in f.message for f in fs)
    # per-example weights of 0 pad a batch (allowed); a batch of only zero weights is not
    x, y, _, _ = _digits()
    w = np.ones(len(x), np.float32)
    w[-5:] = 0
    assert list(check_data({"x": x, "y": y, "weights": w}, num_classes=10)) == []
    w[:] = 0
    assert check_data({"x": x, "y": y, "weights": w}, num_classes=10).codes == ["data.all_padding"]


# ----------------------------------------------------------------------------- scale, constant, non-finite

def test_unnormalized_inputs():
    x, y, _, _ = _digits()
    raw = (x * 255).astype(np.uint8)
    f = _only(check_data((raw, y), num_classes=10), "data.unnormalized")[0]
    assert "uint8" in f.message and "/ 255" in f.hint
    assert _only(check_data((x * 255, y), num_classes=10), "data.unnormalized")[0].extra["std"] > 10
    assert _only(check_data((x / 255 / 255, y), num_classes=10), "data.unnormalized")
    standardized = (x - x.mean(0)) / (x.std(0) + 1e-6)
    assert list(check_data((standardized, y), num_classes=10)) == []
    # integer token ids are not features
    assert not check_data(_sequences(), num_classes=50).by_code("data.unnormalized")
    assert check_data(_sequences(), num_classes=50, integer_features=True).by_code("data.unnormalized")


def test_constant_inputs_and_constant_batch():
    x, y, _, _ = _digits()
    f = _only(check_data((np.zeros_like(x), y), num_classes=10), "data.constant")[0]
    assert "same value 0" in f.message
    x2 = x.copy()
    x2[64:128] = 0.5
    d = check_data(_stream({"x": x2, "y": y}, 64), num_classes=10)
    f = _only(d, "data.constant")[0]
    assert "batches [1]" in f.message


def test_nonfinite_inputs_and_labels():
    x, y, _, _ = _digits()
    x[[2, 40], 5] = np.nan
    x[41, 0] = np.inf
    f = _only(check_data((x, y), num_classes=10), "nonfinite.input")[0]
    assert f.extra["count"] == 3 and f.extra["indices"] == [2, 40, 41]
    x, _, _, _ = _digits()
    target = x.sum(1)
    target[9] = np.nan
    f = _only(check_data((x, target)), "nonfinite.input")[0]
    assert f.extra["indices"] == [9] and "labels" in f.path


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("data, match", [
    ({"x": np.zeros((4, 3)), "y": np.zeros(3, int)}, r"ragged batch: .*\['y'\] has 3 rows"),
    ({"x": [[1, 2], [3]], "y": [0, 1]}, r"\['x'\] is ragged"),
    ({"x": np.array(["a", "b"]), "y": np.zeros(2, int)}, r"\['x'\] has dtype <U1 \(string\)"),
    ({"x": np.array([object(), object()]), "y": np.zeros(2, int)}, r"\['x'\] has dtype object"),
    ({"x": {1, 2}, "y": np.zeros(2, int)}, r"\['x'\] is a set"),
    ({"features_": np.zeros((2, 3))}, r"cannot find the inputs .*features_"),
    ([{"x": np.zeros((2, 3)), "y": np.zeros(2, int)}, {"x": np.zeros((2, 3)), "y": ["a", "b"]}],
     r"train batch 1\['y'\] has dtype"),
    (42, "cannot read train data of type int"),
])
def test_bad_input_raises_dataerror(data, match):
    with pytest.raises(DataError, match=match):
        check_data(data)


def test_missing_named_label_key():
    x, y, _, _ = _digits()
    with pytest.raises(DataError, match=r"no labels key 'label'.*\['x', 'y'\]"):
        check_data({"x": x, "y": y}, labels="label")
    batches = [{"x": x[:8], "y": y[:8]}, {"x": x[8:16]}]
    with pytest.raises(DataError, match=r"train batch 1"):
        check_data(batches, num_classes=10)
    with pytest.raises(DataError, match=r"inputs only.*num_classes"):
        check_data(x, num_classes=10)


def test_loader_errors_and_id_like_labels():
    def loader():
        yield {"x": np.zeros((2, 3), np.float32) + 0.5, "y": np.zeros(2, int)}
        raise OSError("disk gone")
    with pytest.raises(DataError, match=r"reading train batch 1 raised OSError: disk gone"):
        check_data(loader())
    # large integer targets without num_classes are ids/counts, not classes: no bincount, no imbalance
    x, _, _, _ = _digits()
    ids = np.arange(len(x)) * 10_000_000
    assert list(check_data((x, ids))) == []


def test_handles_as_callables_and_keys():
    x, y, _, _ = _digits()
    y[0] = 12
    data = {"pixels": x, "target": y}
    assert check_data(data, num_classes=10, inputs="pixels", labels="target").codes == ["data.label_range"]
    assert check_data(data, num_classes=10, inputs=lambda b: b["pixels"],
                      labels=lambda b: b["target"]).codes == ["data.label_range"]
    with pytest.raises(DataError, match="inputs function raised KeyError"):
        check_data(data, inputs=lambda b: b["nope"])


def test_generator_is_read_once():
    x, y, _, _ = _digits()
    calls = []

    def gen():
        calls.append(1)
        yield from _stream({"x": x, "y": y}, 100)
    g = gen()
    d = check_data(g, num_classes=10)
    assert list(d) == [] and calls == [1] and d.artifacts["data"]["train"]["rows"] == len(x)


# ----------------------------------------------------------------------------- hashing

def test_hash_rows_equal_iff_rows_equal():
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, 37, dtype=np.uint8)  # row bytes not a multiple of 8
    rows = np.repeat(base[None], 37 * 8, axis=0)
    for i in range(37):  # every single-byte, single-bit change at every position
        for bit in range(8):
            rows[i * 8 + bit, i] ^= np.uint8(1 << bit)
    h = hash_rows(rows)
    assert len(np.unique(h)) == len(rows)
    assert not np.isin(hash_rows(base[None]), h).any()
    assert hash_rows(np.stack([base, base]))[0] == hash_rows(np.stack([base, base]))[1]
    # swapping two words changes the hash (the mix is position dependent)
    a = np.arange(16, dtype=np.uint8)
    b = np.concatenate([a[8:], a[:8]])
    assert hash_rows(a[None])[0] != hash_rows(b[None])[0]


# ----------------------------------------------------------------------------- doctor stage

def test_doctor_data_stage_clean_and_faulty():
    from jaxsane.examples import load
    exp = load("digits_nnx")
    d = jaxsane.doctor(exp, stages=["data"], progress=False)
    assert d.codes == ["data.epoch"], d  # an endless stream reshuffled each epoch: read for one epoch
    assert d.artifacts["data"]["train"]["rows"] == 1408 and d.artifacts["data"]["train"]["stopped"] == "epoch"
    x, y, xe, ye = _digits()
    xe[:4] = x[:4]
    bad = dataclasses.replace(exp, train={"x": x, "y": y}, eval={"x": xe, "y": ye})
    d = jaxsane.doctor(bad, stages=["data"], progress=False)
    assert d.codes == ["data.leakage"], d
    # the apply handle is used: a model with a (B, 1) output against (B,) float targets
    reg = dataclasses.replace(exp, train={"x": x, "y": x.sum(1)}, eval=None, num_classes=None,
                              apply=lambda model, inp: model(inp)[:, :1],
                              loss=lambda model, b: jnp.mean((model(b["x"])[:, :1] - b["y"]) ** 2))  # (B, B)
    d = jaxsane.doctor(reg, stages=["data"], progress=False)
    assert "data.shape" in d.codes and "broadcast" in d.by_code("data.shape")[0].message


# ----------------------------------------------------------------------------- outliers, sequences, epochs

def test_a_few_rows_at_a_far_larger_scale_are_outliers():
    x, y, _, _ = _digits()
    x = (x - x.mean()) / x.std()
    assert "data.outliers" not in check_data((x, y)).codes
    bad = x.copy()
    bad[[11, 300, 512]] *= 5000.0  # BUG: a unit error in three records
    d = check_data((bad, y))
    [f] = [f for f in d if f.code == "data.outliers"]
    assert f.severity == "warning" and f.extra["indices"] == [11, 300, 512] and f.extra["count"] == 3
    assert "data.unnormalized" not in d.codes  # the outliers explain the scale: no second finding
    # the same rows found in a stream of batches (indices counted across batches), and as integer features
    stream = [(bad[s:s + 100], y[s:s + 100]) for s in range(0, 1000, 100)]
    assert [f.extra["indices"] for f in check_data(stream) if f.code == "data.outliers"] == [[11, 300, 512]]
    pix = np.random.default_rng(0).integers(1, 256, (500, 64)).astype(np.uint8).astype(np.int32)
    pix[7] = 90000
    assert [f.extra["indices"] for f in check_data(pix, integer_features=True)
            if f.code == "data.outliers"] == [[7]]


def test_heavy_tails_and_sparse_rows_are_not_outliers():
    rng = np.random.default_rng(1)
    t = rng.standard_t(3, size=(5000, 16)).astype(np.float32)  # heavy-tailed, but one population
    sparse = np.zeros((400, 32), np.float32)
    sparse[::3, 0] = rng.uniform(0.5, 2.0, len(sparse[::3]))  # many all-zero rows
    assert "data.outliers" not in check_data(t).codes
    assert "data.outliers" not in check_data(sparse).codes
    assert "data.outliers" in check_data(t, outlier_ratio=2.0).codes  # the threshold is the knob


def test_unshifted_next_token_targets():
    seq = _sequences()
    assert "data.unshifted_targets" not in check_data(seq).codes  # labels = tokens shifted left: correct
    same = dict(seq, labels=seq["tokens"].copy())  # BUG: targets are the inputs
    [f] = [f for f in check_data(same) if f.code == "data.unshifted_targets"]
    assert f.severity == "error" and f.extra["count"] == 40 and "tokens[:, 1:]" in f.hint
    back = dict(seq, labels=np.concatenate([np.zeros((40, 1), np.int32), seq["tokens"][:, :-1]], 1))  # BUG
    [f] = [f for f in check_data(back) if f.code == "data.unshifted_targets"]
    assert "wrong way" in f.message
    # an ignore index at padded positions and in the first column is not compared
    ignore = dict(seq, labels=np.where(seq["mask"] > 0, seq["labels"], -100))
    assert "data.unshifted_targets" not in check_data(ignore).codes


def test_unshifted_targets_need_a_majority_of_sequences():
    seq = _sequences()
    labels = seq["labels"].copy()
    labels[:3] = seq["tokens"][:3]  # three rows only (e.g. constant-looking rows): not the pipeline's shift
    assert "data.unshifted_targets" not in check_data(dict(seq, labels=labels)).codes


def test_a_stream_that_cycles_is_one_epoch_not_duplicates():
    x, y, _, _ = _digits()
    x, y = x[:300], y[:300]

    def cycling():  # an endless generator over a finite array, as data loaders are written
        i = 0
        while True:
            idx = (i + np.arange(32)) % len(x)
            yield {"x": x[idx], "y": y[idx]}
            i += 32

    d = check_data(cycling, num_classes=10)
    assert "data.duplicates" not in d.codes and "data.partial" not in d.codes
    [f] = [f for f in d if f.code == "data.epoch"]
    assert f.severity == "info" and f.extra["epoch_rows"] == 300
    assert d.artifacts["data"]["train"]["rows"] == 300
    # duplicates of the first rows that do not continue the stream's start are duplicates
    dup = [{"x": np.concatenate([x[s:s + 30], x[:2]]), "y": np.concatenate([y[s:s + 30], y[:2]])}
           for s in range(0, 300, 30)]
    d = check_data(dup, num_classes=10)
    assert "data.duplicates" in d.codes and "data.epoch" not in d.codes
    # an endless stream cut off by max_batches right after its wrap: an epoch once two rows match
    small = lambda: ({"x": x[(i * 50 + np.arange(50)) % 300], "y": y[(i * 50 + np.arange(50)) % 300]}
                     for i in range(10 ** 6))
    assert [f.extra["epoch_rows"] for f in check_data(small, max_batches=7) if f.code == "data.epoch"] == [300]
    # a finite stream that ends with a short repeat of its start holds duplicates
    ends = [{"x": x[s:s + 50], "y": y[s:s + 50]} for s in range(0, 300, 50)] + [{"x": x[:2], "y": y[:2]}]
    d = check_data(ends)
    assert "data.duplicates" in d.codes and "data.epoch" not in d.codes


def test_outlier_ratio_is_validated():
    with pytest.raises(jaxsane.ArgumentError, match="outlier_ratio"):
        check_data(np.ones((4, 2), np.float32), outlier_ratio=0.5)
