"""Dumps: data never code, every malformed file a DumpError, round trips that keep their structure."""

import json
import os
import signal
import struct
import warnings
import zipfile
import zlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _programs import batch, linen_init

import jaxsane
from jaxsane import DumpError
from jaxsane._core.errors import DumpShapeError
from jaxsane._dump.dump import _RAW


def _tree(d):
    with open(os.path.join(d, "tree.json")) as fh:
        return json.load(fh)


def _write_tree(d, meta):
    with open(os.path.join(d, "tree.json"), "w") as fh:
        json.dump(meta, fh)


class Cmd(NamedTuple):
    command: str


# ----------------------------------------------------------------------------- dumps are data, never code

@pytest.mark.parametrize("fmt", ["jaxsane-dump-v1", "jaxsane-dump-v2"])
@pytest.mark.parametrize("target,payload", [
    ("os:system", "touch {marker}"),
    ("builtins:exec", "open({marker!r}, 'w').close()"),
    ("subprocess:getoutput", "touch {marker}"),
])
def test_a_class_named_in_the_dump_is_never_imported_or_called(tmp_path, fmt, target, payload):
    marker = str(tmp_path / "pwned")
    d = str(tmp_path / "d")
    jaxsane.save_dump(d, (Cmd(payload.format(marker=marker)),))
    meta = _tree(d)
    node = meta["tree"]["c"][0]["c"][0]
    assert node["t"] == "namedtuple"
    meta["format"] = fmt
    if fmt.endswith("v1"):      # v1 named the class as "module:qualname" and the old loader called it
        node["cls"] = target
        del node["name"]
    else:                       # the same attack through a custom-node type name
        node.update(t="node", type=target, keys=[{"a": "command"}])
    _write_tree(d, meta)
    dump = jaxsane.load_dump(d)
    assert not os.path.exists(marker)
    (got,) = dump.args
    assert tuple(got) == (payload.format(marker=marker),)      # the data, as a generic shape
    assert type(got).__module__ == "jaxsane._dump.dump" and type(got).__name__ == target.rpartition(":")[2]


def test_a_sleep_class_does_not_hang_the_loader(tmp_path):
    d = str(tmp_path / "d")
    jaxsane.save_dump(d, (Cmd("x"),), {})
    meta = _tree(d)
    node = meta["tree"]["c"][0]["c"][0]
    meta["format"], node["cls"] = "jaxsane-dump-v1", "time:sleep"
    del node["name"]
    meta["leaves"][0] = {"kind": "python", "type": "int"}
    _write_tree(d, meta)
    np.savez(os.path.join(d, "arrays.npz"), leaf_0=np.asarray(3600))
    signal.alarm(20)
    try:
        dump = jaxsane.load_dump(d)
    finally:
        signal.alarm(0)
    assert tuple(dump.args[0]) == (3600,)


@pytest.mark.parametrize("name", ["__import__('os').system('x')", "os.system", "class", ""])
def test_names_that_are_not_identifiers_are_refused(tmp_path, name):
    d = str(tmp_path / "d")
    jaxsane.save_dump(d, (Cmd("x"),))
    meta = _tree(d)
    meta["tree"]["c"][0]["c"][0]["name"] = name
    _write_tree(d, meta)
    with pytest.raises(DumpError, match=r"^\[jaxsane\] .*tree\.json is malformed at tree\.c\[0\]\.c\[0\]"):
        jaxsane.load_dump(d)


def test_custom_nodes_come_back_as_generic_shapes_that_say_how_to_get_the_class(tmp_path):
    state = linen_init(jax.random.key(0))
    d = str(tmp_path / "d")
    jaxsane.save_dump(d, (state, batch()))
    dump = jaxsane.load_dump(d)
    generic = dump.args[0]
    assert type(generic).__name__ == "TrainState" and generic._fields == ("step", "params", "opt_state")
    assert dump.generic["args[0]"].endswith("train_state:TrainState")
    assert jax.tree.structure(generic.params) == jax.tree.structure(state.params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(generic), jax.tree.leaves(state)))
    assert not hasattr(generic, "apply_fn")                   # still an AttributeError for hasattr
    with pytest.raises(DumpShapeError, match=r"no attribute 'apply_gradients'.*like=.*--step module:experiment"):
        generic.apply_gradients
    # with like= the user's own class comes back
    assert type(jaxsane.load_dump(d, like=(state, batch())).args[0]) is type(state)


