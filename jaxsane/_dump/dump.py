"""Safe dumps of a failing step's inputs: ``arrays.npz`` (no pickle) + ``tree.json``; reading them here
(:func:`jaxsane.load_dump`), writing them in ``_dump/save.py`` (:func:`jaxsane.save_dump`, re-exported);
the files are opened and their arrays read safely in ``_dump/npz.py``.

A dump round-trips bitwise, bfloat16, int4, float8 and typed PRNG keys included. Dumps are data,
never code: the loader rebuilds containers from a closed set of kinds (dict with str/int keys, list,
tuple, None, namedtuple and custom-node *shapes* recorded by field name) and never imports or calls
a name found in the file. Custom pytree nodes (a linen ``TrainState``, an ``nnx.State``) come back
as generic shapes unless ``like=`` (a pytree of the same structure, e.g. ``experiment.init(key)``)
is passed. Every malformed file is a :class:`~jaxsane.DumpError`. Nothing here is jit-safe.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import keyword
import os
import re
from typing import Any

import jax
import numpy as np

from .._core.errors import DumpError, DumpShapeError
from .._core.validate import fail, require_int
from .._experiment.purify import combine, needs_partition, partition
from .format import (
    FORMAT as FORMAT,
    MAX_BYTES as MAX_BYTES,
    MAX_DEPTH as MAX_DEPTH,
    MAX_JSON_BYTES as _MAX_JSON_BYTES,
    MAX_NODES as MAX_NODES,
    PYTHON_SCALARS as _PYTHON,
    RAW_DTYPES as _RAW,
    READABLE as _READABLE,
)
from .nnx import nnx_templates, objects_error, read_records, standin
from .npz import open_npz, open_regular, read_npy
from .save import Encoder as _Encoder, array_crc32, save_dump as save_dump

# ----------------------------------------------------------------------------- load


class _Reader:
    """Validates tree.json and rebuilds it; every defect is a DumpError naming the file and JSON path."""

    def __init__(self, file: str, leaf_meta: list, max_depth: int, max_nodes: int):
        self.file, self.leaf_meta, self.max_depth, self.max_nodes = file, leaf_meta, max_depth, max_nodes
        self.nodes, self.next_leaf = 0, 0
        self.generic: dict[str, str] = {}  # path -> recorded type of a custom node rebuilt as a generic shape

    def fail(self, where: str, what: str) -> DumpError:
        return DumpError(f"{self.file} is malformed at {where}: {what}.")

    def check(self, node: Any, where: str, depth: int = 0) -> None:
        """Validate one node (recursively), counting nodes and leaf references."""
        if depth > self.max_depth:
            raise self.fail(where, f"the tree is nested deeper than max_depth={self.max_depth}")
        self.nodes += 1
        if self.nodes > self.max_nodes:
            raise self.fail(where, f"more than max_nodes={self.max_nodes} nodes")
        if not isinstance(node, dict) or not isinstance(node.get("t"), str):
            raise self.fail(where, f"expected a node object with a 't' kind, got {type(node).__name__}")
        t = node["t"]
        if t == "none":
            return
        if t == "leaf":
            self._check_leaf(node, where)
            return
        if t == "opaque":  # format v1: a run of leaves of a node that could not be described
            self._check_opaque(node, where)
            return
        if t not in ("tuple", "list", "dict", "namedtuple", "node"):
            raise self.fail(
                where, f"unknown node kind {t!r} (a dump holds only none, leaf, tuple, list, dict, namedtuple and node)"
            )
        kids = node.get("c")
        if not isinstance(kids, list):
            raise self.fail(where, "a container without a 'c' list of children")
        if t == "dict":
            self._check_dict(node, kids, where)
        elif t == "namedtuple":
            self._check_namedtuple(node, kids, where)
        elif t == "node":
            self._check_custom(node, kids, where)
        for j, c in enumerate(kids):
            self.check(c, f"{where}.c[{j}]", depth + 1)

    def _check_leaf(self, node: dict, where: str) -> None:
        i = node.get("i")
        if type(i) is not int or i != self.next_leaf or i >= len(self.leaf_meta):
            raise self.fail(
                where,
                f"leaf index {i!r} is not the next of {len(self.leaf_meta)} leaves (expected {self.next_leaf})",
            )
        self.next_leaf += 1

    def _check_opaque(self, node: dict, where: str) -> None:
        r = node.get("range")
        if (
            not isinstance(r, list)
            or len(r) != 2
            or any(type(v) is not int for v in r)
            or r[0] != self.next_leaf
            or not r[0] <= r[1] <= len(self.leaf_meta)
        ):
            raise self.fail(where, f"bad leaf range {r!r}")
        self.next_leaf = r[1]

    def _check_dict(self, node: dict, kids: list, where: str) -> None:
        keys = node.get("k")
        if (
            not isinstance(keys, list)
            or len(keys) != len(kids)
            or len({type(k) for k in keys}) > 1
            or any(not isinstance(k, (str, int)) or isinstance(k, bool) for k in keys)
            or len(set(keys)) != len(keys)
        ):
            raise self.fail(where, "dict keys must be a list of distinct str or int, one per child")

    def _check_namedtuple(self, node: dict, kids: list, where: str) -> None:
        fields = node.get("fields")
        if node.get("cls") is not None and node.get("name") is None:  # v1 named the class; keep its name only
            node["name"] = str(node["cls"]).rpartition(":")[2].rpartition(".")[2]
        if (
            not _identifier(node.get("name"))
            or not isinstance(fields, list)
            or len(fields) != len(kids)
            or not all(_identifier(f) and not f.startswith("_") for f in fields)
            or len(set(fields)) != len(fields)
        ):
            raise self.fail(
                where, "a namedtuple needs an identifier name and distinct identifier fields, one per child"
            )

    def _check_custom(self, node: dict, kids: list, where: str) -> None:
        keys = node.get("keys")
        if (
            not isinstance(node.get("type"), str)
            or not isinstance(keys, list)
            or len(keys) != len(kids)
            or not all(
                isinstance(k, dict)
                and len(k) == 1
                and _KEY_KINDS.get(next(iter(k))) is not None
                and _KEY_KINDS[next(iter(k))](next(iter(k.values())))
                for k in keys
            )
        ):
            raise self.fail(where, "a custom node needs a 'type' string and one key object per child")

    def build(self, node: dict, leaves: list, path: str) -> Any:
        t = node["t"]
        if t == "none":
            return None
        if t == "leaf":
            return leaves[node["i"]]
        if t == "opaque":
            return list(leaves[node["range"][0] : node["range"][1]])
        kids = node["c"]
        if t == "dict":
            return {k: self.build(c, leaves, f"{path}[{k!r}]") for k, c in zip(node["k"], kids)}
        if t in ("tuple", "list"):
            items = [self.build(c, leaves, f"{path}[{j}]") for j, c in enumerate(kids)]
            return tuple(items) if t == "tuple" else items
        if t == "namedtuple":
            items = [self.build(c, leaves, f"{path}.{f}") for f, c in zip(node["fields"], kids)]
            return _generic_type(node["name"], tuple(node["fields"]), node["name"])(*items)
        # a custom node: a namedtuple shape when its children are named attributes, else a dict or tuple
        keys = [next(iter(k.items())) for k in node["keys"]]
        type_name = node["type"]
        self.generic[path or "<root>"] = type_name
        short = type_name.rpartition(":")[2].rpartition(".")[2]
        names = [v for kind, v in keys if kind == "a"]
        if (
            len(names) == len(keys)
            and all(_identifier(v) and not v.startswith("_") for v in names)
            and len(set(names)) == len(names)
        ):
            items = [self.build(c, leaves, f"{path}.{n}") for n, c in zip(names, kids)]
            return _generic_type(short if _identifier(short) else "Node", tuple(names), type_name)(*items)
        if (
            all(kind == "d" for kind, _ in keys)
            and len({type(v) for _, v in keys}) <= 1
            and len({v for _, v in keys}) == len(keys)
        ):
            return {v: self.build(c, leaves, f"{path}[{v!r}]") for (_, v), c in zip(keys, kids)}
        return tuple(self.build(c, leaves, f"{path}[{j}]") for j, c in enumerate(kids))


# the key objects of a custom node's children: attribute name, dict key, position, repr (information only)
_KEY_KINDS = {
    "a": lambda v: isinstance(v, str),
    "r": lambda v: isinstance(v, str),
    "d": lambda v: isinstance(v, (str, int)) and not isinstance(v, bool),
    "i": lambda v: type(v) is int,
}


def _identifier(name: Any) -> bool:
    return isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name)


_GENERIC_TYPES: dict = {}


def _generic_type(name: str, fields: tuple, origin: str) -> type:
    """A namedtuple made here from validated names; missing attributes explain how to get the real class."""
    key = (name, fields, origin)
    if key in _GENERIC_TYPES:
        return _GENERIC_TYPES[key]
    # mypy reads namedtuple() only with a literal name; this one is made at run time from validated names
    base = collections.namedtuple(name, fields, module=__name__)  # type: ignore[misc]

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise DumpShapeError(
            f"{name} read from a dump is a generic shape with fields {list(fields)} (the dump recorded "
            f"{origin}); it has no attribute {attr!r}. Dumps never import classes: pass like=<a pytree of "
            "your own types> to jaxsane.load_dump, or `jaxsane replay DUMP --step module:experiment`."
        )

    cls = type(
        name, (base,), {"__slots__": (), "__getattr__": __getattr__, "_jaxsane_origin": origin, "__module__": __name__}
    )
    if len(_GENERIC_TYPES) < 4096:
        _GENERIC_TYPES[key] = cls
    return cls


def _decode_leaf(a: np.ndarray | None, meta: dict, where: str) -> Any:
    kind = meta.get("kind")
    if kind == "bigint":
        value = meta.get("value")
        if not isinstance(value, str) or not re.fullmatch(r"-?[0-9]{1,4300}", value):
            raise DumpError(f"{where}: a big integer must be a decimal string, got {value!r}.")
        return int(value)
    if kind == "python" and meta.get("type") == "str":
        if not isinstance(meta.get("value"), str):
            raise DumpError(f"{where}: a str leaf without a string value.")
        return meta["value"]
    assert a is not None, "only big integers and strings are stored without an array"
    if kind == "key":
        impl = meta.get("impl")
        if not isinstance(impl, str) or a.dtype.kind != "u":
            raise DumpError(f"{where}: a PRNG key needs an implementation name and unsigned key data.")
        try:
            # jax annotates jax.Array; numpy key data is accepted (and stays bitwise)
            return jax.random.wrap_key_data(a, impl=impl)  # type: ignore[arg-type]
        except Exception as e:  # an unknown implementation or key data of the wrong shape
            raise DumpError(
                f"{where}: cannot rebuild a {impl!r} PRNG key from data of shape {a.shape} ({e})."
            ) from None
    if kind == "python":
        scalar_type: Any = meta.get("type")  # checked here: one of the Python scalar type names
        typ = _PYTHON.get(scalar_type) if isinstance(scalar_type, str) else None
        if (
            typ is None
            or a.ndim != 0
            or a.dtype.kind != {"bool": "b", "int": "i", "float": "f", "complex": "c"}[meta["type"]]
        ):
            raise DumpError(
                f"{where}: bad Python scalar type {meta.get('type')!r} for a {a.dtype} array of shape {a.shape}."
            )
        return typ(a.item())
    if kind != "array":
        raise DumpError(f"{where}: unknown leaf kind {kind!r} (array, key, python or bigint).")
    dtype = meta.get("dtype")
    if meta.get("raw"):
        target = _RAW.get(dtype) if isinstance(dtype, str) else None
        if target is None or a.dtype != np.dtype(f"u{target.itemsize}"):
            raise DumpError(f"{where}: raw dtype {dtype!r} is not an ml_dtypes type stored as {a.dtype}.")
        a = a.view(target)
    elif str(a.dtype) != dtype:
        raise DumpError(f"{where}: the array has dtype {a.dtype} but tree.json says {dtype!r}.")
    if meta.get("shape") is not None and list(a.shape) != meta["shape"]:
        raise DumpError(f"{where}: the array has shape {list(a.shape)} but tree.json says {meta['shape']}.")
    return a[()] if meta.get("scalar") and a.ndim == 0 else a


@dataclasses.dataclass
class Dump:
    """A failing step's inputs read back from disk.

    Attributes:
      args, kwargs: the step's positional and keyword arguments.
      meta: the JSON description (step index, finding, paths, dtypes).
      generic: ``{path: recorded type}`` of custom pytree nodes rebuilt as generic shapes (a
        namedtuple with the same field names, or a dict); pass ``like=`` to get your own classes.
      objects: ``{position: class name}`` of the positional args that were Flax NNX objects (recorded
        as data, never imported); without ``like=`` they come back as their ``nnx.State``.
    """

    args: tuple
    kwargs: dict
    meta: dict
    generic: dict = dataclasses.field(default_factory=dict)
    objects: dict = dataclasses.field(default_factory=dict)

    @property
    def step(self) -> int | None:
        step = self.meta.get("step")
        return step if type(step) is int else None

    @property
    def finding(self) -> dict | None:
        finding = self.meta.get("finding")
        return finding if isinstance(finding, dict) else None


def _node_kind(n: dict) -> str:
    if n["t"] == "namedtuple":
        return f"namedtuple {n['name']}{tuple(n['fields'])}"
    if n["t"] == "node":
        return f"{n['type'].rpartition(':')[2]} node"
    return {"none": "None", "leaf": "a leaf"}.get(n["t"], n["t"])


def _same_node(want: dict, got: dict) -> bool:
    """Whether two structure descriptions agree at this node (kind, names, keys, child count)."""
    tw, tg = want["t"], got["t"]
    same = tw == tg
    if same and tw == "namedtuple":
        same = want["name"] == got["name"] and list(want["fields"]) == list(got["fields"])
    if same and tw == "node":
        same = want["type"].rpartition(":")[2] == got["type"].rpartition(":")[2] and want["keys"] == got["keys"]
    if same and tw == "dict":
        same = list(want["k"]) == list(got["k"])
    if same and tw in ("tuple", "list", "namedtuple", "node", "dict"):
        same = len(want["c"]) == len(got["c"])
    return same


def _mismatch(want: dict, got: dict, path: str) -> str:
    """What differs at a node where :func:`_same_node` is False."""
    tw, tg = want["t"], got["t"]
    extra = ""
    if tw == tg == "dict":
        extra = f" (keys {list(want['k'])} vs {list(got['k'])})"
    elif tw == tg == "node" and want["keys"] != got["keys"]:

        def names(n):
            return [next(iter(k.values())) for k in n["keys"]]

        extra = f" (children {names(want)} vs {names(got)})"
    elif tw == tg and "c" in want:
        extra = f" ({len(want['c'])} vs {len(got['c'])} children)"
    return f"{path or '<root>'}: like= has {_node_kind(want)}, the dump has {_node_kind(got)}{extra}"


def _child_steps(want: dict) -> list[str]:
    """The path suffix of each child of a container node (``['k']``, ``.field``, ``[0]``)."""
    tw = want["t"]
    if tw == "dict":
        return [f"[{k!r}]" for k in want["k"]]
    if tw == "namedtuple":
        return [f".{f}" for f in want["fields"]]
    if tw == "node":
        return [
            jax.tree_util.keystr((jax.tree_util.GetAttrKey(v),)) if k == "a" else f"[{v!r}]"
            for k, v in (next(iter(d.items())) for d in want["keys"])
        ]
    return [f"[{j}]" for j in range(len(want["c"]))]


def _first_difference(want: dict, got: dict, path: str) -> str | None:
    """The first path where two structure descriptions differ, with what differs; None when equal."""
    if got["t"] == "opaque":  # v1 dumps described custom nodes only by their leaf count
        return None
    if not _same_node(want, got):
        return _mismatch(want, got, path)
    if want["t"] in ("none", "leaf"):
        return None
    for s, a, b in zip(_child_steps(want), want["c"], got["c"]):
        diff = _first_difference(a, b, path + s)
        if diff:
            return diff
    return None


def load_dump(
    path: str, like: Any = None, *, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES
) -> Dump:
    """Read a dump written by a guarded step (``guard(..., dump_dir=...)``). Not jit-safe.

    Safe on a dump from a stranger: nothing named in the files is imported or called, arrays are
    read without pickle, only regular files are opened (no symlinks, FIFOs or devices), and the
    sizes are checked from the zip directory and ``.npy`` headers before anything is inflated.

    Args:
      path: the dump directory (holding ``arrays.npz`` and ``tree.json``).
      like: optional templates of the step's positional args (a tuple, or one arg), used to rebuild
        custom pytree nodes (TrainState, nnx.State) as your own classes; they must have the dump's
        structure. Live Flax NNX objects are templates too: ``like=(model, optimizer, batch)`` merges
        the dumped state into fresh copies (``nnx.merge``; ``model`` and ``optimizer`` are not
        modified), so ``args`` holds real objects. Fewer templates than args: the rest come from the
        dump's data (``like=(model, optimizer)``). Without it custom nodes come back as generic shapes
        (see ``Dump.generic``) and NNX objects as their state, refusing to be used as the object.
      max_bytes: refuse dumps whose arrays inflate to more bytes than this (default 4 GiB).
      max_depth, max_nodes: refuse trees nested deeper, or with more containers and leaves.

    Returns:
      A :class:`Dump` whose ``args``/``kwargs`` are bitwise the failing step's inputs.

    Raises:
      DumpError: the directory is not a dump, a file is damaged, truncated, not a regular file,
        over a limit, or ``like`` has another structure (the message names the first differing path).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise fail("load_dump", "path", "a dump directory (str or os.PathLike)", path)
    path = os.fspath(path)
    max_bytes = require_int("load_dump", "max_bytes", max_bytes, min=0)
    max_depth = require_int("load_dump", "max_depth", max_depth, min=1)
    max_nodes = require_int("load_dump", "max_nodes", max_nodes, min=1)
    tree_file = os.path.join(path, "tree.json")
    meta, tree, reader = _read_description(path, tree_file, max_depth, max_nodes)
    leaves = _read_leaves(path, reader.leaf_meta, max_bytes)
    args_node, kw_node = tree["c"]
    objects = read_records(meta, args_node, tree_file)
    if like is None:
        args, templates = [reader.build(c, leaves, f"args[{j}]") for j, c in enumerate(args_node["c"])], 0
    else:
        args, templates = _args_like(path, like, args_node, leaves, reader)
    missing = {p: c for p, c in objects.items() if like is None or p >= templates}
    if missing:  # NNX objects without a template: their states, refusing to stand in for the objects
        names = meta.get("arg_names") if isinstance(meta.get("arg_names"), list) else None
        message = str(objects_error(path, missing, names))
        for p in missing:
            args[p] = standin(args[p], message)
            reader.generic[f"args[{p}]"] = f"{missing[p]} (an NNX object; its nnx.State is here)"
    kwargs = reader.build(kw_node, leaves, "kwargs")
    return Dump(tuple(args), kwargs, meta, reader.generic, objects)


