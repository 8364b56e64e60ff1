"""Reading the data of :func:`jaxsane.check_data`: user data (arrays, dicts, tuples, iterables of
batches, callables) normalized to arrays, split into batches and rows, and its inputs, labels and
mask looked up in a batch.

Nothing here runs inside ``jit``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from .._core.errors import DataError, JaxsaneError
from .._core.tree import PyTree, explicit_sharding, path_str
from .._experiment.batches import INPUT_KEYS, LABEL_KEYS, MASK_KEYS

_KNOWN_KEYS = set(INPUT_KEYS) | set(LABEL_KEYS) | set(MASK_KEYS)


def _is_arraylike(x: Any) -> bool:
    return isinstance(x, (np.ndarray, jax.Array, np.generic))


def as_arrays(tree: Any, where: str) -> PyTree:
    """Arrays for every leaf (lists of numbers become arrays); clear errors for the rest. Not jit-safe."""
    if isinstance(tree, Mapping):
        return {k: as_arrays(v, f"{where}[{k!r}]") for k, v in tree.items()}
    fields: Any = getattr(tree, "_fields", None)  # a NamedTuple's field names
    if isinstance(tree, tuple) and fields is None:
        return tuple(as_arrays(v, f"{where}[{i}]") for i, v in enumerate(tree))
    if isinstance(tree, tuple):  # NamedTuple
        return type(tree)(*(as_arrays(v, f"{where}.{f}") for f, v in zip(fields, tree)))
    if isinstance(tree, list) and tree and all(_is_arraylike(v) or isinstance(v, (Mapping, tuple)) for v in tree):
        return tuple(as_arrays(v, f"{where}[{i}]") for i, v in enumerate(tree))
    if isinstance(tree, (str, bytes)):
        raise DataError(
            f"{where} is a string ({tree[:30]!r}); tokenize/encode text to integer ids before it reaches the model."
        )
    if isinstance(tree, jax.Array):
        return tree
    if isinstance(tree, (np.ndarray, np.generic, list, int, float, bool, complex)):
        try:
            arr = np.asarray(tree)
        except ValueError as e:  # ragged nested lists
            raise DataError(
                f"{where} is ragged (rows of different lengths): {e}. Pad every row to one "
                "length and pass a padding mask."
            ) from None
        if arr.dtype.kind in "OUSV":
            kind = {"O": "object", "U": "string", "S": "bytes", "V": "void/structured"}[arr.dtype.kind]
            raise DataError(
                f"{where} has dtype {arr.dtype} ({kind}); convert it to a numeric array "
                "(encode strings to ids, pad ragged rows to one length)."
            )
        return arr
    if hasattr(tree, "__array__"):  # e.g. a torch tensor or pandas column
        return as_arrays(np.asarray(tree), where)
    raise DataError(
        f"{where} is a {type(tree).__name__}, not an array: pass numpy/jax arrays, dicts or (x, y) tuples of them."
    )


def named_leaves(tree: PyTree, root: str) -> list[tuple[str, Any]]:
    """``(path, leaf)`` for every leaf, paths spelled from ``root``. Not jit-safe."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(path_str(p, root), leaf) for p, leaf in flat]


def num_rows(tree: PyTree, where: str) -> int:
    """The common leading size of every leaf with an axis; DataError when they disagree. Not jit-safe."""
    first = None
    for path, leaf in named_leaves(tree, where):
        if np.ndim(leaf) == 0:
            continue
        if first is None:
            first = (path, leaf.shape[0])
        elif leaf.shape[0] != first[1]:
            raise DataError(
                f"ragged batch: {path} has {leaf.shape[0]} rows but {first[0]} has {first[1]}. "
                "Likely cause: the arrays (inputs and labels) were sliced or filtered separately. "
                "Fix: every array of a batch needs the same leading (example) axis."
            )
    if first is None:
        raise DataError(f"{where} has no array with a leading example axis.")
    return int(first[1])


def _indexable(a: Any) -> Any:
    """``a``, or its host copy when it is sharded over Explicit mesh axes (whose row slices have no
    unambiguous sharding on device)."""
    if explicit_sharding(a) is not None and a.is_fully_addressable:
        return np.asarray(a)
    return a


def slice_rows(tree: PyTree, s: int, e: int) -> PyTree:
    """Rows ``s:e`` of every leaf with an axis. Not jit-safe."""
    return jax.tree_util.tree_map(lambda a: _indexable(a)[s:e] if np.ndim(a) else a, tree)


def take_rows(tree: PyTree, idx: np.ndarray) -> PyTree:
    """Rows ``idx`` of every leaf with an axis. Not jit-safe."""
    return jax.tree_util.tree_map(lambda a: _indexable(a)[idx] if np.ndim(a) else a, tree)


def is_data(x: Any) -> bool:
    """True for in-memory data (an array, a dict or a tuple of arrays), read as one whole split. Not jit-safe."""
    if _is_arraylike(x) or isinstance(x, Mapping):
        return True
    return isinstance(x, tuple) and bool(x) and all(_is_arraylike(v) or isinstance(v, (Mapping, tuple)) for v in x)