# ----------------------------------------------------------------------------- malformed dumps

def _flip(path, offset):
    data = bytearray(open(path, "rb").read())
    data[offset] ^= 0x5A
    open(path, "wb").write(bytes(data))


def _truncate(path, keep):
    data = open(path, "rb").read()
    open(path, "wb").write(data[:keep(len(data))])


def _edit_tree(fn):
    def edit(d):
        meta = _tree(d)
        fn(meta)
        _write_tree(d, meta)
    return edit


def _pickled_member(d):
    np.savez(os.path.join(d, "arrays.npz"), leaf_0=np.array([{"a": 1}], dtype=object),
             leaf_1=np.ones(3, np.float32))


def _missing_member(d):
    with zipfile.ZipFile(os.path.join(d, "arrays.npz"), "w") as zf:
        with zf.open("leaf_0.npy", "w") as fh:
            np.lib.format.write_array(fh, np.arange(4, dtype=np.int32))


def _npy_instead_of_npz(d):
    with open(os.path.join(d, "arrays.npz"), "wb") as fh:
        np.save(fh, np.arange(4, dtype=np.int32))


def _encrypted_flag(d):
    path = os.path.join(d, "arrays.npz")
    data = bytearray(open(path, "rb").read())
    at = data.find(b"PK\x01\x02")
    data[at + 8] |= 1  # general purpose flag bit 0: encrypted
    open(path, "wb").write(bytes(data))


def _remove_leaf_ref(meta):
    meta["tree"]["c"][0]["c"][1]["c"][0] = {"t": "leaf", "i": 7}


