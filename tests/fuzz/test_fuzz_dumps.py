"""Fuzzed dumps: random mutations of valid dumps (bytes flipped, truncated or inserted; zip members renamed,
duplicated, dropped, added or recompressed; tree.json fields removed, retyped, nested or duplicated). Each
one loads bitwise or raises DumpError: never another exception, never a hang, never a file written."""

import functools
import io
import json
import os
import shutil
import tempfile
import warnings
import zipfile
from typing import NamedTuple

import jax
import ml_dtypes
import numpy as np
import pytest
from _fuzz import Hang, fuzz_settings, time_limit, tree_listing
from hypothesis import given
from hypothesis import strategies as st

import jaxsane
from jaxsane import DumpError

pytestmark = pytest.mark.slow


class Pair(NamedTuple):
    left: object
    right: object


def _payloads():
    """Dumps of every kind of leaf and container a dump holds."""
    return {
        "arrays": ((np.arange(6, dtype=np.float32).reshape(2, 3), {"k": np.int64(7)}), {}),
        "exotic": (
            (
                {
                    "bf16": np.arange(4, dtype=ml_dtypes.bfloat16),
                    "int4": np.array([1, -2, 3], dtype=ml_dtypes.int4),
                    "key": jax.random.key(3),
                    "raw_key": jax.random.PRNGKey(1),
                },
                [1, 2.5, True, 3 + 1j, "text", 2**70, None],
            ),
            {"lr": np.float16(0.5)},
        ),
        "containers": ((Pair(np.zeros((2, 2), np.uint8), (np.ones(3, np.bool_), [])), {1: np.arange(3)}), {}),
    }


