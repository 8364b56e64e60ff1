"""The user's side of the contract: :class:`Experiment`, and adapters that turn every
supported step style into one pure function ``(state, batch) -> (state, metrics)``.

Supported step styles (all unchanged):
  * pure optax: ``state = (params, opt_state)``, ``step(state, batch) -> (state, {"loss": l})``;
  * Flax linen ``TrainState``: ``step(state, batch) -> (state, metrics)``;
  * Flax NNX in place: ``state = (model, optimizer)``, an ``nnx.jit`` step
    ``step(model, optimizer, batch) -> loss | metrics | None`` that mutates them
    (``step(state, batch)`` with the tuple also works);
  * a step that returns only the new state, and (NNX) a step that returns only the loss.
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
from collections.abc import Iterable, Mapping
from typing import Any, Callable

import jax
import numpy as np

from ._adapter import (call_split, is_nnx_state as is_nnx_state, nnx_module as _nnx,
                       positional_arity as _positional_arity, split_whole)
from ._errors import DataError, ExampleAxisError, ExperimentError
from ._tree import PyTree, explicit_sharding, is_array, is_inexact, same_structure
from ._validate import show

_INPUT_KEYS = ("x", "image", "images", "inputs", "input", "features", "tokens", "input_ids", "data")
_LABEL_KEYS = ("y", "label", "labels", "targets", "target")
_MASK_KEYS = ("mask", "attention_mask", "padding_mask", "weights")
INPUT_KEYS, LABEL_KEYS, MASK_KEYS = _INPUT_KEYS, _LABEL_KEYS, _MASK_KEYS  # the batch keys the data checks read too


@dataclasses.dataclass(frozen=True)
class Experiment:
    """Handles on a training program; only ``init``, ``step`` and ``train`` are required.

    Args:
      init: ``key -> state``, a fresh train state from a PRNG key.
      step: ``(state, batch) -> (state, metrics) | state`` (may be jitted); for NNX,
        ``(model, optimizer, batch) -> loss | metrics | None`` mutating in place.
      train: one batch, an iterable of batches, or a zero-argument callable returning a batch or a
        fresh iterable of batches (a generator function: each call starts a new pass).
      eval: the same, for held-out data.
      loss: ``(params, batch) -> scalar`` mean loss (NNX: ``(model, batch)``).
      apply: ``(params, inputs) -> outputs`` in eval mode (NNX: ``(model, inputs)``).
      params: ``state -> params`` (default: ``state.params``, ``state["params"]``, ``state[0]``).
      inputs, labels, mask: ``batch -> array``; defaults look for common keys
        (``"x"``/``"y"``, ``"image"``/``"label"``, ``"mask"``) or an ``(x, y)`` tuple.
      num_classes: number of classes, for label-range and init-loss checks.
      name: shown in reports.
      causal: the model is causal (an autoregressive LM): ``apply``'s output at position t must not
        depend on inputs after t; the batch stage then checks it (``seq.future_leakage``).
      examples: what one example is, for batches whose leaves disagree on the leading axis (a graph
        batch: nodes ``[N, F]``, edges ``[E, F]``, labels ``[G]``; packed sequences): either
        ``(batch, n) -> batch`` holding the first ``n`` examples, or ``batch -> int`` counting them
        (then the stages use whole batches). Without it such batches are never sliced: the stages
        that would slice them skip with ``doctor.skipped`` and the reason.
    """

    init: Callable[[jax.Array], PyTree]
    step: Callable[..., Any]
    train: Any
    eval: Any = None
    loss: Callable | None = None
    apply: Callable | None = None
    params: Callable | None = None
    inputs: Callable | None = None
    labels: Callable | None = None
    mask: Callable | None = None
    num_classes: int | None = None
    name: str = "experiment"
    causal: bool = False
    examples: Callable | None = None

    def __post_init__(self):
        for field in ("init", "step"):
            value = getattr(self, field)
            if not callable(value):
                raise ExperimentError(
                    f"Experiment.{field} must be callable, got {show(value)}. Likely cause: "
                    + ("the state itself (init(key)) was passed instead of the function. Fix: pass "
                       "init=lambda key: state (a fresh train state from a PRNG key)."
                       if field == "init" else "the step's result was passed instead of the function. Fix: pass "
                       "step=train_step, a function (state, batch) -> (state, metrics)."))
        if self.examples is not None and (not callable(self.examples)
                                          or _positional_arity(self.examples) not in (1, 2, None)):
            raise ExperimentError(
                f"Experiment.examples must be a function (batch, n) -> the batch's first n examples, or "
                f"batch -> the number of examples in it; got {show(self.examples)}. Fix: pass e.g. "
                "examples=lambda batch, n: take_first_graphs(batch, n), or leave it out for batches whose "
                "leading axis is the example axis.")
        for field in ("loss", "apply", "params", "inputs", "labels", "mask"):
            value = getattr(self, field)
            if value is not None and not callable(value):
                hint = (f" (for a dict key use {field}=lambda batch: batch[{value!r}])"
                        if isinstance(value, str) and field in ("inputs", "labels", "mask") else "")
                raise ExperimentError(
                    f"Experiment.{field} must be a callable or None, got {show(value)}. Likely cause: a value "
                    f"was passed where the function that computes it is needed. Fix: pass {field}=<a function>"
                    f"{hint}, or leave it out.")
        for field in ("train", "eval"):
            value = getattr(self, field)
            if value is None and field == "train":
                raise ExperimentError("Experiment.train is required: one batch, an iterable of batches, "
                                      "or a callable returning a batch.")
            if isinstance(value, (str, bytes, bool, int, float, complex)):
                raise ExperimentError(
                    f"Experiment.{field} must be data (a batch, an iterable of batches or a callable returning "
                    f"one), got {show(value)}. Likely cause: a path or a size was passed instead of the data. "
                    f"Fix: load the data first and pass {field}=the batches.")
        nc = self.num_classes
        if nc is not None and (not isinstance(nc, numbers.Integral) or isinstance(nc, bool) or nc < 2):
            raise ExperimentError(
                f"Experiment.num_classes must be an int >= 2 or None, got {show(nc)}. Likely cause: "
                + ("a string from a config file was not converted" if isinstance(nc, str) else
                   "a float or a count of outputs other than classes" if not isinstance(nc, numbers.Integral) else
                   "a regression or binary-logit model (one output) given num_classes")
                + ". Fix: pass num_classes=C (the number of class ids, labels in [0, C)), or None to skip the "
                "label-range and init-loss checks.")
        if not isinstance(self.causal, bool):
            raise ExperimentError(f"Experiment.causal must be True or False, got {show(self.causal)}. Fix: pass "
                                  "causal=True for an autoregressive model (output at t sees inputs <= t only).")
        if not isinstance(self.name, str):
            raise ExperimentError(f"Experiment.name must be a str, got {show(self.name)}. Fix: pass "
                                  f"name=str(...) (it is shown in reports).")


# ----------------------------------------------------------------------------- data access

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
        raise DataError(f"no {what} data: pass Experiment({what}=...) with a batch, an iterable of batches "
                        "or a callable returning one.")
    if callable(data) and not is_batch(data):
        data = data()  # a batch, or a fresh iterable of batches (a generator function, a loader factory)
    if is_batch(data):
        batch = data
    elif isinstance(data, Iterable) and not isinstance(data, (str, bytes)):
        try:
            batch = next(iter(data))
        except StopIteration:
            raise DataError(f"the {what} data is empty: its iterator yielded no batch. Pass a non-empty "
                            "iterable, or a callable that returns a batch.") from None
    else:
        raise DataError(f"cannot read batches from {what} data of type {type(data).__name__}: pass a batch "
                        "(dict/tuple of arrays), an iterable of batches or a callable returning one.")
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

    def __iter__(self):
        i = 0
        while True:
            if i < len(self._cache):
                yield self._cache[i]
            else:
                try:
                    batch = next(self._source)
                except StopIteration:
                    return
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
            raise DataError(f"{what} batch leaf {jax.tree_util.keystr(path) or '<root>'} is a string; "
                            "tokenize/encode it to numbers before it reaches the step.")
        if not (is_array(leaf) or isinstance(leaf, (int, float, bool, complex))):
            raise DataError(f"{what} batch leaf {jax.tree_util.keystr(path) or '<root>'} is a "
                            f"{type(leaf).__name__}, not an array; convert it with np.asarray.")
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and dtype.kind in "OUS":
            raise DataError(f"{what} batch leaf {jax.tree_util.keystr(path) or '<root>'} has dtype {dtype} "
                            "(object/string); convert it to a numeric array (ragged rows must be padded).")


def _lookup(batch: PyTree, keys: tuple[str, ...], index: int | None, what: str, field: str) -> Any:
    if isinstance(batch, Mapping):
        for k in keys:
            if k in batch:
                return batch[k]
        raise DataError(f"cannot find the {what} in a batch with keys {sorted(map(str, batch))}: "
                        f"looked for {list(keys)}. Pass Experiment({field}=lambda batch: batch[...]).")
    if isinstance(batch, (tuple, list)) and index is not None and len(batch) > index:
        return batch[index]
    for k in keys:
        if hasattr(batch, k):
            return getattr(batch, k)
    raise DataError(f"cannot find the {what} in a batch of type {type(batch).__name__}: expected a dict with "
                    f"one of {list(keys)} or an (x, y) tuple. Pass Experiment({field}=lambda batch: ...).")


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
    shapes = [f"{jax.tree_util.keystr(p) or '<root>'} {tuple(x.shape)}" for p, x in
              jax.tree_util.tree_leaves_with_path(tree) if getattr(x, "ndim", 0) >= 1]
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


def sliceable(exp: Experiment, batch: PyTree) -> str | None:
    """None when :func:`slice_examples` can take examples from ``batch``, else the reason why not."""
    if exp.examples is not None:
        return None if _positional_arity(exp.examples) != 1 else (
            "Experiment.examples counts examples but does not say how to take some of them")
    view = example_view(exp, batch)
    if len(leading_sizes(view)) > 1:
        return (f"the batch's leaves disagree on the leading axis ({axis_text(view)}), so it is not one "
                "example per row (a graph batch, packed sequences); pass Experiment(examples=lambda batch, n: "
                "...) returning the first n examples to let this stage cut it")
    return None


def count_examples(exp: Experiment, batch: PyTree) -> int:
    """How many examples ``batch`` holds: ``Experiment.examples(batch)`` when it counts them, the labels'
    leading axis when the leaves disagree on theirs (a graph batch's graph labels), else the leading
    axis. Not jit-safe."""
    if exp.examples is not None and _positional_arity(exp.examples) == 1:
        return int(exp.examples(batch))
    sizes = leading_sizes(example_view(exp, batch))
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
    raises :class:`~jaxsane._errors.ExampleAxisError` with the reason.
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


# ----------------------------------------------------------------------------- the adapter

def _as_metrics(out: Any) -> dict[str, Any]:
    if out is None:
        return {}
    if isinstance(out, Mapping):
        return dict(out)
    if is_array(out) or isinstance(out, (float, int)) or hasattr(out, "shape"):
        return {"loss": out}
    if isinstance(out, (tuple, list)):
        return {f"out_{i}": v for i, v in enumerate(out)}
    return {"out": out}


class Adapted:
    """An Experiment seen through one pure interface, whatever its step style (public as
    ``jaxsane.PureExperiment``; every tool that takes an Experiment also takes this view of one).

    * ``state = adapted.init(key)`` — the pure state (for NNX, an ``nnx.State`` pytree);
    * ``state, metrics = adapted.step(state, batch)`` — pure and jit-safe; ``metrics`` is a dict;
    * ``adapted.params(state)`` — the trainable parameters;
    * ``adapted.user_state(state)`` — back to the user's own objects (NNX: ``nnx.merge``);
    * ``adapted.loss_fn`` / ``adapted.apply_fn`` — ``(params, batch)`` / ``(params, inputs)``
      on pure params, or None when the Experiment has no such handle.
    """

    def __init__(self, experiment: Experiment, *, key: jax.Array | None = None):
        self.experiment = exp = experiment
        key = jax.random.key(0) if key is None else key
        try:
            example = exp.init(key)
        except TypeError as e:
            raise ExperimentError(f"Experiment.init(key) failed: {e}. init must take one PRNG key "
                                  "(jax.random.key) and return a fresh train state.") from e
        if example is None:
            raise ExperimentError("Experiment.init(key) returned None; it must return the train state.")
        self.nnx = is_nnx_state(example)
        if self.nnx:
            nnx = _nnx()
            model = self._model_of(example)
            self._model_def, _, self._model_rest = nnx.split(model, nnx.Param, ...)
            arity = _positional_arity(exp.step)
            self._unpack = (isinstance(example, (tuple, list)) and arity is not None
                            and arity == len(example) + 1)
            # step(model, optimizer, batch) spreads the objects over the arguments; step(objs, batch) packs them
            self._layout, _ = split_whole(example, tuple(range(len(example))) if self._unpack else (0,),
                                          packed=not self._unpack)
            self._graphdef = self._layout.graphdef
        else:
            self._check_leaves(example)
        self._example = example
        self._style: str | None = None

    # -- conversions
    def to_pure(self, user_state: Any) -> PyTree:
        if self.nnx:
            return _nnx().state(user_state)
        return user_state

    def user_state(self, state: PyTree) -> Any:
        """The user's own state object (NNX objects are rebuilt with ``nnx.merge``)."""
        if self.nnx:
            return _nnx().merge(self._graphdef, state)
        return state

    def init(self, key: jax.Array) -> PyTree:
        """Pure state from a PRNG key. Not jit-safe for NNX (builds objects)."""
        return self.to_pure(self.experiment.init(key))

    @property
    def example_state(self) -> PyTree:
        return self.to_pure(self._example)

    @staticmethod
    def _check_leaves(state: PyTree) -> None:
        bad = [(p, leaf) for p, leaf in jax.tree_util.tree_leaves_with_path(state)
               if not (is_array(leaf) or isinstance(leaf, (int, float, bool)))]
        if bad:
            path, leaf = bad[0]
            raise ExperimentError(
                f"the train state has a non-array leaf at state{jax.tree_util.keystr(path)} "
                f"({type(leaf).__name__}); steps need arrays there. Mark it static "
                "(flax.struct.field(pytree_node=False)) or convert it with jnp.asarray.")

    # -- the step
    def _call_user_step(self, state: PyTree, batch: PyTree) -> tuple[PyTree, Any]:
        exp = self.experiment
        if self.nnx:
            args = (None,) * (len(self._layout.positions) if self._unpack else 1) + (batch,)
            out, new_state = call_split(exp.step, self._layout, state, args)
            return new_state, out
        return None, exp.step(state, batch)

    def step(self, state: PyTree, batch: PyTree) -> tuple[PyTree, dict[str, Any]]:
        """Run the user's step once, purely. Jit-safe."""
        new_state, out = self._call_user_step(state, batch)
        if self.nnx:
            if isinstance(out, tuple) and len(out) == 2 and is_nnx_state(out[0]):
                out = out[1]
            return new_state, _as_metrics(out)
        style = self._style or self.detect_style(state, batch)
        if style == "state_metrics":
            return out[0], _as_metrics(out[1])
        return out, {}

    def detect_style(self, state: PyTree, batch: PyTree) -> str:
        """``"state_metrics"`` or ``"state"``, found by tracing the step once (no FLOPs run)."""
        if self._style is not None:
            return self._style
        try:
            out = jax.eval_shape(lambda s, b: self._call_user_step(s, b)[1], state, batch)
        except Exception as e:  # the user's step failed to trace: show the real error, with context
            raise ExperimentError(f"calling the step on the first batch failed: {type(e).__name__}: {e}") from e
        if isinstance(out, (tuple, list)) and len(out) == 2 and same_structure(out[0], state):
            self._style = "state_metrics"
        elif same_structure(out, state):
            self._style = "state"
        else:
            shown = jax.tree_util.tree_structure(out)
            raise ExperimentError(
                "the step's output does not match the state's structure: expected (new_state, metrics) or "
                f"new_state with the structure {jax.tree_util.tree_structure(state)}, got {shown}. "
                "Return the updated state (same pytree as init's) and optionally a metrics dict; "
                "a step that returns only the loss is supported for NNX objects updated in place.")
        return self._style

    # -- params / loss / apply on pure params
    def params(self, state: PyTree) -> PyTree:
        """The trainable parameters of a pure state. Jit-safe."""
        exp = self.experiment
        if self.nnx:
            nnx = _nnx()
            return nnx.state(self._model_of(nnx.merge(self._graphdef, state)), nnx.Param)
        if exp.params is not None:
            return exp.params(state)
        if hasattr(state, "params"):
            return state.params
        if isinstance(state, Mapping) and "params" in state:
            return state["params"]
        if isinstance(state, (tuple, list)) and state:
            return state[0]
        raise ExperimentError("cannot find the parameters in the state: pass Experiment(params=lambda state: ...).")

    @staticmethod
    def _model_of(objs: Any) -> Any:
        """The NNX model among the state's objects (the first one; an Optimizer's ``.model``)."""
        nnx = _nnx()
        model = objs[0] if isinstance(objs, (tuple, list)) else objs
        return model.model if isinstance(model, nnx.Optimizer) else model

    def _model_with(self, params: PyTree, training: bool = False, rest: PyTree | None = None):
        """A fresh NNX model holding ``params`` (tracers allowed) and the init's other variables,
        in training (``loss``) or eval (``apply``) mode; see :func:`nnx_mode_model`."""
        # copy the non-parameter variables: merge would otherwise share them across traces, and a
        # model that updates them (BatchNorm stats) would mutate a variable of another trace level.
        if rest is None:
            rest = jax.tree_util.tree_map(lambda x: x, self._model_rest)
        return nnx_mode_model(_nnx().merge(self._model_def, params, rest), training)

    @property
    def loss_fn(self) -> Callable | None:
        """``(params, batch) -> scalar`` on pure params, or None. Jit-safe.

        The same function object on every access, so ``jax.jit`` calls of it in different checks
        share one trace and one compiled program per input shape."""
        loss = self.experiment.loss
        if loss is None:
            return None
        if self.nnx:
            return self._memo("loss", lambda: lambda params, batch: loss(self._model_with(params, training=True), batch))
        return loss

    @property
    def apply_fn(self) -> Callable | None:
        """``(params, inputs) -> outputs`` on pure params, or None. Jit-safe (same object on every access)."""
        apply = self.experiment.apply
        if apply is None:
            return None
        if self.nnx:
            return self._memo("apply", lambda: lambda params, inputs: apply(self._model_with(params, training=False),
                                                                            inputs))
        return apply

    def _memo(self, name: str, make: Callable[[], Any]) -> Any:
        memo = self.__dict__.setdefault("_memo_table", {})
        if name not in memo:
            memo[name] = make()
        return memo[name]

    def jitted(self, name: str) -> Callable | None:
        """One cached ``jax.jit`` of ``"loss"``, ``"apply"`` or ``"step"`` (:attr:`loss_fn`,
        :attr:`apply_fn`, :meth:`step`), shared by every check of this Adapted so that no check
        compiles what another already compiled (one program per input shape); None when the
        Experiment has no such handle. Call it outside jit (it is already jitted)."""
        fns = {"loss": lambda: self.loss_fn, "apply": lambda: self.apply_fn, "step": lambda: self.step}
        if name not in fns:
            raise ValueError(f"[jaxsane] Adapted.jitted: unknown function {name!r}; choose one of {sorted(fns)}.")
        fn = fns[name]()
        return None if fn is None else self._memo("jit:" + name, lambda: jax.jit(fn))

    def with_params(self, state: PyTree, params: PyTree) -> PyTree:
        """A pure state whose parameters are replaced by ``params`` (same structure). Jit-safe."""
        if self.nnx:
            nnx = _nnx()
            objs = nnx.merge(self._graphdef, state)
            nnx.update(self._model_of(objs), params)
            return nnx.state(objs)
        old = self.params(state)
        old_leaves, treedef = jax.tree_util.tree_flatten(old)
        new_leaves = jax.tree_util.tree_leaves(params)
        ids = {id(x): i for i, x in enumerate(old_leaves)}
        state_leaves, state_def = jax.tree_util.tree_flatten(state)
        replaced = [new_leaves[ids[id(x)]] if id(x) in ids else x for x in state_leaves]
        if sum(id(x) in ids for x in state_leaves) != len(old_leaves):
            raise ExperimentError("cannot map the parameters back into the state: pass Experiment(params=...) "
                                  "returning a sub-tree of the state.")
        return jax.tree_util.tree_unflatten(state_def, replaced)


MODE_FLAGS = ("deterministic", "use_running_average")  # nnx's own train/eval switches (Dropout, MHA, BatchNorm)


def nnx_mode_model(model: Any, training: bool) -> Any:
    """``model`` (a fresh NNX copy, never the user's own object) with its UNSET mode flags filled in.

    A flag the user left at None (``nnx.MultiHeadAttention(dropout_rate>0)`` before any ``train()`` /
    ``eval()`` call cannot run at all) is set for the handle: training mode for the loss (dropout on,
    BatchNorm on batch statistics), eval mode for apply. A flag the user set, or a layer's own default
    (``nnx.BatchNorm``'s ``use_running_average=False``), is kept: a model whose eval code forgets
    ``model.eval()`` is the user's bug to report (``batch.cross_talk``), not to hide. Not jit-safe to
    call on the user's objects (it mutates static attributes); jaxsane calls it only on merged copies.
    """
    nnx = _nnx()
    if isinstance(model, nnx.Module):
        for _, module in model.iter_modules():
            for flag in MODE_FLAGS:
                if flag in vars(module) and getattr(module, flag) is None:
                    object.__setattr__(module, flag, not training)
    return model


def require_experiment(fn: str, value: Any, name: str = "experiment") -> None:
    """Raise ExperimentError unless ``value`` is an :class:`Experiment` (or its :class:`Adapted`
    view). Not jit-safe."""
    if not isinstance(value, (Experiment, Adapted)):
        cause = ("a step function was passed where its Experiment is needed" if callable(value)
                 else "the arguments are in the wrong order, or a train state was passed")
        raise ExperimentError(
            f"{fn}({name}=...): expected a jaxsane.Experiment, got {show(value)}. Likely cause: {cause}. "
            f"Fix: pass jaxsane.Experiment(init=..., step=..., train=...).")


def float_leaves(tree: PyTree) -> list:
    return [x for x in jax.tree_util.tree_leaves(tree) if is_inexact(x)]


PureExperiment = Adapted  # the public name of the pure view: jaxsane.PureExperiment(experiment)
