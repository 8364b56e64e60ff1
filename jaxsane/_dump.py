"""Safe dumps of a failing step's inputs: ``arrays.npz`` (no pickle) + ``tree.json``.

A dump round-trips bitwise, bfloat16 and PRNG keys included. Plain containers (dict, list,
tuple, None, NamedTuple) are rebuilt from the JSON description; other pytree nodes (a linen
``TrainState``, an ``nnx.State``) are rebuilt by passing ``like=``, a pytree of the same
structure (e.g. ``experiment.init(key)``). Nothing here is jit-safe.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from typing import Any

import jax
import numpy as np

from ._errors import JaxsaneError
from ._tree import is_key as _is_key, path_str

FORMAT = "jaxsane-dump-v1"


def _encode_leaf(x: Any) -> tuple[np.ndarray, dict]:
    """Leaf -> (storable numpy array, JSON meta)."""
    if _is_key(x):
        data = np.asarray(jax.random.key_data(x))
        return data, {"kind": "key", "impl": str(jax.random.key_impl(x)), "dtype": str(data.dtype)}
    if isinstance(x, (bool, int, float, complex)) and not isinstance(x, np.generic):
        return np.asarray(x), {"kind": "python", "type": type(x).__name__}
    a = np.asarray(x)
    meta = {"kind": "array", "dtype": str(a.dtype)}
    if a.dtype.kind == "V" or a.dtype.name in ("bfloat16",) or a.dtype.kind not in "biufc":
        # ml_dtypes (bfloat16, float8...) are stored as raw unsigned bytes of the same width.
        a = a.view(np.dtype(f"u{a.dtype.itemsize}"))
        meta["raw"] = True
    return a, meta


def _decode_leaf(a: np.ndarray, meta: dict) -> Any:
    if meta["kind"] == "key":
        impl = meta["impl"]
        try:
            return jax.random.wrap_key_data(a, impl=impl)
        except Exception:  # older impl spellings
            return jax.random.wrap_key_data(a)
    if meta["kind"] == "python":
        return {"bool": bool, "int": int, "float": float, "complex": complex}[meta["type"]](a.item())
    if meta.get("raw"):
        import ml_dtypes  # noqa: F401  (registers bfloat16 & co with numpy)
        return a.view(np.dtype(meta["dtype"]))
    return a


def _encode_tree(tree: Any, leaves: list) -> Any:
    """JSON description of plain containers; anything else becomes an opaque node."""
    if tree is None:
        return {"t": "none"}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        cls = type(tree)
        return {"t": "namedtuple", "cls": f"{cls.__module__}:{cls.__qualname__}", "fields": list(tree._fields),
                "c": [_encode_tree(v, leaves) for v in tree]}
    if isinstance(tree, (tuple, list)):
        return {"t": type(tree).__name__, "c": [_encode_tree(v, leaves) for v in tree]}
    if isinstance(tree, dict):
        keys = list(tree.keys())
        if all(isinstance(k, str) for k in keys):
            keys = sorted(keys)  # jax flattens dicts in sorted-key order; leaves stay in that order
            return {"t": "dict", "k": keys, "c": [_encode_tree(tree[k], leaves) for k in keys]}
    sub_leaves = jax.tree_util.tree_leaves(tree)
    if len(sub_leaves) == 1 and sub_leaves[0] is tree:
        leaves.append(tree)
        return {"t": "leaf", "i": len(leaves) - 1}
    start = len(leaves)
    leaves.extend(sub_leaves)
    return {"t": "opaque", "type": type(tree).__qualname__, "range": [start, len(leaves)]}


def _decode_tree(node: dict, leaves: list) -> Any:
    t = node["t"]
    if t == "none":
        return None
    if t == "leaf":
        return leaves[node["i"]]
    if t in ("tuple", "list"):
        items = [_decode_tree(c, leaves) for c in node["c"]]
        return tuple(items) if t == "tuple" else items
    if t == "dict":
        return {k: _decode_tree(c, leaves) for k, c in zip(node["k"], node["c"])}
    if t == "namedtuple":
        items = [_decode_tree(c, leaves) for c in node["c"]]
        module, _, qualname = node["cls"].partition(":")
        try:
            cls: Any = importlib.import_module(module)
            for part in qualname.split("."):
                cls = getattr(cls, part)
            return cls(*items)
        except Exception:
            return dict(zip(node["fields"], items))
    start, stop = node["range"]
    return list(leaves[start:stop])


@dataclasses.dataclass
class Dump:
    """A failing step's inputs read back from disk.

    Attributes:
      args, kwargs: the step's positional and keyword arguments.
      meta: the JSON description (step index, finding, paths, dtypes).
    """

    args: tuple
    kwargs: dict
    meta: dict

    @property
    def step(self) -> int | None:
        return self.meta.get("step")

    @property
    def finding(self) -> dict | None:
        return self.meta.get("finding")


def save_dump(path: str, args: tuple, kwargs: dict | None = None, *, meta: dict | None = None) -> str:
    """Write ``args``/``kwargs`` (host or device arrays) under directory ``path``; returns it."""
    os.makedirs(path, exist_ok=True)
    payload = (tuple(args), dict(kwargs or {}))
    leaves: list = []
    tree = _encode_tree(payload, leaves)
    arrays, leaf_meta = {}, []
    paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(payload)[0]]
    for i, leaf in enumerate(leaves):
        arrays[f"leaf_{i}"], m = _encode_leaf(leaf)
        m["path"] = paths[i] if len(paths) == len(leaves) else None
        m["shape"] = list(np.shape(arrays[f"leaf_{i}"]))
        leaf_meta.append(m)
    np.savez(os.path.join(path, "arrays.npz"), **arrays)
    description = {"format": FORMAT, "tree": tree, "leaves": leaf_meta, **(meta or {})}
    with open(os.path.join(path, "tree.json"), "w") as fh:
        json.dump(description, fh, indent=1, default=str)
    return path


def load_dump(path: str, like: Any = None) -> Dump:
    """Read a dump written by a guarded step (``guard(..., dump_dir=...)``). Not jit-safe.

    Args:
      path: the dump directory (holding ``arrays.npz`` and ``tree.json``).
      like: optional pytree with the structure of the step's positional args, used to rebuild
        custom pytree nodes (TrainState, nnx.State); plain containers need nothing.

    Returns:
      A :class:`Dump` whose ``args``/``kwargs`` are bitwise the failing step's inputs.
    """
    tree_file, array_file = os.path.join(path, "tree.json"), os.path.join(path, "arrays.npz")
    if not (os.path.isfile(tree_file) and os.path.isfile(array_file)):
        raise JaxsaneError(f"{path!r} is not a jaxsane dump: it needs tree.json and arrays.npz. Point at the "
                           "directory a guarded step printed in its NonFiniteError.")
    with open(tree_file) as fh:
        meta = json.load(fh)
    if meta.get("format") != FORMAT:
        raise JaxsaneError(f"{path!r} has format {meta.get('format')!r}; this jaxsane reads {FORMAT!r}.")
    with np.load(array_file, allow_pickle=False) as data:
        leaves = [_decode_leaf(data[f"leaf_{i}"], m) for i, m in enumerate(meta["leaves"])]
    if like is not None:
        like_args = tuple(like) if isinstance(like, (tuple, list)) else (like,)
        n_args = len(jax.tree_util.tree_leaves(like_args))
        args = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like_args), leaves[:n_args])
        kw_node = meta["tree"]["c"][1]
        kwargs = _decode_tree(kw_node, leaves)
        return Dump(tuple(args), kwargs, meta)
    args, kwargs = _decode_tree(meta["tree"], leaves)
    return Dump(tuple(args), kwargs, meta)