def _read_description(path: str, tree_file: str, max_depth: int, max_nodes: int) -> tuple[dict, dict, _Reader]:
    """``(meta, tree, reader)`` of a dump's ``tree.json``, validated: the JSON object, its format, the leaf
    list and the tree (whose root is ``(args tuple, kwargs dict)`` using every leaf once)."""
    with open_regular(tree_file, "tree.json") as fh:
        if os.fstat(fh.fileno()).st_size > _MAX_JSON_BYTES:
            raise DumpError(f"{tree_file} is larger than {_MAX_JSON_BYTES} bytes; not a jaxsane dump description.")
        raw = fh.read(_MAX_JSON_BYTES + 1)
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, an int of too many digits
        raise DumpError(
            f"{tree_file} is not valid JSON ({type(e).__name__}: {str(e)[:200]}); the dump is truncated or damaged."
        ) from None
    if not isinstance(meta, dict):
        raise DumpError(f"{tree_file} holds a JSON {type(meta).__name__}, not the object a dump description is.")
    if meta.get("format") not in _READABLE:
        raise DumpError(f"{path!r} has format {meta.get('format')!r}; this jaxsane reads {FORMAT!r}.")
    leaf_meta, tree = meta.get("leaves"), meta.get("tree")
    if not isinstance(leaf_meta, list) or not all(isinstance(m, dict) for m in leaf_meta):
        raise DumpError(f"{tree_file} is malformed at leaves: expected a list of leaf objects.")
    if len(leaf_meta) > max_nodes:
        raise DumpError(f"{tree_file} describes {len(leaf_meta)} leaves, over max_nodes={max_nodes}.")
    reader = _Reader(tree_file, leaf_meta, max_depth, max_nodes)
    try:
        reader.check(tree, "tree")
    except RecursionError:
        raise reader.fail("tree", f"nested too deeply for Python (max_depth={max_depth})") from None
    assert isinstance(tree, dict), "check() accepts only node objects"
    if (
        tree["t"] != "tuple"
        or len(tree["c"]) != 2
        or tree["c"][0]["t"] not in ("tuple", "list")
        or tree["c"][1]["t"] != "dict"
    ):
        raise reader.fail("tree", "the root must be (args tuple, kwargs dict)")
    if reader.next_leaf != len(leaf_meta):
        raise reader.fail("leaves", f"the tree uses {reader.next_leaf} of {len(leaf_meta)} leaves")
    return meta, tree, reader


