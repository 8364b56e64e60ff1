"""Reading the user's data the way an :class:`~jaxsane.Experiment` describes it: batches from a
batch, an iterable or a callable (:func:`first_batch`, :func:`iter_batches`, :class:`Replayable`),
the inputs, labels and mask of a batch (the default keys, or the Experiment's handles), and its
examples (:func:`count_examples`, :func:`slice_examples`).

Host side; nothing here runs inside ``jit``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from .._core.errors import DataError, ExampleAxisError
from .._core.tree import PyTree, explicit_sharding, is_array
from .purify import positional_arity as _positional_arity

if TYPE_CHECKING:
    from .contract import Experiment

_INPUT_KEYS = ("x", "image", "images", "inputs", "input", "features", "tokens", "input_ids", "data")
_LABEL_KEYS = ("y", "label", "labels", "targets", "target")
_MASK_KEYS = ("mask", "attention_mask", "padding_mask", "weights")
INPUT_KEYS, LABEL_KEYS, MASK_KEYS = _INPUT_KEYS, _LABEL_KEYS, _MASK_KEYS  # the batch keys the data checks read too


def is_batch(data: Any) -> bool:
    """True when ``data`` is one batch (an array, a mapping or a tuple of arrays), not a stream."""
    if is_array(data):
        return True
    if isinstance(data, Mapping):
        return True
    if isinstance(data, tuple) and data and all(is_array(x) or isinstance(x, Mapping) for x in data):
        return True
    return False


def first_batch(data: Any, what: str = "train") -> PyTree:
    """The first batch of ``data`` (one batch, a callable, or an iterable). Not jit-safe."""
    if data is None:
        raise DataError(
            f"no {what} data: pass Experiment({what}=...) with a batch, an iterable of batches "
            "or a callable returning one."
        )
    if callable(data) and not is_batch(data):
        data = data()  # a batch, or a fresh iterable of batches (a generator function, a loader factory)
    if is_batch(data):
        batch = data
    elif isinstance(data, Iterable) and not isinstance(data, (str, bytes)):
        try:
            batch = next(iter(data))
        except StopIteration:
            raise DataError(
                f"the {what} data is empty: its iterator yielded no batch. Pass a non-empty "
                "iterable, or a callable that returns a batch."
            ) from None
    else:
        raise DataError(
            f"cannot read batches from {what} data of type {type(data).__name__}: pass a batch "
            "(dict/tuple of arrays), an iterable of batches or a callable returning one."
        )
    check_batch(batch, what)
    return batch


def iter_batches(data: Any, limit: int | None = None, what: str = "train"):
    """Yield up to ``limit`` batches. A single batch is repeated; a callable returning a batch is called
    each time; a callable returning an iterable (a generator function) is read from one fresh call."""
    if data is None:
        first_batch(data, what)
    count = 0
    if callable(data) and not is_batch(data):
        made = data()
        if is_batch(made):  # a batch per call

            def calls():
                yield made
                while True:
                    yield data()

            source = calls()
        else:  # a fresh iterable of batches
            source = made
    elif is_batch(data):
        source = itertools.repeat(data)
    else:
        source = data
    if isinstance(source, (str, bytes)) or not isinstance(source, Iterable):
        first_batch(source, what)  # raises the clear "cannot read batches" error
    it = iter(source)
    while limit is None or count < limit:  # checked before reading: no batch is read and dropped
        try:
            batch = next(it)
        except StopIteration:
            break
        check_batch(batch, what)
        yield batch
        count += 1
    if count == 0 and limit != 0:
        first_batch([], what)  # raises the empty-data error


class Replayable:
    """Wraps a one-shot iterator (a generator) so several checks can each read it from the start.

    Batches are cached as they are first read, so memory grows with what the checks consume
    (doctor reads a few dozen batches). Not jit-safe.
    """

    def __init__(self, iterator: Any):
        self._source = iter(iterator)
        self._cache: list = []

    def __iter__(self) -> Iterator[Any]:
        return self.reading(keep=math.inf)  # every batch read is cached

    def reading(self, keep: float) -> Iterator[Any]:
        """Batches from the start, as ``iter(self)``, but only the first ``keep`` are cached: a long read (doctor's
        data stage, thousands of batches) keeps what later readers replay without holding the rest; a later
        reader past the cache goes on with the source's next batches. Not jit-safe."""
        i = 0
        while True:
            if i < len(self._cache):
                yield self._cache[i]
            else:
                try:
                    batch = next(self._source)
                except StopIteration:
                    return
                if len(self._cache) < keep:
                    self._cache.append(batch)
                yield batch
            i += 1


