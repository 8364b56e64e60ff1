"""The user's side of the contract: :class:`Experiment`, and adapters that turn every
supported step style into one pure function ``(state, batch) -> (state, metrics)``.

Supported step styles (all unchanged):
  * pure optax: ``state = (params, opt_state)``, ``step(state, batch) -> (state, {"loss": l})``;
  * Flax linen ``TrainState``: ``step(state, batch) -> (state, metrics)``;
  * Flax NNX in place: ``state = (model, optimizer)``, an ``nnx.jit`` step
    ``step(model, optimizer, batch) -> loss | metrics | None`` that mutates them
    (``step(state, batch)`` with the tuple also works);
  * a step that returns only the new state, and (NNX) a step that returns only the loss;
  * Equinox: a state holding ``eqx.Module`` models (activation functions and other non-array leaves
    included) and an ``eqx.filter_jit`` step; the tools see the state's array part (``_adapter.partition``);
  * a tuple state spread over the step's arguments: ``step(model, opt_state, batch) ->
    (model, opt_state, loss | metrics)`` (Equinox's own examples), for any tuple state of 2+ items.

Reading the data an Experiment names (batches, their inputs/labels/mask, examples) is
``_experiment/batches.py``.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np

from .._core.errors import ArgumentError, ExperimentError
from .._core.tree import PyTree, is_array, same_structure
from .._core.user_code import USER_CODE
from .._core.validate import show
from .._jaxpr.compile_level import Jitted, quick_jit
from .._jaxpr.trace_cache import TracedOnce
from .donation import SparingDonation
from .purify import (
    call_split,
    combine,
    has_kept,
    is_nnx_state as is_nnx_state,
    keep_static,
    kept_erased,
    needs_partition,
    nnx_module as _nnx,
    partition,
    positional_arity as _positional_arity,
    restore_static,
    split_whole,
    uncounted,
)
from .step_signature import BINDING, check_step_signature, signature_message


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
      params: ``state -> params`` (default: ``state.params``, ``state["params"]``, ``state[0]``, or
        ``state[0].params`` for a ``(TrainState, rng)`` tuple; in doctor the whole state if the loss takes only it).
      inputs, labels, mask: ``batch -> array``; defaults look for common keys
        (``"x"``/``"y"``, ``"image"``/``"label"``, ``"mask"``) or an ``(x, y)`` tuple.
      num_classes: number of classes, for label-range and init-loss checks.
      name: shown in reports.
      causal: the model is causal (an autoregressive LM): ``apply``'s output at position t must not
        depend on inputs after t, checked in the batch stage (``seq.future_leakage``). None: checked on the inputs
        the targets are one position ahead of (teacher forcing); False: the model may see the whole sequence.
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
    causal: bool | None = None
    examples: Callable | None = None

    def __post_init__(self):
        for field in ("init", "step"):
            value = getattr(self, field)
            if not callable(value):
                raise ExperimentError(
                    f"Experiment.{field} must be callable, got {show(value)}. Likely cause: "
                    + (
                        "the state itself (init(key)) was passed instead of the function. Fix: pass "
                        "init=lambda key: state (a fresh train state from a PRNG key)."
                        if field == "init"
                        else "the step's result was passed instead of the function. Fix: pass "
                        "step=train_step, a function (state, batch) -> (state, metrics)."
                    )
                )
        if self.examples is not None and (
            not callable(self.examples) or _positional_arity(self.examples) not in (1, 2, None)
        ):
            raise ExperimentError(
                f"Experiment.examples must be a function (batch, n) -> the batch's first n examples, or "
                f"batch -> the number of examples in it; got {show(self.examples)}. Fix: pass e.g. "
                "examples=lambda batch, n: take_first_graphs(batch, n), or leave it out for batches whose "
                "leading axis is the example axis."
            )
        for field in ("loss", "apply", "params", "inputs", "labels", "mask"):
            value = getattr(self, field)
            if value is not None and not callable(value):
                hint = (
                    f" (for a dict key use {field}=lambda batch: batch[{value!r}])"
                    if isinstance(value, str) and field in ("inputs", "labels", "mask")
                    else ""
                )
                raise ExperimentError(
                    f"Experiment.{field} must be a callable or None, got {show(value)}. Likely cause: a value "
                    f"was passed where the function that computes it is needed. Fix: pass {field}=<a function>"
                    f"{hint}, or leave it out."
                )
        for field in ("train", "eval"):
            value = getattr(self, field)
            if value is None and field == "train":
                raise ExperimentError(
                    "Experiment.train is required: one batch, an iterable of batches, or a callable returning a batch."
                )
            scalar = isinstance(value, (str, bytes, numbers.Number, np.generic)) or getattr(value, "shape", None) == ()
            if value is not None and (scalar or not _data_like(value)):
                raise ExperimentError(
                    f"Experiment.{field} must be data (a batch, an iterable of batches or a callable returning "
                    f"one), got {show(value)}. Likely cause: "
                    + (
                        "a path or a size was passed instead of the data"
                        if isinstance(value, (str, bytes, numbers.Number)) and not isinstance(value, np.generic)
                        else "a scalar, which has no batch axis"
                        if scalar
                        else "an object that is neither a batch, an iterable of batches nor a callable"
                    )
                    + f". Fix: load the data first and pass {field}=the batches."
                )
        nc = self.num_classes
        if nc is not None and (not isinstance(nc, numbers.Integral) or isinstance(nc, bool) or nc < 2):
            raise ExperimentError(
                f"Experiment.num_classes must be an int >= 2 or None, got {show(nc)}. Likely cause: "
                + (
                    "a string from a config file was not converted"
                    if isinstance(nc, str)
                    else "a float or a count of outputs other than classes"
                    if not isinstance(nc, numbers.Integral)
                    else "a regression or binary-logit model (one output) given num_classes"
                )
                + ". Fix: pass num_classes=C (the number of class ids, labels in [0, C)), or None to skip the "
                "label-range and init-loss checks."
            )
        if self.causal is not None and not isinstance(self.causal, bool):
            raise ExperimentError(
                f"Experiment.causal must be True, False or None, got {show(self.causal)}. Fix: pass True for an "
                "autoregressive model (output at t sees inputs <= t only), False for one that sees it all, or None."
            )
        if not isinstance(self.name, str):
            raise ExperimentError(
                f"Experiment.name must be a str, got {show(self.name)}. Fix: pass "
                f"name=str(...) (it is shown in reports)."
            )


def _data_like(value: Any) -> bool:
    """Whether ``value`` can be data: a batch (an array, a mapping, a pytree), an iterable or a callable."""
    if callable(value) or isinstance(value, (Mapping, Iterable)) or hasattr(value, "shape"):
        return True
    try:  # a registered pytree node (a dataclass batch) that holds arrays
        leaves = jax.tree_util.tree_leaves(value)
    except Exception:  # a node whose flatten fails is no batch either
        return False
    return bool(leaves) and leaves != [value]


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


def _key_fingerprint(key: Any) -> tuple | None:
    """A hashable stand-in for a concrete PRNG key (typed or raw uint32), or None (a tracer, or not a key)."""
    if isinstance(key, jax.core.Tracer) or not hasattr(key, "dtype"):
        return None
    try:
        typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
        data = np.asarray(jax.random.key_data(key) if typed else key)
    except (TypeError, ValueError):
        return None
    return (str(jax.random.key_impl(key)) if typed else None, data.dtype.str, data.shape, data.tobytes())


def _fresh_tree(tree: PyTree) -> PyTree:
    """The same leaves in new containers (for NNX, new Variables). Jit-safe."""
    return jax.tree_util.tree_map(lambda x: x, tree)


def _any_deleted(tree: PyTree) -> bool:
    return any(x.is_deleted() for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array))


class PureExperiment:
    """An Experiment seen through one pure interface, whatever its step style (public as
    ``jaxsane.PureExperiment``; every tool that takes an Experiment also takes this view of one).

    * ``state = adapted.init(key)`` — the pure state (for NNX, an ``nnx.State`` pytree; with
      ``PureExperiment(exp, reuse_init=True)`` the user's init runs once per key);
    * ``state, metrics = adapted.step(state, batch)`` — pure and jit-safe; ``metrics`` is a dict;
    * ``adapted.params(state)`` — the trainable parameters;
    * ``adapted.user_state(state)`` — back to the user's own objects (NNX: ``nnx.merge``);
    * ``adapted.loss_fn`` / ``adapted.apply_fn`` — ``(params, batch)`` / ``(params, inputs)``
      on pure params, or None when the Experiment has no such handle.
    """

    def __init__(self, experiment: Experiment, *, key: jax.Array | None = None, reuse_init: bool = False):
        self.experiment = exp = experiment
        self._state_is_params = False  # settle_params: a tuple or list state that is itself the parameters
        key = jax.random.key(0) if key is None else key
        try:
            with USER_CODE:
                example = exp.init(key)
        except TypeError as e:
            raise ExperimentError(
                f"Experiment.init(key) failed: {e}. init must take one PRNG key "
                "(jax.random.key) and return a fresh train state."
            ) from e
        if example is None:
            raise ExperimentError("Experiment.init(key) returned None; it must return the train state.")
        self.nnx = is_nnx_state(example)
        if self.nnx:
            nnx = _nnx()
            model = self._model_of(example)
            self._model_def, _, self._model_rest = nnx.split(model, nnx.Param, ...)
            arity = _positional_arity(exp.step)
            self._unpack = isinstance(example, (tuple, list)) and arity is not None and arity == len(example) + 1
            # step(model, optimizer, batch) spreads the objects over the arguments; step(objs, batch) packs them
            self._layout, _ = split_whole(
                example, tuple(range(len(example))) if self._unpack else (0,), packed=not self._unpack
            )
            self._graphdef = self._layout.graphdef
        self._static = self._params_static = None
        self._spread = False
        if not self.nnx:
            # Equinox models hold non-array leaves (activations): the tools see the array part, the step gets
            # the whole state back (_adapter.partition / combine: the one purifier of such trees)
            if needs_partition(example):
                self._static = partition(example)[1]
                self._params_static = partition(self._params_of(example))[1]
            else:
                self._check_leaves(example)
            self._spread = (
                isinstance(example, (tuple, list))
                and len(example) >= 2
                and _positional_arity(exp.step, required=True) == len(example) + 1
            )
        check_step_signature(exp.step, example, self._unpack if self.nnx else self._spread)
        self._example = example
        self._style: str | None = None
        # reuse_init (doctor: its stages ask for the same state often): the last init(key), as (key fingerprint,
        # detached pure state). Off by default: a training loop would keep its initial state alive to the end.
        self._reuse_init = reuse_init
        self._last_init: tuple[Any, PyTree] | None = None
        self._remember_init(key, example)

    # -- conversions
    def to_pure(self, user_state: Any) -> PyTree:
        if self.nnx:
            return _nnx().state(user_state)
        if self._static is not None:  # the non-array fields ride in the state (Kept), as the user's step made them
            return keep_static(user_state)
        return user_state

    def user_state(self, state: PyTree) -> Any:
        """The user's own state object (NNX: ``nnx.merge``; an Equinox state's non-array leaves put back)."""
        if self.nnx:
            return _nnx().merge(self._graphdef, state)
        if self._static is not None:
            return restore_static(state) if has_kept(state) else combine(state, self._static)
        return state

    def init(self, key: jax.Array) -> PyTree:
        """Pure state from a PRNG key. Not jit-safe for NNX (builds objects).

        With ``reuse_init=True`` the user's init runs once for a run of calls with the same key: each call gets
        a new tree (new NNX Variables) over the same immutable arrays, so no caller sees another's in-place
        changes; the user's init runs again once a donating step has deleted those arrays."""
        if not self._reuse_init:
            with USER_CODE:
                return self.to_pure(self.experiment.init(key))
        last = self._last_init
        if last is not None and last[0] == _key_fingerprint(key) and not _any_deleted(last[1]):
            return _fresh_tree(last[1])
        with USER_CODE:
            return self._remember_init(key, self.experiment.init(key))

    def _remember_init(self, key: jax.Array, user_state: Any) -> PyTree:
        """``user_state`` as a pure state, kept (detached from the user's objects) when ``reuse_init``."""
        state = self.to_pure(user_state)
        fingerprint = _key_fingerprint(key) if self._reuse_init else None
        if fingerprint is not None:
            self._last_init = (fingerprint, _fresh_tree(state))
        return state

    @property
    def example_state(self) -> PyTree:
        return self.to_pure(self._example)

    @staticmethod
    def _check_leaves(state: PyTree) -> None:
        bad = [
            (p, leaf)
            for p, leaf in jax.tree_util.tree_leaves_with_path(state)
            if not (is_array(leaf) or isinstance(leaf, (int, float, bool)))
        ]
        if bad:
            path, leaf = bad[0]
            raise ExperimentError(
                f"the train state has a non-array leaf at state{jax.tree_util.keystr(path)} "
                f"({type(leaf).__name__}); steps need arrays there. Mark it static "
                "(flax.struct.field(pytree_node=False)) or convert it with jnp.asarray."
            )

    # -- the step
    def _call_user_step(self, state: PyTree, batch: PyTree) -> tuple[PyTree, Any]:
        with USER_CODE:  # never two traces of the user's step at once (_core/user_code.py)
            return self._call_user_step_unlocked(state, batch)

    def _call_user_step_unlocked(self, state: PyTree, batch: PyTree) -> tuple[PyTree, Any]:
        exp = self.experiment
        if self.nnx:
            args = (None,) * (len(self._layout.positions) if self._unpack else 1) + (batch,)
            out, new_state = call_split(exp.step, self._layout, state, args)
            return new_state, out
        user, step = self.user_state(state), uncounted(exp.step)
        try:
            out = step(*user, batch) if self._spread else step(user, batch)
        except TypeError as e:  # a signature inspect could not read: the call's own binding failed
            if e.__traceback__ is not None and e.__traceback__.tb_next is None and BINDING.search(str(e)):
                raise ExperimentError(signature_message(exp.step, self._spread, user, str(e))) from e
            raise
        if self._spread and isinstance(out, (tuple, list)) and not same_structure(out, user):
            n = len(user)  # (model, opt_state, loss) -> ((model, opt_state), loss)
            if len(out) == n + 1 and same_structure(type(user)(out[:n]), user):
                out = (type(user)(out[:n]), out[n])
        return None, keep_static(out) if needs_partition(out) else out

    def step(self, state: PyTree, batch: PyTree) -> tuple[PyTree, dict[str, Any]]:
        """Run the user's step once, purely. Jit-safe: inside a trace (jit, vmap, grad, make_jaxpr) the step is
        traced once per input signature and its jaxpr replayed after that (``_jaxpr/trace_cache.py``: the
        checks trace the step at the same shapes again and again, and an NNX or Flax step costs far more to
        trace than to replay); called eagerly it runs the user's step itself."""
        shared = lambda: self._last_init[1] if self._last_init is not None else None  # noqa: E731 (donation.py)
        return self.memo("traced:step", lambda: SparingDonation(TracedOnce(self._pure_step), shared))(state, batch)

    def _pure_step(self, state: PyTree, batch: PyTree) -> tuple[PyTree, dict[str, Any]]:
        new_state, out = self._call_user_step(state, batch)
        if self.nnx:
            if isinstance(out, tuple) and len(out) == 2 and is_nnx_state(out[0]):
                out = out[1]
            return new_state, _as_metrics(out)
        style = self._style or self.detect_style(state, batch)
        if style == "state_metrics":  # an Equinox step's non-array metrics are not values (None, as before)
            return out[0], _as_metrics(kept_erased(out[1]) if self._static is not None else out[1])
        return out, {}

    def detect_style(self, state: PyTree, batch: PyTree) -> str:
        """``"state_metrics"`` or ``"state"``, found by tracing the step once (no FLOPs run)."""
        if self._style is not None:
            return self._style
        try:
            out = jax.eval_shape(lambda s, b: self._call_user_step(s, b)[1], state, batch)
        except Exception as e:  # the user's step failed to trace: show the real error, with context
            raise ExperimentError(f"calling the step on the first batch failed: {type(e).__name__}: {e}") from e
        bare = kept_erased(state)  # a step may change a non-array field's value (a Python-int counter)
        if isinstance(out, (tuple, list)) and len(out) == 2 and same_structure(kept_erased(out[0]), bare):
            self._style = "state_metrics"
        elif same_structure(kept_erased(out), bare):
            self._style = "state"
        else:
            shown = jax.tree_util.tree_structure(out)
            raise ExperimentError(
                "the step's output does not match the state's structure: expected (new_state, metrics) or "
                f"new_state with the structure {jax.tree_util.tree_structure(state)}, got {shown}. "
                "Return the updated state (same pytree as init's) and optionally a metrics dict (a step "
                "step(model, opt_state, batch) over a tuple state may return (model, opt_state, loss)); "
                "a step that returns only the loss is supported for NNX objects updated in place."
            )
        return self._style

    # -- params / loss / apply on pure params
    def params(self, state: PyTree) -> PyTree:
        """The trainable parameters of a pure state. Jit-safe."""
        if self.nnx:
            nnx = _nnx()
            return nnx.state(self._model_of(nnx.merge(self._graphdef, state)), nnx.Param)
        return self._params_of(state)

    def _params_of(self, state: PyTree) -> PyTree:
        """The parameters of a state by the Experiment's rule (pure, or the user's own Equinox state)."""
        exp = self.experiment
        if exp.params is not None:
            return exp.params(state)
        if hasattr(state, "params"):
            return state.params
        if isinstance(state, Mapping) and "params" in state:
            return state["params"]
        if self._state_is_params:
            return state
        if isinstance(state, (tuple, list)) and state:
            first = state[0]  # (params, opt_state, ...), or (TrainState, rng): that state's own parameters
            return first.params if hasattr(first, "params") and not isinstance(first, Mapping) else first
        raise ExperimentError("cannot find the parameters in the state: pass Experiment(params=lambda state: ...).")

    def settle_params(self, batch: Any) -> None:
        """Decide, from the loss, whether a tuple or list state is itself the parameters (a hand-written SGD's
        ``[(W, b), ...]`` reads as ``(params, opt_state)`` by default): when ``loss(state[0], batch)`` cannot be
        traced and ``loss(state, batch)`` can (abstractly, nothing runs), they are the whole state. Not jit-safe."""
        exp, state, loss = self.experiment, self._example, self.experiment.loss
        if loss is None or self.nnx or exp.params is not None or self._static is not None:
            return
        if isinstance(state, (tuple, list)) and state and not hasattr(state[0], "params"):
            self._state_is_params = _traces(loss, state[0], batch) is None and _traces(loss, state, batch) is not None

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
        return self._on_pure_params("loss", self.experiment.loss, training=True)

    @property
    def apply_fn(self) -> Callable | None:
        """``(params, inputs) -> outputs`` on pure params, or None. Jit-safe (same object on every access)."""
        return self._on_pure_params("apply", self.experiment.apply, training=False)

    def _on_pure_params(self, name: str, fn: Callable | None, training: bool) -> Callable | None:
        """``fn(model_or_params, x)`` as ``(pure params, x) -> ...``, traced once per input signature, one
        object per ``name``; None when ``fn`` is None. Jit-safe to call."""
        if fn is None:
            return None

        def make() -> TracedOnce:
            if self.nnx:
                return TracedOnce(lambda params, x: fn(self._model_with(params, training=training), x))
            static = self._params_static  # set once, in __init__
            if static is not None:
                return TracedOnce(
                    lambda params, x: fn(restore_static(params) if has_kept(params) else combine(params, static), x)
                )
            return TracedOnce(fn)

        return self.memo(name, make)

    def memo(self, name: str, make: Callable[[], Any]) -> Any:
        """One ``make()`` per ``name`` for this PureExperiment: the checks' shared functions (so jit and
        ``TracedOnce`` (``_jaxpr/trace_cache.py``) caches see one object). Not jit-safe to build."""
        memo = self.__dict__.setdefault("_memo_table", {})
        if name not in memo:
            memo[name] = make()
        return memo[name]

    def memoized(self, name: str) -> Any:
        """What :meth:`memo` made for ``name``, or None when nothing has made it yet. Not jit-safe."""
        return self.__dict__.get("_memo_table", {}).get(name)

    def host_step(self) -> Callable[[PyTree, PyTree], tuple[PyTree, dict[str, Any]]]:
        """The pure step as called from the host: :meth:`step` when the user's step is jitted (its compiled program
        is the user's own, compiled once for every check that calls it), else one shared ``jax.jit`` of it. Not
        jit-safe to build; the step it returns may donate its inputs as the user's does."""
        called = self.experiment.step if self.nnx else uncounted(self.experiment.step)
        if hasattr(called, "lower"):
            return self.step
        step = self.jitted("step")
        assert step is not None, "a PureExperiment always has a step"
        return step

    def jitted(self, name: str) -> Jitted | None:
        """One cached ``jax.jit`` of ``"loss"``, ``"apply"`` or ``"step"`` (:attr:`loss_fn`,
        :attr:`apply_fn`, :meth:`step`), shared by every check of this PureExperiment so that no check
        compiles what another already compiled (one program per input shape); None when the
        Experiment has no such handle. Call it outside jit (it is already jitted); not jit-safe."""
        fns = {"loss": lambda: self.loss_fn, "apply": lambda: self.apply_fn, "step": lambda: self.step}
        if name not in fns:
            raise ArgumentError(
                f"[jaxsane] PureExperiment.jitted: unknown function {name!r}; choose one of {sorted(fns)}."
            )
        fn = fns[name]()
        if fn is None:
            return None
        # loss and apply are jaxsane's analysis calls, a few per stage: compiled for a quick compile where
        # that pays (_compile_level); the step is the user's program and compiles as jax.jit does
        return self.memo("jit:" + name, lambda: jax.jit(fn) if name == "step" else quick_jit(fn, runs=8))

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
            raise ExperimentError(
                "cannot map the parameters back into the state: pass Experiment(params=...) "
                "returning a sub-tree of the state."
            )
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
        modules = nnx.iter_modules(model) if hasattr(nnx, "iter_modules") else model.iter_modules()
        for _, module in modules:  # (the method is deprecated in newer flax)
            for flag in MODE_FLAGS:
                if flag in vars(module) and getattr(module, flag) is None:
                    object.__setattr__(module, flag, not training)
    return model


def require_experiment(fn: str, value: Any, name: str = "experiment") -> None:
    """Raise ExperimentError unless ``value`` is an :class:`Experiment` (or its PureExperiment). Not jit-safe."""
    if not isinstance(value, (Experiment, PureExperiment)):
        cause = (
            "a step function was passed where its Experiment is needed"
            if callable(value)
            else "the arguments are in the wrong order, or a train state was passed"
        )
        raise ExperimentError(
            f"{fn}({name}=...): expected a jaxsane.Experiment, got {show(value)}. Likely cause: {cause}. "
            f"Fix: pass jaxsane.Experiment(init=..., step=..., train=...)."
        )


def _traces(fn: Callable, *args: Any) -> Any:
    """``jax.eval_shape(fn, *args)``, or None when it cannot be traced on them. Not jit-safe."""
    try:
        return jax.eval_shape(fn, *args)
    except Exception:  # noqa: BLE001 - any failure: it does not take these arguments
        return None
