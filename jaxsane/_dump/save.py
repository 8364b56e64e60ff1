"""Writing a dump: a failing step's inputs as ``arrays.npz`` (no pickle) + ``tree.json``, atomically.

The reader and the format's rules are in ``_dump/dump.py``; the constants in ``_dump/format.py``.
Nothing here is jit-safe.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zipfile
import zlib
from typing import Any

import jax
import numpy as np

from .._core.errors import DumpError
from .._core.tree import is_key as _is_key
from .format import FORMAT, INT64_RANGE as _INT64, MAX_DEPTH, NATIVE_KINDS as _NATIVE_KINDS, RAW_DTYPES as _RAW
from .nnx import split_for_dump

# ----------------------------------------------------------------------------- save


def _key_desc(k: Any) -> dict:
    """A child's key entry -> JSON (field name, dict key or position)."""
    if isinstance(k, jax.tree_util.GetAttrKey):
        return {"a": k.name}
    if isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, (str, int)) and not isinstance(k.key, bool):
        return {"d": k.key}
    if isinstance(k, (jax.tree_util.SequenceKey, jax.tree_util.FlattenedIndexKey)):
        return {"i": k.idx if isinstance(k, jax.tree_util.SequenceKey) else k.key}
    return {"r": repr(k)}


def _children(x: Any) -> list | None:
    """jax's one-level flatten of ``x`` as ``[(key entry, child)]``, or None when ``x`` is a leaf."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
    if jax.tree_util.treedef_is_leaf(treedef) and flat and flat[0][0] == ():
        return None
    return [(p[0], c) for p, c in flat]


class Encoder:
    """Describes a pytree as JSON nodes; with ``leaves=None`` it records the structure only."""

    def __init__(self, leaves: list | None, max_depth: int = MAX_DEPTH, root_names: tuple | None = None):
        self.leaves, self.count, self.max_depth = leaves, 0, max_depth
        self.paths: list[str] = []
        self.root_names = root_names

    def node(self, x: Any, path: str, depth: int = 0) -> dict:
        if depth > self.max_depth:
            raise DumpError(f"cannot dump {path}: the tree is nested deeper than {self.max_depth} levels.")
        if x is None:
            return {"t": "none"}
        if isinstance(x, dict):
            bad = [k for k in x if not isinstance(k, (str, int)) or isinstance(k, bool)]
            if bad or len({type(k) for k in x}) > 1:
                what = f"a {type(bad[0]).__name__} key {bad[0]!r}" if bad else "both str and int keys"
                raise DumpError(
                    f"cannot dump {path}: the dict has {what}. Dumps keep dict keys that are all "
                    "str or all int; convert the keys (e.g. str(k)) before the step."
                )
        kids = _children(x)
        if kids is None:
            return self.leaf(x, path)
        # a dump's root is (args, kwargs): its children are named so, deeper ones by jax's key path
        sub = [
            self.node(
                c,
                self.root_names[j] if depth == 0 and self.root_names else path + jax.tree_util.keystr((k,)),
                depth + 1,
            )
            for j, (k, c) in enumerate(kids)
        ]
        cls: Any = type(x)
        if isinstance(x, tuple) and hasattr(cls, "_fields"):
            return {"t": "namedtuple", "name": cls.__name__, "fields": list(cls._fields), "c": sub}
        if type(x) in (tuple, list):
            return {"t": type(x).__name__, "c": sub}
        if type(x) is dict:
            return {"t": "dict", "k": [k.key for k, _ in kids], "c": sub}
        return {
            "t": "node",
            "type": f"{cls.__module__}:{cls.__qualname__}",
            "keys": [_key_desc(k) for k, _ in kids],
            "dataclass": dataclasses.is_dataclass(x),
            "c": sub,
        }

    def leaf(self, x: Any, path: str) -> dict:
        self.paths.append(path)
        if self.leaves is not None:
            self.leaves.append(x)
        self.count += 1
        return {"t": "leaf", "i": self.count - 1}


def _encode_leaf(x: Any, path: str) -> tuple[np.ndarray | None, dict]:
    """Leaf -> (storable numpy array or None, JSON meta). Refuses what cannot come back exactly."""
    if _is_key(x):
        data = np.asarray(jax.random.key_data(x))
        return data, {"kind": "key", "impl": str(jax.random.key_impl(x)), "dtype": str(data.dtype)}
    if isinstance(x, str):
        return None, {"kind": "python", "type": "str", "value": x}
    if isinstance(x, (bool, int, float, complex)) and not isinstance(x, np.generic):
        if isinstance(x, int) and not isinstance(x, bool) and not _INT64[0] <= x <= _INT64[1]:
            return None, {"kind": "bigint", "value": str(x)}
        return np.asarray(x), {"kind": "python", "type": type(x).__name__}
    a = np.asarray(x)
    meta = {"kind": "array", "dtype": str(a.dtype), "scalar": isinstance(x, np.generic)}
    if a.dtype.name in _RAW and a.dtype == _RAW[a.dtype.name]:
        a = a.view(np.dtype(f"u{a.dtype.itemsize}"))
        meta["raw"] = True
    elif a.dtype.kind not in _NATIVE_KINDS or a.dtype.hasobject:
        what = (
            f"a {type(x).__name__} object"
            if a.dtype.kind == "O" and not isinstance(x, np.ndarray)
            else f"an array of dtype {a.dtype}"
        )
        raise DumpError(
            f"cannot dump {path}: it is {what}, which has no exact pickle-free form. Dumps hold "
            "numeric, bool, string and ml_dtypes arrays, PRNG keys and Python scalars; convert it to "
            "one of those before the step, or make the argument static."
        )
    return a, meta


def array_crc32(a: np.ndarray) -> int:
    """The CRC-32 of an array's bytes in C order (as a dump stores them). Not jit-safe."""
    return zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)