def replayable(data: Any) -> Any:
    """``data`` itself, or a :class:`Replayable` when it is a one-shot iterator (``iter(data) is data``)."""
    if data is not None and not is_batch(data) and not callable(data) and isinstance(data, Iterable):
        if iter(data) is data:
            return Replayable(data)
    return data


def check_batch(batch: PyTree, what: str = "train") -> None:
    """Raise a DataError if a batch has no arrays, or object/string leaves."""
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise DataError(f"a {what} batch is empty (no array leaves): {type(batch).__name__}.")
    for path, leaf in leaves:
        if isinstance(leaf, (str, bytes)):
            raise DataError(
                f"{what} batch leaf {jax.tree_util.keystr(path) or '<root>'} is a string; "
                "tokenize/encode it to numbers before it reaches the step."
            )
        if not (is_array(leaf) or isinstance(leaf, (int, float, bool, complex))):
            raise DataError(
                f"{what} batch leaf {jax.tree_util.keystr(path) or '<root>'} is a "
                f"{type(leaf).__name__}, not an array; convert it with np.asarray."
            )
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and dtype.kind in "OUS":
            raise DataError(
                f"{what} batch leaf {jax.tree_util.keystr(path) or '<root>'} has dtype {dtype} "
                "(object/string); convert it to a numeric array (ragged rows must be padded)."
            )


def _lookup(batch: PyTree, keys: tuple[str, ...], index: int | None, what: str, field: str) -> Any:
    if isinstance(batch, Mapping):
        for k in keys:
            if k in batch:
                return batch[k]
        raise DataError(
            f"cannot find the {what} in a batch with keys {sorted(map(str, batch))}: "
            f"looked for {list(keys)}. Pass Experiment({field}=lambda batch: batch[...])."
        )
    if isinstance(batch, (tuple, list)) and index is not None and len(batch) > index:
        return batch[index]
    for k in keys:
        if hasattr(batch, k):
            return getattr(batch, k)
    raise DataError(
        f"cannot find the {what} in a batch of type {type(batch).__name__}: expected a dict with "
        f"one of {list(keys)} or an (x, y) tuple. Pass Experiment({field}=lambda batch: ...)."
    )


def get_inputs(exp: Experiment, batch: PyTree) -> Any:
    return exp.inputs(batch) if exp.inputs else _lookup(batch, _INPUT_KEYS, 0, "inputs", "inputs")


def get_labels(exp: Experiment, batch: PyTree) -> Any:
    return exp.labels(batch) if exp.labels else _lookup(batch, _LABEL_KEYS, 1, "labels", "labels")


def get_mask(exp: Experiment, batch: PyTree) -> Any | None:
    """The padding mask, or None when the batch has none. Not an error when missing."""
    if exp.mask:
        return exp.mask(batch)
    if isinstance(batch, Mapping):
        for k in _MASK_KEYS:
            if k in batch:
                return batch[k]
    return None


def batch_size(batch: PyTree) -> int:
    leaves = [x for x in jax.tree_util.tree_leaves(batch) if getattr(x, "ndim", 0) >= 1]
    if not leaves:
        raise DataError("the batch has no array with a leading batch axis.")
    return int(leaves[0].shape[0])