@functools.cache
def _templates():
    """``{name: (tree.json bytes, arrays.npz bytes, the payload's leaves)}`` of each valid dump."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (args, kwargs) in _payloads().items():
            d = os.path.join(tmp, name)
            jaxsane.save_dump(d, args, kwargs)
            with open(os.path.join(d, "tree.json"), "rb") as fh:
                tree = fh.read()
            with open(os.path.join(d, "arrays.npz"), "rb") as fh:
                arrays = fh.read()
            dump = jaxsane.load_dump(d)
            out[name] = (tree, arrays, _fingerprint(dump))
            if name == "exotic":  # a dump written before leaves carried a CRC-32: the members are not tied to leaves
                meta = json.loads(tree)
                for leaf in meta["leaves"]:
                    leaf.pop("crc32", None)
                out["legacy"] = (json.dumps(meta).encode(), arrays, out[name][2])
    return out


def _leaf_bits(x):
    if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
        return ("key", str(jax.random.key_impl(x)), np.asarray(jax.random.key_data(x)).tobytes())
    if isinstance(x, (str, int, float, complex, bool)) and not isinstance(x, np.generic):
        return (type(x).__name__, repr(x))
    a = np.asarray(x)
    return (str(a.dtype), a.shape, a.tobytes(), type(x).__name__)


def _fingerprint(dump):
    return [_leaf_bits(x) for x in jax.tree_util.tree_leaves((dump.args, dump.kwargs))]


# ----------------------------------------------------------------------------- mutations

def _bytes_mutation(data, blob: bytes) -> bytes:
    if not blob:
        return data.draw(st.binary(max_size=64))
    op = data.draw(st.sampled_from(["flip", "truncate", "insert", "delete", "overwrite"]))
    at = data.draw(st.integers(0, len(blob) - 1))
    if op == "flip":
        bit = data.draw(st.integers(0, 7))
        return blob[:at] + bytes([blob[at] ^ (1 << bit)]) + blob[at + 1:]
    if op == "truncate":
        return blob[:at]
    if op == "insert":
        return blob[:at] + data.draw(st.binary(min_size=1, max_size=16)) + blob[at:]
    if op == "delete":
        return blob[:at] + blob[at + data.draw(st.integers(1, 16)):]
    chunk = data.draw(st.binary(min_size=1, max_size=16))
    return blob[:at] + chunk + blob[at + len(chunk):]


def _zip_mutation(data, blob: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        members = [(i.filename, zf.read(i)) for i in zf.infolist()]
    op = data.draw(st.sampled_from(["rename", "duplicate", "copy_as", "drop", "add", "deflate", "reorder", "swap"]))
    j = data.draw(st.integers(0, max(0, len(members) - 1)))
    name_strategy = st.one_of(
        st.sampled_from([f"leaf_{k}.npy" for k in range(12)] + ["leaf_0", "../escape.npy", "/abs.npy", "a/b.npy"]),
        st.text(min_size=1, max_size=20).filter(lambda s: "\x00" not in s),
    )
    compression = zipfile.ZIP_STORED
    if members:
        if op == "rename":
            members[j] = (data.draw(name_strategy), members[j][1])
        elif op == "duplicate":
            members.insert(data.draw(st.integers(0, len(members))), members[j])
        elif op == "copy_as":
            members.append((data.draw(name_strategy), members[j][1]))
        elif op == "drop":
            members.pop(j)
        elif op == "deflate":
            compression = zipfile.ZIP_DEFLATED
        elif op == "reorder":
            members.reverse()
        elif op == "swap" and len(members) > 1:
            k = data.draw(st.integers(0, len(members) - 1))
            members[j], members[k] = (members[j][0], members[k][1]), (members[k][0], members[j][1])
    if op == "add" or not members:
        members.append((data.draw(name_strategy), data.draw(st.binary(max_size=200))))
    out = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate names we write on purpose
        with zipfile.ZipFile(out, "w", compression) as zf:
            for name, payload in members:
                zf.writestr(name, payload)
    return out.getvalue()


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _json_mutation(data, blob: bytes) -> bytes:
    doc = json.loads(blob)
    paths = [p for p in _paths(doc) if p]
    path = data.draw(st.sampled_from(paths))
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    last = path[-1]
    op = data.draw(st.sampled_from(["remove", "retype", "nest", "duplicate", "same_kind"]))
    value = parent[last]
    if op == "remove":
        del parent[last]
    elif op == "retype":
        parent[last] = data.draw(JSON_VALUES)
    elif op == "nest":
        parent[last] = data.draw(st.sampled_from([[value], {"t": value}, {"t": "list", "c": [value]}, {"c": value}]))
    elif op == "duplicate" and isinstance(parent, list):
        parent.insert(data.draw(st.integers(0, len(parent))), json.loads(json.dumps(value)))
    elif op == "duplicate":
        parent[data.draw(st.text(max_size=4))] = json.loads(json.dumps(value))
    elif isinstance(value, bool):
        parent[last] = not value
    elif isinstance(value, int):
        parent[last] = value + data.draw(st.sampled_from([-1, 1, 2**31, -(2**63), 2**64]))
    elif isinstance(value, str):
        parent[last] = data.draw(st.sampled_from(["", "leaf", "node", "dict", "tuple", "float64", "uint8",
                                                  "bfloat16", "os:system", value + "x", value[:-1]]))
    elif isinstance(value, list):
        parent[last] = value[::-1]
    text = json.dumps(doc)
    if data.draw(st.booleans()) and data.draw(st.booleans()):  # sometimes as raw text, duplicate keys and all
        text = text.replace('{"t": ', '{"t": "none", "t": ', 1)
    return text.encode()


# ----------------------------------------------------------------------------- the property

def _load_in_sandbox(tree: bytes, arrays: bytes):
    """Load the dump from a fresh temporary directory (the cwd too); return (result or error, new files)."""
    root = tempfile.mkdtemp(prefix="jaxsane-fuzz-")
    cwd = os.getcwd()
    try:
        d = os.path.join(root, "dump")
        os.mkdir(d)
        with open(os.path.join(d, "tree.json"), "wb") as fh:
            fh.write(tree)
        with open(os.path.join(d, "arrays.npz"), "wb") as fh:
            fh.write(arrays)
        before = tree_listing(root)
        os.chdir(root)
        try:
            with time_limit(20):
                try:
                    outcome = jaxsane.load_dump(d)
                except DumpError as e:
                    outcome = e
        finally:
            os.chdir(cwd)
        return outcome, set(tree_listing(root)) ^ set(before), tree_listing(root) != before
    finally:
        shutil.rmtree(root, ignore_errors=True)


@given(data=st.data())
@fuzz_settings(800)
def test_a_mutated_dump_loads_bitwise_or_raises_dump_error(data):
    templates = _templates()
    name = data.draw(st.sampled_from(sorted(templates)), label="dump")
    tree, arrays, clean = templates[name]
    touched_tree = False
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        target = data.draw(st.sampled_from(["npz bytes", "npz members", "json fields", "json bytes"]), label="what")
        if target == "npz bytes":
            arrays = _bytes_mutation(data, arrays)
        elif target == "npz members":
            try:
                arrays = _zip_mutation(data, arrays)
            except (zipfile.BadZipFile, ValueError, EOFError, OSError):  # an earlier mutation broke the archive
                arrays = _bytes_mutation(data, arrays)
        elif target == "json fields":
            try:
                tree = _json_mutation(data, tree)
            except (ValueError, IndexError, KeyError, TypeError):  # an earlier mutation broke the JSON
                tree = _bytes_mutation(data, tree)
            touched_tree = True
        else:
            tree = _bytes_mutation(data, tree)
            touched_tree = True
    try:
        outcome, changed_names, changed = _load_in_sandbox(tree, arrays)
    except Hang as e:
        pytest.fail(f"load_dump hung on a mutated {name} dump: {e}")
    assert not changed, f"load_dump wrote or changed files: {sorted(changed_names)}"
    if isinstance(outcome, DumpError):
        assert str(outcome).startswith("[jaxsane] ")
        return
    got = _fingerprint(outcome)
    if not touched_tree and name != "legacy":  # the description is intact: the same values, bit for bit
        assert got == clean, f"a damaged arrays.npz of the {name} dump loaded other values"
    else:  # tree.json changed (or has no CRCs): whatever loads is made of the stored arrays and JSON scalars
        stored = {bits[:3] for bits in clean}  # (dtype, shape, bytes): a 0-d array may come back as a numpy scalar
        for leaf in got:
            assert leaf[:3] in stored or leaf[0] in ("str", "int", "float", "complex", "bool"), leaf