def _read_leaves(path: str, leaf_meta: list, max_bytes: int) -> list:
    """Every leaf, decoded: its array from ``arrays.npz`` (big integers and strings live in tree.json)."""
    array_file = os.path.join(path, "arrays.npz")
    stored = {
        f"leaf_{i}": m
        for i, m in enumerate(leaf_meta)
        if m.get("kind") not in ("bigint",) and not (m.get("kind") == "python" and m.get("type") == "str")
    }
    leaves = []
    with open_regular(array_file, "arrays.npz") as fh, open_npz(fh, array_file, stored, max_bytes) as zf:
        for i, m in enumerate(leaf_meta):
            a = read_npy(zf, array_file, f"leaf_{i}") if f"leaf_{i}" in stored else None
            if a is not None and "crc32" in m and (type(m["crc32"]) is not int or m["crc32"] != array_crc32(a)):
                raise DumpError(
                    f"{path}: leaf {i} ({m.get('path') or '?'}): the array stored as leaf_{i}.npy is not the one "
                    "tree.json describes (its CRC-32 differs); the dump was altered or its members were mixed up."
                )
            leaves.append(_decode_leaf(a, m, f"{path}: leaf {i} ({m.get('path') or '?'})"))
    return leaves


def _args_like(path: str, like: Any, args_node: dict, leaves: list, reader: _Reader) -> tuple[list, int]:
    """``(args, templates)``: the positional args rebuilt on the templates in ``like`` (live NNX objects
    merged, Equinox models recombined), the args past them from the dump's data; ``templates`` counts
    the templates. A DumpError naming the first differing path when ``like`` has another structure."""
    like_args = tuple(like) if isinstance(like, (tuple, list)) else (like,)
    like_args, finish = nnx_templates(like_args, args_node)  # live NNX objects: their state is the template
    rest, k = None, len(like_args)
    if needs_partition(like_args):  # an Equinox model: the dump holds its arrays, like= gives the rest back
        like_args, rest = partition(like_args)
    try:
        want = _Encoder(None).node(like_args, "like")
    except (DumpError, RecursionError) as e:
        raise DumpError(f"like= cannot be described as a dump structure: {e}") from None
    head = {**args_node, "c": args_node["c"][:k]} if k < len(args_node["c"]) else args_node  # the rest: data
    diff = _first_difference(want, head, "args")
    if diff:
        raise DumpError(
            f"load_dump(like=...) does not match the dump at {path}: {diff}. Pass a pytree "
            "with the structure of the dumped step's (first) positional args, or no like= at all."
        )
    n_args = sum(1 for _ in _leaf_indices(head))
    n_like = len(jax.tree_util.tree_leaves(like_args))
    if n_like != n_args:
        raise DumpError(
            f"load_dump(like=...) does not match the dump at {path}: like= has "
            f"{n_like} leaves, the dump's args {n_args}."
        )
    args = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like_args), leaves[:n_args])
    if rest is not None:
        args = combine(args, rest)
    rebuilt = finish(list(args)) + [reader.build(c, leaves, f"args[{j}]") for j, c in enumerate(args_node["c"][k:], k)]
    return rebuilt, len(like_args)


def _leaf_indices(node: dict):
    if node["t"] == "leaf":
        yield node["i"]
    elif node["t"] == "opaque":
        yield from range(*node["range"])
    else:
        for c in node.get("c", ()):
            yield from _leaf_indices(c)