def slice_batch(batch: PyTree, n: int, size: int | None = None) -> PyTree:
    """The first ``n`` examples of every leaf that has a leading batch axis (of ``size``, default the
    first leaf's). Arrays sharded over Explicit mesh axes are sliced on the host (their on-device slice
    has no unambiguous sharding). Not jit-safe."""
    size = batch_size(batch) if size is None else size

    def head(x):
        if getattr(x, "ndim", 0) < 1 or x.shape[0] != size:
            return x
        if explicit_sharding(x) is not None and x.is_fully_addressable:
            return np.asarray(x)[:n]
        return x[:n]

    return jax.tree_util.tree_map(head, batch)


def leading_sizes(tree: PyTree) -> list[int]:
    """The distinct leading-axis sizes of ``tree``'s array leaves (ndim >= 1), in leaf order."""
    sizes: list[int] = []
    for x in jax.tree_util.tree_leaves(tree):
        if getattr(x, "ndim", 0) >= 1 and int(x.shape[0]) not in sizes:
            sizes.append(int(x.shape[0]))
    return sizes


def axis_text(tree: PyTree) -> str:
    shapes = [
        f"{jax.tree_util.keystr(p) or '<root>'} {tuple(x.shape)}"
        for p, x in jax.tree_util.tree_leaves_with_path(tree)
        if getattr(x, "ndim", 0) >= 1
    ]
    return ", ".join(shapes[:6]) + (", ..." if len(shapes) > 6 else "")


def example_view(exp: Experiment, batch: PyTree) -> PyTree:
    """The parts of ``batch`` that are per example: its inputs, labels and mask where they can be found,
    else the whole batch (a per-batch table beside them, e.g. class weights ``[C]``, is not one)."""
    parts = []
    for get in (get_inputs, get_labels, get_mask):
        try:
            part = get(exp, batch)
        except Exception:  # a handle that cannot read this batch: the other parts (or the whole batch) decide
            continue
        if part is not None:
            parts.append(part)
    return parts if parts else batch


def rows_not_examples(exp: Experiment, batch: PyTree) -> str | None:
    """Why the rows of ``batch`` are not its examples, or None when they are: the per-example parts
    (:func:`example_view`) disagree on their leading axis, or integer arrays beside them have another leading
    size (the senders and receivers of a full-batch graph whose node features and labels are the rows, segment
    ids): index arrays that point into the rows, which taking some rows would leave pointing at rows that are
    gone. A float table beside the examples (class weights ``[C]``) is no such array. Not jit-safe."""
    view = example_view(exp, batch)
    sizes = leading_sizes(view)
    if len(sizes) > 1:
        return f"the batch's leaves disagree on the leading axis ({axis_text(view)})"
    in_view = {id(x) for x in jax.tree_util.tree_leaves(view)}
    index = [
        f"{jax.tree_util.keystr(p) or '<root>'} {tuple(x.shape)}"
        for p, x in jax.tree_util.tree_leaves_with_path(batch)
        if id(x) not in in_view
        and getattr(x, "ndim", 0) >= 1
        and sizes
        and int(x.shape[0]) != sizes[0]
        and np.issubdtype(np.dtype(x.dtype), np.integer)
    ]
    if index:
        return (
            f"integer arrays beside its {sizes[0]} rows have other leading sizes ({', '.join(index[:4])}): index "
            "arrays into the rows (a graph's senders and receivers, segment ids)"
        )
    return None


def sliceable(exp: Experiment, batch: PyTree) -> str | None:
    """None when :func:`slice_examples` can take examples from ``batch``, else the reason why not."""
    if exp.examples is not None:
        return (
            None
            if _positional_arity(exp.examples) != 1
            else ("Experiment.examples counts examples but does not say how to take some of them")
        )
    why = rows_not_examples(exp, batch)
    if why is not None:
        return (
            f"{why}, so it is not one example per row (a graph batch, packed sequences); pass "
            "Experiment(examples=lambda batch, n: ...) returning the first n examples to let this stage cut it"
        )
    return None