def _write_atomic(path: str, write) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def save_dump(path: str, args: tuple, kwargs: dict | None = None, *, meta: dict | None = None) -> str:
    """Write ``args``/``kwargs`` (host or device arrays) under directory ``path``; returns it. Not jit-safe.

    ``arrays.npz`` is written without pickle and ``tree.json`` last, each atomically, so a directory
    with a ``tree.json`` holds a complete dump. Flax NNX objects among ``args`` are written as their
    ``nnx.State`` and recorded (position and class name, as data) under ``meta["nnx"]``; a caller that
    passes the states itself (the guard) records the objects there.

    Raises:
      DumpError: a leaf has no exact pickle-free form (an object array, an arbitrary Python object),
        a dict has keys other than all-str or all-int, the tree is deeper than ``MAX_DEPTH``, or the
        directory cannot be written (the message carries the OS error).
    """
    args, records = split_for_dump(tuple(args))  # live NNX objects: their nnx.State, their class recorded
    meta = {**(meta or {}), **({"nnx": records} if records else {})}
    payload = (args, dict(kwargs or {}))
    leaves: list = []
    enc = Encoder(leaves, root_names=("args", "kwargs"))
    try:
        tree = enc.node(payload, "")
    except RecursionError:
        raise DumpError(f"cannot dump to {path}: the tree is nested too deeply to describe.") from None
    arrays, leaf_meta = {}, []
    for i, (leaf, name) in enumerate(zip(leaves, enc.paths)):
        a, m = _encode_leaf(leaf, name)
        if a is not None:
            arrays[f"leaf_{i}"] = a
            m["shape"] = list(a.shape)
            m["crc32"] = array_crc32(a)  # ties each stored array to its leaf: a swapped or altered member is refused
        m["path"] = name
        leaf_meta.append(m)
    description = {**(meta or {}), "format": FORMAT, "tree": tree, "leaves": leaf_meta}
    text = json.dumps(description, default=str)

    def write_arrays(fh):
        with zipfile.ZipFile(fh, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, a in arrays.items():
                with zf.open(f"{name}.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, np.ascontiguousarray(a) if a.ndim else a, allow_pickle=False)

    try:
        os.makedirs(path, exist_ok=True)
        _write_atomic(os.path.join(path, "arrays.npz"), write_arrays)
        _write_atomic(os.path.join(path, "tree.json"), lambda fh: fh.write(text.encode()))
    except OSError as e:
        raise DumpError(
            f"cannot write the dump to {path}: {e.strerror or e}. Point dump_dir at a writable "
            "directory with free space."
        ) from e
    return path