class Stream:
    """Batches of one split: ``(batch index, raw batch)`` pairs, read at most ``limit`` at a time.

    ``is_stream`` is False for in-memory data (one batch, the whole split). With ``peek``, once the
    limit is reached one more batch is read to learn whether the stream went on (``more``), so a
    check can say that it looked at a prefix. With ``seconds``, reading stops (after at least one
    batch) once that much time has passed since the first batch was asked for (``timed_out``; with
    ``peek``, ``more`` says whether one more batch came). ``seconds_read``: the time spent reading.
    """

    def __init__(self, data: Any, what: str, limit: int | None, *, peek: bool = False, seconds: float | None = None):
        if data is not None and not is_data(data) and callable(data):
            data = data()
        self.more = self.timed_out = False
        self.seconds, self.seconds_read = seconds, 0.0
        if is_data(data):
            self.is_stream, self._data = False, data
            return
        if isinstance(data, (str, bytes)) or not isinstance(data, Iterable):
            raise DataError(
                f"cannot read {what} data of type {type(data).__name__}: pass an array, a dict or "
                "(x, y) tuple of arrays, or an iterable of such batches."
            )
        self.is_stream, self._data = True, data
        self.what, self.limit, self.peek = what, limit, peek

    def __iter__(self) -> Iterator[tuple[int, PyTree]]:
        if not self.is_stream:
            yield 0, self._data
            return
        start = time.monotonic()
        it = iter(self._data)
        b = 0
        while True:
            self.seconds_read = time.monotonic() - start
            over_time = self.seconds is not None and b > 0 and self.seconds_read >= self.seconds
            if over_time or (self.limit is not None and b >= self.limit):
                self.timed_out = over_time
                if self.peek:
                    self.more = self._next(it, b) is not _END
                return
            batch = self._next(it, b)
            if batch is _END:
                self.seconds_read = time.monotonic() - start
                return
            yield b, batch
            b += 1

    def _next(self, it: Iterator, b: int) -> Any:
        try:
            return next(it)
        except StopIteration:
            return _END
        except JaxsaneError:
            raise
        except Exception as e:
            raise DataError(
                f"reading {self.what} batch {b} raised {type(e).__name__}: {e} (in your data "
                "iterator; see the chained traceback)"
            ) from e


_END = object()


def apply_handle(
    batch: PyTree, spec: Any, keys: tuple[str, ...], index: int | None, what: str, where: str, required: bool
) -> Any:
    """Apply a handle (callable, dict key or default lookup) to a batch. Not jit-safe."""
    if callable(spec):
        return _call_handle(batch, spec, what, where)
    if isinstance(spec, str):
        if isinstance(batch, Mapping):
            if spec in batch:
                return batch[spec]
            raise DataError(
                f"{where} has no {what} key {spec!r}; its keys are {sorted(map(str, batch))}. "
                f"Pass {what}= one of them, or a function batch -> array."
            )
        raise DataError(
            f"{what}={spec!r} names a dict key, but {where} is a {type(batch).__name__}; pass a "
            f"function batch -> array instead."
        )
    if spec is not None:
        raise DataError(f"{what} must be a function batch -> array, a dict key or None, got {type(spec).__name__}.")
    return _default_handle(batch, keys, index, what, where, required)


def _call_handle(batch: PyTree, spec: Any, what: str, where: str) -> Any:
    try:
        return spec(batch)
    except JaxsaneError:
        raise
    except Exception as e:
        raise DataError(
            f"the {what} function raised {type(e).__name__}: {e} on {where}; make it accept a "
            "batch (or a slice of the data) and return an array."
        ) from None


def _default_handle(
    batch: PyTree, keys: tuple[str, ...], index: int | None, what: str, where: str, required: bool
) -> Any:
    """The default lookup: the first of ``keys`` in a dict, element ``index`` of a tuple, a bare array as inputs."""
    if isinstance(batch, Mapping):
        for k in keys:
            if k in batch:
                return batch[k]
        if required:
            other = [str(k) for k in batch if str(k) not in _KNOWN_KEYS]  # not the inputs or mask: a candidate
            key = other[0] if other else "<key>"
            raise DataError(
                f"cannot find the {what} in {where} with keys {sorted(map(str, batch))}: looked for "
                f"{list(keys)}. Pass a function batch -> array: Experiment({what}=lambda batch: "
                f"batch[{key!r}]) (check_data also takes the key itself, {what}={key!r})."
            )
        return None
    if isinstance(batch, tuple):
        if index is not None and len(batch) > index:
            return batch[index]
        if required:
            raise DataError(
                f"{where} is a tuple of {len(batch)} arrays; the {what} should be element {index}. "
                f"Pass {what}= a function batch -> array."
            )
        return None
    if what == "inputs":  # a bare array is the inputs
        return batch
    if required:
        raise DataError(
            f"{where} is a bare {type(batch).__name__} (inputs only) but {what} are needed (num_classes "
            f"was given): pass (x, y), a dict with a label key, or {what}= a function batch -> array."
        )
    return None


def host_array(x: Any) -> np.ndarray:
    """``x`` as a numpy array (a copy to the host unless it is one). Not jit-safe."""
    return x if isinstance(x, np.ndarray) else np.asarray(x)