def count_examples(exp: Experiment, batch: PyTree) -> int:
    """How many examples ``batch`` holds: ``Experiment.examples(batch)`` when it counts them; when the leaves
    disagree on their leading axis, the examples that ``Experiment.examples(batch, n)`` can cut
    (:func:`examples_by_cutting`: a node-classification graph batch's labels are per node), else the labels'
    leading axis (a graph batch's graph labels); else the leading axis. Not jit-safe."""
    if exp.examples is not None and _positional_arity(exp.examples) == 1:
        return int(exp.examples(batch))
    sizes = leading_sizes(example_view(exp, batch))
    if len(sizes) > 1 and exp.examples is not None:
        cut = examples_by_cutting(exp.examples, batch)
        if cut is not None:
            return cut
    if len(sizes) > 1:
        try:
            labels = get_labels(exp, batch)
        except Exception:
            labels = None
        if getattr(labels, "ndim", 0) >= 1:
            return int(labels.shape[0])
    return sizes[0] if sizes else batch_size(batch)


def slice_examples(exp: Experiment, batch: PyTree, n: int, *, whole: bool = False) -> PyTree:
    """The first ``n`` examples of ``batch`` as the Experiment defines them. Not jit-safe.

    Uses ``Experiment.examples(batch, n)`` when given; otherwise the leading axis, but only when
    every leaf agrees on it. ``whole=True`` returns the whole batch where it cannot be cut (a
    function that is correct on any number of examples, e.g. the gradient check); otherwise
    raises :class:`~jaxsane.ExampleAxisError` with the reason.
    """
    reason = sliceable(exp, batch)
    if reason is not None:
        if whole:
            return batch
        raise ExampleAxisError(f"[jaxsane] cannot take {n} examples from the batch: {reason}.")
    if exp.examples is not None:
        return exp.examples(batch, n)
    sizes = leading_sizes(example_view(exp, batch))
    return slice_batch(batch, n, size=sizes[0] if sizes else None)


def whole_shards(batch: PyTree, n: int) -> int:
    """``n`` rounded up to a multiple of the shards a leaf of ``batch`` splits its example axis into (a batch
    ``jax.device_put`` with ``NamedSharding(mesh, P("data"))``), so that a step jitted with those in_shardings
    runs on the cut: 8 on 8 devices for 4 examples. ``n`` when nothing is split on that axis. Not jit-safe."""
    shards = 1
    for x in jax.tree_util.tree_leaves(batch):
        if isinstance(x, jax.Array) and x.ndim and not x.sharding.is_fully_replicated:
            rows = x.sharding.shard_shape(x.shape)[0]
            if 0 < rows < x.shape[0] and x.shape[0] % rows == 0:
                shards = max(shards, x.shape[0] // rows)
    return -(-n // shards) * shards


def _shapes(tree: PyTree) -> tuple:
    return tuple(tuple(getattr(x, "shape", ())) for x in jax.tree_util.tree_leaves(tree))


def examples_by_cutting(take: Any, batch: PyTree) -> int | None:
    """How many examples ``take(batch, n)`` (``Experiment.examples``: the first ``n`` examples) finds in
    ``batch``: the fewest ``n`` whose cut has the shapes of a cut past the end (a bisection over ``n`` up to the
    longest leading axis; the cuts are the user's host slicing, nothing is compiled). None when a cut fails or
    the cuts never reach the batch's shapes. Not jit-safe."""
    upper = max(leading_sizes(batch), default=0)
    if upper < 1:
        return None
    try:
        whole = _shapes(take(batch, upper))
        low, high = 1, upper  # the answer lies in [low, high]
        while low < high:
            mid = (low + high) // 2
            if _shapes(take(batch, mid)) == whole:
                high = mid
            else:
                low = mid + 1
    except Exception:  # noqa: BLE001 - a cut that fails: the caller counts another way
        return None
    return low