MALFORMED = {
    "truncated npz": (lambda d: _truncate(os.path.join(d, "arrays.npz"), lambda n: n // 2), "arrays.npz"),
    "bit-flipped npz data": (lambda d: _flip(os.path.join(d, "arrays.npz"), 140), "arrays.npz"),
    "empty npz": (lambda d: open(os.path.join(d, "arrays.npz"), "wb").close(), "arrays.npz"),
    "empty tree.json": (lambda d: open(os.path.join(d, "tree.json"), "wb").close(), "not valid JSON"),
    "invalid JSON": (lambda d: open(os.path.join(d, "tree.json"), "w").write("{'format': nope"), "not valid JSON"),
    "truncated JSON": (lambda d: _truncate(os.path.join(d, "tree.json"), lambda n: n - 9), "not valid JSON"),
    "binary tree.json": (lambda d: open(os.path.join(d, "tree.json"), "wb").write(b"\xff\xfe\x00"), "not valid JSON"),
    "a JSON list": (lambda d: open(os.path.join(d, "tree.json"), "w").write("[1, 2]"), "JSON list"),
    "wrong format": (_edit_tree(lambda m: m.update(format="other")), "has format 'other'"),
    "pickled member": (_pickled_member, "Python objects"),
    "missing member": (_missing_member, r"lacks the array leaf_1\.npy for args\[1\]\['x'\]"),
    "missing tree.json": (lambda d: os.unlink(os.path.join(d, "tree.json")), "tree.json is missing"),
    "missing arrays.npz": (lambda d: os.unlink(os.path.join(d, "arrays.npz")), "arrays.npz is missing"),
    "leaf refers to a missing array": (_edit_tree(_remove_leaf_ref), "leaf index 7"),
    "wrong dtype string": (_edit_tree(lambda m: m["leaves"][1].update(dtype="object")), "tree.json says 'object'"),
    "raw dtype not ml_dtypes": (_edit_tree(lambda m: m["leaves"][1].update(raw=True, dtype="O")), "raw dtype 'O'"),
    "leaves not a list": (_edit_tree(lambda m: m.update(leaves={"a": 1})), "malformed at leaves"),
    "unknown node kind": (_edit_tree(lambda m: m["tree"]["c"][0].update(t="exec")), "unknown node kind 'exec'"),
    "unknown leaf kind": (_edit_tree(lambda m: m["leaves"][0].update(kind="pickle")), "unknown leaf kind"),
    "unused leaves": (_edit_tree(lambda m: m["leaves"].append({"kind": "array"})), "uses 2 of 3 leaves"),
    "bad key impl": (_edit_tree(lambda m: m["leaves"][0].update(kind="key", impl="os.system")), "PRNG key"),
    "bad big int": (_edit_tree(lambda m: m["leaves"][0].update(kind="bigint", value="1e9")), "decimal string"),
    "a .npy instead of a zip": (_npy_instead_of_npz, "not a zip archive"),
    "an encrypted member": (_encrypted_flag, "cannot be read .*encrypted"),
    "a str leaf without a value": (_edit_tree(lambda m: m["leaves"][0].update(kind="python", type="str")),
                                    "str leaf without a string value"),
    "an int of 5000 digits": (lambda d: open(os.path.join(d, "tree.json"), "w").write('{"a": ' + "9" * 5000 + "}"),
                              "not valid JSON"),
    "custom node with a list key": (_edit_tree(lambda m: m["tree"]["c"][0]["c"][1].update(
        t="node", type="x:Y", keys=[{"d": [1]}])), "custom node needs"),
    "custom node with a bad key kind": (_edit_tree(lambda m: m["tree"]["c"][0]["c"][1].update(
        t="node", type="x:Y", keys=[{"ad": "x"}])), "custom node needs"),
    "dict key of a float": (_edit_tree(lambda m: m["tree"]["c"][0]["c"][1].update(k=[1.5])), "dict keys"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_every_malformed_dump_is_a_dump_error(tmp_path, case):
    damage, message = MALFORMED[case]
    d = str(tmp_path / "d")
    jaxsane.save_dump(d, (np.arange(4, dtype=np.int32), {"x": np.ones(3, np.float32)}))
    jaxsane.load_dump(d)           # intact, it loads
    damage(d)
    with pytest.raises(DumpError, match=message) as info:
        jaxsane.load_dump(d)
    assert str(info.value).startswith("[jaxsane] ") and isinstance(info.value, ValueError)


def test_a_member_swapped_for_another_of_the_same_shape_is_refused(tmp_path):
    """Each leaf records its array's CRC-32: members exchanged between leaves (valid on their own) are refused;
    a dump written before leaves carried one still loads."""
    d = str(tmp_path / "d")
    jaxsane.save_dump(d, (np.zeros(3, np.int32), np.arange(3, dtype=np.int32)))
    path = os.path.join(d, "arrays.npz")
    with zipfile.ZipFile(path) as zf:
        members = {i.filename: zf.read(i) for i in zf.infolist()}
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("leaf_0.npy", members["leaf_1.npy"])
        zf.writestr("leaf_1.npy", members["leaf_0.npy"])
    with pytest.raises(DumpError, match=r"leaf 0 \(args\[0\]\).*CRC-32 differs"):
        jaxsane.load_dump(d)
    meta = _tree(d)
    for leaf in meta["leaves"]:
        del leaf["crc32"]
    _write_tree(d, meta)
    assert jaxsane.load_dump(d).args[0].tolist() == [0, 1, 2]


def test_every_single_byte_flip_is_an_error_or_the_same_tree(tmp_path):
    """Bit flips anywhere in arrays.npz: a DumpError, or (in padding bytes) the identical values."""
    d = str(tmp_path / "d")
    args = (np.arange(6, dtype=np.float32).reshape(2, 3), {"k": np.int64(7)})
    jaxsane.save_dump(d, args)
    path = os.path.join(d, "arrays.npz")
    clean = open(path, "rb").read()
    for offset in range(0, len(clean), 7):
        _flip(path, offset)
        try:
            dump = jaxsane.load_dump(d)
        except DumpError:
            pass
        else:
            got = jax.tree.leaves(dump.args)
            assert all(np.array_equal(a, b) and np.asarray(a).dtype == np.asarray(b).dtype
                       for a, b in zip(got, jax.tree.leaves(args))), offset
        open(path, "wb").write(clean)


def test_a_fifo_does_not_hang_and_symlinks_are_refused(tmp_path):
    d = str(tmp_path / "d")
    jaxsane.save_dump(d, (np.ones(2),))
    real = os.path.join(d, "arrays.npz")
    os.rename(real, str(tmp_path / "elsewhere.npz"))
    os.mkfifo(real)
    signal.alarm(20)  # a blocking open of a FIFO with no writer would hang here
    try:
        with pytest.raises(DumpError, match="not a regular file"):
            jaxsane.load_dump(d)
        os.unlink(real)
        os.symlink(str(tmp_path / "elsewhere.npz"), real)
        with pytest.raises(DumpError, match="is a symlink"):
            jaxsane.load_dump(d)
    finally:
        signal.alarm(0)


def _declare_sizes(path, size):
    """Rewrite the zip central directory so every member claims ``size`` uncompressed bytes."""
    data = bytearray(open(path, "rb").read())
    at = data.find(b"PK\x01\x02")
    while at >= 0:
        data[at + 24:at + 28] = struct.pack("<I", size)
        at = data.find(b"PK\x01\x02", at + 4)
    open(path, "wb").write(bytes(data))


def test_a_zip_bomb_is_refused_before_anything_is_inflated(tmp_path, monkeypatch):
    d = str(tmp_path / "d")
    jaxsane.save_dump(d, (np.zeros(8, np.uint8), np.zeros(8, np.uint8)))
    # a small file whose directory declares 2 x 3 GiB: over the 4 GiB default
    _declare_sizes(os.path.join(d, "arrays.npz"), 3 * 2**30)
    assert os.path.getsize(os.path.join(d, "arrays.npz")) < 2000
    opened = []
    monkeypatch.setattr(zipfile.ZipFile, "open", lambda *a, **k: opened.append(a) or 1 / 0)
    with pytest.raises(DumpError, match=r"declares 6442450944 bytes .* max_bytes=4294967296"):
        jaxsane.load_dump(d)
    assert opened == []
    monkeypatch.undo()
    # a real deflate bomb: 40 MB of zeros in ~40 kB, refused under a smaller max_bytes
    np.savez_compressed(os.path.join(d, "arrays.npz"), leaf_0=np.zeros(40_000_000, np.uint8),
                        leaf_1=np.zeros(8, np.uint8))
    meta = _tree(d)
    meta["leaves"][0]["shape"] = [40_000_000]
    meta["leaves"][0]["crc32"] = zlib.crc32(bytes(40_000_000))
    _write_tree(d, meta)
    assert os.path.getsize(os.path.join(d, "arrays.npz")) < 200_000
    monkeypatch.setattr(zipfile.ZipFile, "open", lambda *a, **k: opened.append(a) or 1 / 0)
    with pytest.raises(DumpError, match="over max_bytes=1000000"):
        jaxsane.load_dump(d, max_bytes=1_000_000)
    assert opened == []
    monkeypatch.undo()
    assert jaxsane.load_dump(d).args[0].shape == (40_000_000,)   # under the default it is a normal dump


def test_an_npy_header_that_lies_about_its_shape_is_refused(tmp_path):
    d = str(tmp_path / "d")
    jaxsane.save_dump(d, (np.zeros(4, np.float32),))
    with zipfile.ZipFile(os.path.join(d, "arrays.npz"), "w") as zf:
        with zf.open("leaf_0.npy", "w") as fh:
            header = {"descr": "<f4", "fortran_order": False, "shape": (10**12,)}
            np.lib.format.write_array_header_1_0(fh, header)
            fh.write(b"\0" * 16)
    with pytest.raises(DumpError, match=r"declares shape \(1000000000000,\)"):
        jaxsane.load_dump(d)


def test_depth_and_node_limits(tmp_path):
    d = str(tmp_path / "d")
    jaxsane.save_dump(d, ([[[np.ones(1)]]], {}))
    assert jaxsane.load_dump(d).args[0][0][0][0].shape == (1,)
    meta = _tree(d)
    with pytest.raises(DumpError, match="max_depth=2"):
        jaxsane.load_dump(d, max_depth=2)
    with pytest.raises(DumpError, match="max_nodes=4"):
        jaxsane.load_dump(d, max_nodes=4)
    # hand-written trees nested 150 deep (over max_depth) and 20000 deep (over the JSON parser's recursion)
    for depth, match in [(150, "nested deeper than max_depth=100"), (20_000, "not valid JSON")]:
        text = json.dumps(meta).replace('"tree": {', '"tree": ' + '{"t": "list", "c": [' * depth + "{", 1)
        text = text.replace(', "leaves"', "]}" * depth + ', "leaves"', 1)
        open(os.path.join(d, "tree.json"), "w").write(text)
        with pytest.raises(DumpError, match=match):
            jaxsane.load_dump(d)
    deep: list = [np.ones(1)]
    for _ in range(150):
        deep = [deep]
    with pytest.raises(DumpError, match="nested deeper than 100"):
        jaxsane.save_dump(str(tmp_path / "deep"), (deep,))


# ----------------------------------------------------------------------------- round trips

def test_round_trips_keep_structure_and_bits(tmp_path):
    def make():
        class Local(NamedTuple):  # defined inside a function: no importable name
            a: object
            b: object
        return Local

    Local = make()
    raw = {name: np.array([0, 1, 3], np.uint8).view(dt)[:2] if dt.itemsize == 1 else np.ones(2, dt)
           for name, dt in _RAW.items()}
    args = (
        {"big": 2**70, "neg": -(2**80), "edge": 2**63 - 1, "u64": np.uint64(2**64 - 1)},
        {3: np.arange(2), 1: "one", 2: None},
        Local(np.float32(1.5), [True, 1.5, 3, 1 + 2j, "text"]),
        raw,
        {"key": jax.random.key(7), "rbg": jax.random.key(1, impl="rbg"), "raw_key": jax.random.PRNGKey(2)},
        (np.ones((2, 3), np.float32).T, np.array("ab"), np.zeros((0, 4), np.float16)),
    )
    d = str(tmp_path / "d")
    jaxsane.save_dump(d, args, {"lr": 0.1})
    dump = jaxsane.load_dump(d)
    got = dump.args
    assert got[0]["big"] == 2**70 and type(got[0]["big"]) is int and got[0]["neg"] == -(2**80)
    assert got[0]["edge"] == 2**63 - 1 and got[0]["u64"] == np.uint64(2**64 - 1)
    assert list(got[1]) == [1, 2, 3] and got[1][1] == "one" and got[1][2] is None
    assert type(got[2]).__name__ == "Local" and got[2]._fields == ("a", "b")
    assert type(got[2].a) is np.float32 and got[2].b == [True, 1.5, 3, 1 + 2j, "text"]
    assert [type(v) for v in got[2].b] == [bool, float, int, complex, str]
    for name, a in raw.items():
        assert got[3][name].dtype == a.dtype and got[3][name].tobytes() == a.tobytes(), name
    for k in ("key", "rbg"):
        assert jax.random.key_impl(got[4][k]) == jax.random.key_impl(args[4][k])
        assert np.array_equal(jax.random.key_data(got[4][k]), jax.random.key_data(args[4][k]))
    assert np.array_equal(got[5][0], args[5][0]) and got[5][1] == "ab" and got[5][2].shape == (0, 4)
    assert dump.kwargs == {"lr": 0.1} and dump.generic == {}
    # with like= the local NamedTuple comes back as the user's own type
    liked = jaxsane.load_dump(d, like=args)
    assert type(liked.args[2]) is Local and jax.tree.structure(liked.args) == jax.tree.structure(args)


@pytest.mark.parametrize("value,match", [
    (np.array([object(), 1], dtype=object), r"args\[0\]\['bad'\].*dtype object"),
    (object(), r"args\[0\]\['bad'\]: it is a object object"),
    (np.zeros(2, [("a", "<i4")]), r"args\[0\]\['bad'\].*dtype"),
])
def test_leaves_without_an_exact_form_are_refused_at_save_time(tmp_path, value, match):
    with pytest.raises(DumpError, match=match):
        jaxsane.save_dump(str(tmp_path / "d"), ({"bad": value, "ok": np.ones(2)},))
    assert not os.path.exists(tmp_path / "d" / "tree.json")


@pytest.mark.parametrize("tree,match", [
    ({1.5: np.ones(1)}, r"a float key 1\.5"),
    ({(1, 2): np.ones(1)}, r"a tuple key \(1, 2\)"),
    ({"a": np.ones(1), 1: np.ones(1)}, "both str and int keys"),
])
def test_dict_keys_other_than_str_or_int_are_refused(tmp_path, tree, match):
    with pytest.raises(DumpError, match=r"cannot dump args\[0\]\['s'\]: the dict has " + match):
        jaxsane.save_dump(str(tmp_path / "d"), ({"s": tree},))


def test_like_with_another_structure_is_refused_naming_the_path(tmp_path):
    d = str(tmp_path / "d")
    args = ({"w": np.ones(2), "b": np.zeros(2)}, (np.ones(1), np.ones(1)))
    jaxsane.save_dump(d, args)
    assert jax.tree.structure(jaxsane.load_dump(d, like=args).args) == jax.tree.structure(args)
    cases = [
        (({"w": 0, "c": 0}, (0, 0)), r"args\[0\]: like= has dict, the dump has dict \(keys \['c', 'w'\]"),
        (({"w": 0, "b": 0}, [0, 0]), r"args\[1\]: like= has list, the dump has tuple"),
        (({"w": 0, "b": 0}, Cmd((0, 0))), r"args\[1\]: like= has namedtuple Cmd"),
        (({"w": 0, "b": 0}, (0, (0,))), r"args\[1\]\[1\]: like= has tuple, the dump has a leaf"),
        (({"w": 0, "b": 0}, (0, 0), 0), r"args: like= has tuple, the dump has tuple \(3 vs 2 children\)"),
    ]
    for like, match in cases:
        with pytest.raises(DumpError, match=match):
            jaxsane.load_dump(d, like=like)
    # fewer templates than args: the ones left out at the end come from the dump's own data
    short = jaxsane.load_dump(d, like=({"w": 0, "b": 0},))
    assert jax.tree.structure(short.args) == jax.tree.structure(args)


def test_save_into_an_impossible_directory_is_a_dump_error(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DumpError, match="cannot write the dump to .*afile/d"):
        jaxsane.save_dump(str(tmp_path / "afile" / "d"), (np.ones(1),))


# ----------------------------------------------------------------------------- the failure path

def _log_step(state, b):
    loss = jnp.mean(jnp.log(b["x"] * state["w"]))
    return {"w": state["w"] - loss}, {"loss": loss}


def test_guard_raises_the_finding_with_a_warning_when_the_dump_cannot_be_written(tmp_path):
    (tmp_path / "afile").write_text("x")
    dump_dir = str(tmp_path / "afile" / "dumps")
    guarded = jaxsane.guard(jax.jit(_log_step), sync=True, dump_dir=dump_dir)
    with pytest.raises(jaxsane.NonFiniteError) as info:
        guarded({"w": jnp.ones(3)}, {"x": jnp.array([1.0, 0.0, 2.0])})
    err = info.value
    assert err.finding.code == "nonfinite.forward" and err.located is not None and err.located.origins
    assert err.dump_path is None and "cannot write the dump" in err.dump_error
    assert "warning: the inputs could not be dumped" in str(err) and err.finding.extra["dump_error"]
    assert guarded.failures == [err.finding] and err.inputs is not None
    # a writable dump_dir still dumps, with no warning
    ok = jaxsane.guard(jax.jit(_log_step), sync=True, dump_dir=str(tmp_path / "dumps"), locate=False)
    with pytest.raises(jaxsane.NonFiniteError) as info:
        ok({"w": jnp.ones(3)}, {"x": jnp.array([1.0, 0.0, 2.0])})
    assert info.value.dump_error is None and jaxsane.load_dump(info.value.dump_path).step == 0


@pytest.mark.slow
def test_fit_keeps_rolling_back_when_the_dump_dir_is_unusable(tmp_path, monkeypatch):
    import errno

    import test_fit as T

    from jaxsane._dump import save as _dump  # the writer (save_dump) lives in _dump_save
    (tmp_path / "afile").write_text("x")
    with pytest.raises(jaxsane.FitArgumentError, match="dump_dir"):  # unusable from the start: refused up front
        jaxsane.fit(T.experiment(n=12), steps=12, dump_dir=str(tmp_path / "afile" / "dumps"), **T.FIT)

    def disk_full(fh):  # the dump directory was fine at the start; the disk fills up during the run
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_dump, "_write_atomic", lambda path, write: disk_full(None))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = jaxsane.fit(T.experiment(n=12, poison_at=(5,)), steps=12, checkpoint_every=4, eval_every=0,
                             dump_dir=str(tmp_path / "dumps"), **T.FIT)
    assert result.rollbacks == 1 and result.step == 12
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(result.state))
    (failure,) = result.diagnosis.by_code("nonfinite")
    assert failure.step == 5 and "cannot write the dump" in failure.extra["dump_error"]
    assert "No space left" in failure.extra["dump_error"]
    assert any("rolled back" in str(w.message) for w in caught)


def test_replay_of_a_damaged_dump_exits_2_with_the_message(tmp_path, capsys):
    from jaxsane import cli
    step_file = tmp_path / "user_step.py"
    step_file.write_text("import jax.numpy as jnp\n"
                         "def step(state, batch):\n    return state, {'loss': jnp.sum(batch)}\n")
    d = str(tmp_path / "d")
    jaxsane.save_dump(d, ({"w": np.ones(2)}, np.ones(2)))
    open(os.path.join(d, "tree.json"), "w").write("[")
    assert cli.main(["replay", d, "--step", f"{step_file}:step"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("[jaxsane] ") and "not valid JSON" in err and "Traceback" not in err


def test_replay_of_custom_nodes_without_the_experiment_says_to_pass_it(tmp_path, capsys):
    from jaxsane import cli
    d = str(tmp_path / "d")
    jaxsane.save_dump(d, (linen_init(jax.random.key(0)), batch()))
    programs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_programs.py")
    assert cli.main(["replay", d, "--step", f"{programs}:linen_step"]) == 2
    err = capsys.readouterr().err
    assert "generic shape" in err and "--step module:experiment" in err and "Traceback" not in err


def test_nnx_state_dumps_round_trip_through_like(tmp_path):
    from _programs import nnx_init
    from flax import nnx
    model, optimizer = nnx_init(jax.random.key(0))
    states = (nnx.state(model), nnx.state(optimizer), batch())
    d = str(tmp_path / "d")
    jaxsane.save_dump(d, states)
    plain = jaxsane.load_dump(d)
    assert isinstance(plain.args[0], dict) and plain.generic["args[0]"].endswith("statelib:State")
    liked = jaxsane.load_dump(d, like=states)
    assert jax.tree.structure(liked.args) == jax.tree.structure(states)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(liked.args), jax.tree.leaves(states)))
    with pytest.raises(DumpError, match=r"args\[1\]: like= has State node, the dump has State node "
                                        r"\(children \['l1', 'l2'\] vs \['opt_state', 'step'\]\)"):
        jaxsane.load_dump(d, like=(states[0], states[0], states[2]))


def test_a_full_disk_leaves_no_partial_dump_and_guard_still_raises_the_finding(tmp_path, monkeypatch):
    import errno

    import jaxsane._dump.dump as dump_module

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dump_module.os, "fsync", full)
    with pytest.raises(DumpError, match="cannot write the dump to .*No space left on device"):
        jaxsane.save_dump(str(tmp_path / "d"), (np.ones(3),))
    assert os.listdir(tmp_path / "d") == []              # no half-written arrays.npz or tree.json
    guarded = jaxsane.guard(_log_step, sync=True, locate=False, dump_dir=str(tmp_path / "dumps"))
    with pytest.raises(jaxsane.NonFiniteError, match="nonfinite.forward at step 0") as info:
        guarded({"w": jnp.ones(3)}, {"x": jnp.array([1.0, 0.0, 2.0])})
    assert info.value.dump_path is None and "No space left" in info.value.dump_error


# ----------------------------------------------------------------------------- NNX objects in guard dumps

def _origin(report):
    o = report.origins[0]
    return o.code, o.primitive, os.path.basename(o.file), o.line


@pytest.mark.slow
def test_a_guarded_nnx_dump_replays_through_like_objects_to_the_live_origin(tmp_path):
    from _programs import nnx_log_dump
    from flax import nnx
    module, err = nnx_log_dump(tmp_path)
    live = _origin(err.located)
    assert live[:2] == ("nonfinite.forward", "log")
    model, optimizer = module.make_objects()
    before = [np.array(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    dump = jaxsane.load_dump(err.dump_path, like=(model, optimizer, module.batch()))
    assert isinstance(dump.args[0], module.LogMLP) and isinstance(dump.args[1], nnx.Optimizer)
    assert dump.args[0] is not model and dump.args[1] is not optimizer
    assert all(np.array_equal(a, b) for a, b in zip(before, jax.tree.leaves(nnx.state(model, nnx.Param))))
    assert _origin(jaxsane.locate(module.train_step, *dump.args)) == live
    # the batch left out of like= comes from the dump's data
    short = jaxsane.load_dump(err.dump_path, like=(model, optimizer))
    assert isinstance(short.args[0], module.LogMLP) and isinstance(short.args[2], dict)
    assert _origin(jaxsane.locate(module.train_step, *short.args)) == live
    dumped = jax.tree.leaves(nnx.state(dump.args[0]))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(err.inputs[0][0]), dumped))


def test_an_nnx_dump_without_templates_says_how_to_rebuild_the_objects(tmp_path):
    from _programs import nnx_log_dump
    module, err = nnx_log_dump(tmp_path)
    dump = jaxsane.load_dump(err.dump_path)
    assert dump.objects == {0: "user_nnx_step.LogMLP", 1: "flax.nnx.Optimizer"}
    assert dump.generic["args[0]"].startswith("user_nnx_step.LogMLP (an NNX object")
    assert np.shape(jax.tree.leaves(dump.args[0]["l1"]["kernel"])[0]) == (3, 4)   # the state is still there to read
    expected = (f"[jaxsane] the dump at {err.dump_path} holds NNX objects (args[0]: user_nnx_step.LogMLP, "
                "args[1]: flax.nnx.Optimizer); their classes cannot be rebuilt from data (a dump never imports a "
                "class). Pass like=(model, optimizer, batch) built as in your training script to "
                "jaxsane.load_dump, or replay with --step module:experiment, or --like module:make_objects")
    with pytest.raises(DumpError) as info:
        jaxsane.locate(module.train_step, *dump.args)
    assert str(info.value).startswith(expected)
    with pytest.raises(DumpShapeError, match="holds NNX objects"):
        dump.args[0].train()
    with pytest.raises(DumpShapeError, match="called as the object"):
        dump.args[0](np.ones((2, 3)))
    assert jax.tree.structure(jax.tree.map(lambda x: x, dump.args[0])) == jax.tree.structure(dump.args[0])


def test_save_dump_of_live_nnx_objects_records_them_and_leaves_them_untouched(tmp_path):
    from _programs import nnx_init
    from flax import nnx
    model, optimizer = nnx_init(jax.random.key(0))
    d = str(tmp_path / "d")
    jaxsane.save_dump(d, (model, optimizer, batch()))
    assert isinstance(model, nnx.Module) and _tree(d)["nnx"] == [
        {"arg": 0, "class": "_programs.NNXMLP"}, {"arg": 1, "class": "flax.nnx.Optimizer"}]
    back = jaxsane.load_dump(d, like=nnx_init(jax.random.key(1)))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(nnx.state(back.args[0])),
                                                    jax.tree.leaves(nnx.state(model))))


@pytest.mark.parametrize("record", [
    [{"arg": 0, "class": "os:system"}], [{"arg": 5, "class": "x"}], [{"arg": 0}], {"arg": 0}, [{"arg": 1, "class": "x"}],
])
def test_nnx_records_are_data_never_imported(tmp_path, record):
    from _programs import nnx_init
    from flax import nnx
    marker = tmp_path / "imported"
    evil = tmp_path / "evil_nnx_mod.py"
    evil.write_text(f"open({str(marker)!r}, 'w').close()\nclass Evil: pass\n")
    model, optimizer = nnx_init(jax.random.key(0))
    d = str(tmp_path / "d")
    jaxsane.save_dump(d, (nnx.state(model), np.ones(2)))
    meta = _tree(d)
    meta["nnx"] = [{"arg": 0, "class": "evil_nnx_mod.Evil"}]
    _write_tree(d, meta)
    import sys
    sys.path.insert(0, str(tmp_path))
    try:
        dump = jaxsane.load_dump(d)
        assert dump.objects == {0: "evil_nnx_mod.Evil"} and not marker.exists()
        meta["nnx"] = record
        _write_tree(d, meta)
        if record == [{"arg": 0, "class": "os:system"}]:
            assert jaxsane.load_dump(d).objects == {0: "os:system"}
        else:  # a position out of range, no class, not a list, a record for an arg that is not a State
            with pytest.raises(DumpError, match="malformed at nnx"):
                jaxsane.load_dump(d)
        assert not marker.exists() and "evil_nnx_mod" not in sys.modules
    finally:
        sys.path.remove(str(tmp_path))
