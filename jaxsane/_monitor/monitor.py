"""The training monitor: telemetry computed inside the compiled step, and the ``train.*`` detectors.

``Monitor(experiment)`` wraps the pure step of an :class:`~jaxsane.Experiment` (its
:class:`~jaxsane.PureExperiment` view) into
``monitor.step(state, batch, mode) -> (state, metrics)``, one compiled program per ``mode``:

* ``0`` — the bare step (most steps: no extra work at all);
* ``1`` — plus telemetry in ``metrics["telemetry"]``: per-leaf parameter norm, update norm
  ``‖θ_{t+1} − θ_t‖`` and, when the Experiment has ``loss``, per-leaf gradient norms
  (one extra gradient, which XLA partly shares with the step's own) and, for bf16/fp16 parameters, the
  fraction of each leaf's updates lost to rounding (a float32 shadow step, ``_precision/underflow.py``);
* ``2`` — plus the fraction of dead ReLU units per ReLU site, when the Experiment has ``apply``
  (the ReLU-family ``max(x, 0)`` outputs, see :func:`relu_outputs`, are captured by evaluating
  ``apply``'s jaxpr on the batch's inputs
  with a hook on jaxsane's one interpreter (``_jaxpr/interpret.py``); inside ``lax.scan``
  bodies over all time steps together).

Telemetry stays on the device; :meth:`Monitor.record` queues it and :meth:`Monitor.pull` moves a
whole batch of steps to the host at once (every ``log_every`` steps), so healthy steps add no
device-to-host round trip. Telemetry scalars are sanitized in-graph (non-finite -> ``-1``) so that
they never trip :func:`jaxsane.guard` on their own.

The detectors (:func:`jaxsane.check_training`, in ``train_checks.py``, re-exported here) judge
the recorded :class:`History`. The telemetry is computed inside the compiled step (jit-safe); everything
else here runs on the host and is not jit-safe.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.finding import Finding
from .._core.frames import frames_of, is_library_file, user_location
from .._core.history import History
from .._core.tree import PyTree, float_leaves, is_inexact, leaves_with_paths
from .._core.validate import require_bool, require_int
from .._experiment.batches import get_inputs
from .._experiment.contract import PureExperiment, require_experiment
from .._jaxpr.interpret import Interpreter, bodies
from .._precision.underflow import (
    has_low_precision,
    lost_fractions,
    proxy_lost_fractions,
    shadow_supported,
    upcast,
)
from .train_checks import check_training as check_training
from .writers import require_writer, write_scalars

MODE_BARE, MODE_NORMS, MODE_FULL = 0, 1, 2

# ----------------------------------------------------------------------------- jaxpr helpers


def _is_relu(eqn) -> bool:
    """``max(x, 0)`` with a literal zero operand (what ``jax.nn.relu`` and ``jnp.maximum(x, 0)`` lower to)."""
    from jax.extend.core import Literal

    if eqn.primitive.name != "max" or len(eqn.invars) != 2:
        return False
    for v in eqn.invars:
        if isinstance(v, Literal):
            try:
                if np.all(np.asarray(v.val) == 0):
                    return True
            except Exception:  # pragma: no cover - exotic literal
                return False
    return False


RELU_FAMILY = (
    "relu",
    "relu6",
    "leaky_relu",
    "hard_tanh",
    "hard_sigmoid",
    "hard_swish",
    "hard_silu",
    "elu",
    "celu",
    "selu",
)


def _is_activation(eqn, enclosing: Sequence[Any]) -> bool:
    """A ``max(x, 0)`` that is an activation: inside a ReLU-family function of jax/flax (``jax.nn.relu`` is a
    ``jit`` named ``relu``), or written in the user's own code (``jnp.maximum(x, 0)``). A clamp made by
    library code for another purpose (the variance ``max(0, E[x²] - E[x]²)`` of flax's LayerNorm) is not."""
    if any(e.params.get("name") in RELU_FAMILY for e in enclosing):
        return True
    for fr in frames_of(eqn):  # the innermost frame outside jax itself says who wrote the max
        parts = fr.file_name.replace("\\", "/").split("/")
        if "jax" in parts or "jaxlib" in parts:
            continue
        return not is_library_file(fr.file_name)
    return True


class _Relus(Interpreter):
    """Records every ReLU-family activation output (a hook on the one interpreter). Jit-safe.

    A ReLU inside a ``scan`` body (an RNN cell) is recorded once per time step, stacked
    ``[time, ...]``; ReLUs inside a traced ``while_loop`` body or ``cond`` branch are not recorded.
    """

    def after(self, eqn, invals, outs, tags, out_tags, ectx):
        if _is_relu(eqn) and _is_activation(eqn, self.path):
            self.emit(eqn, outs[0])
        return outs, out_tags


def _relu_records(apply_fn: Callable, params: PyTree, inputs: Any) -> tuple[_Relus, dict]:
    flat, treedef = jax.tree_util.tree_flatten((params, inputs))

    def flat_apply(*leaves):
        p, x = jax.tree_util.tree_unflatten(treedef, leaves)
        return apply_fn(p, x)

    closed = jax.make_jaxpr(flat_apply)(*[jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in flat])
    relus = _Relus()
    with relus.collecting() as records:
        relus.run(closed.jaxpr, closed.consts, flat)
    return relus, records


def relu_outputs(apply_fn: Callable, params: PyTree, inputs: Any) -> list[jax.Array]:
    """Every ReLU-family activation output computed by ``apply_fn(params, inputs)``, in program order. Jit-safe.

    An activation is a ``max(x, 0)`` inside ``jax.nn.relu``/``relu6``/... or in the user's own code; a
    library's clamp (LayerNorm's variance) is not one, so a GELU model has no ReLU sites. A ReLU site
    inside a ``scan`` body gives one array stacked over the time steps (so its dead fraction counts a
    unit dead when it is zero for every example at every step).
    """
    return list(_relu_records(apply_fn, params, inputs)[1].values())


def relu_labels(apply_fn: Callable, params: PyTree, inputs: Any) -> list[str]:
    """A label per ReLU site of :func:`relu_outputs`, in the same order: its name-stack scope when the
    model gives one, else ``file:line``, and its output shape when several share a line. Not jit-safe
    (traces ``apply_fn`` abstractly)."""
    found: list = []

    def trace(p, x):
        relus, records = _relu_records(apply_fn, p, x)
        found[:] = [relus.sites[site] for site in records]
        return 0

    jax.eval_shape(trace, params, inputs)
    names = []
    for eqn, enclosing in found:
        scope = str(eqn.source_info.name_stack) or "/".join(
            str(e.source_info.name_stack) for e in enclosing if str(e.source_info.name_stack)
        )
        where = (user_location(eqn, enclosing) or "").replace("\\", "/").rsplit("/", 1)[-1]
        names.append(scope or where or "relu")
    shapes = [eqn.outvars[0].aval.str_short(short_dtypes=True) for eqn, _ in found]
    return [f"{n} {s}" if names.count(n) > 1 else n for n, s in zip(names, shapes)]


def dead_fractions(relus: Sequence[jax.Array]) -> jax.Array:
    """Per ReLU site: the fraction of units (last axis) that are zero for every example of the batch. Jit-safe."""
    if not relus:
        return jnp.zeros((0,), jnp.float32)
    out = []
    for r in relus:
        r = jnp.reshape(r, (-1, r.shape[-1])) if r.ndim >= 1 else jnp.reshape(r, (1, 1))
        out.append(jnp.mean(jnp.all(r <= 0, axis=0).astype(jnp.float32)))
    return jnp.stack(out)


def depth_order(fn: Callable, params: PyTree, *rest: Any) -> list[int]:
    """Indices of ``params``' leaves ordered by where ``fn(params, *rest)`` first uses them (input side first).

    Leaves that ``fn`` never reads come last, in tree order. Not jit-safe (traces ``fn``).
    """
    p_leaves, p_def = jax.tree_util.tree_flatten(params)
    r_leaves, r_def = jax.tree_util.tree_flatten(rest)

    def flat_fn(*leaves):
        p = jax.tree_util.tree_unflatten(p_def, leaves[: len(p_leaves)])
        return fn(p, *jax.tree_util.tree_unflatten(r_def, leaves[len(p_leaves) :]))

    closed = jax.make_jaxpr(flat_fn)(
        *[jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in (*p_leaves, *r_leaves)]
    )
    first_use: dict[int, int] = {}
    counter = [0]

    def walk(jaxpr, tags: dict):
        for eqn in jaxpr.eqns:
            counter[0] += 1
            subs = bodies(eqn)
            for sub, index in subs:  # calls, loop bodies, branches: first use inside them
                walk(
                    sub,
                    {
                        iv: tags[eqn.invars[i]]
                        for iv, i in zip(sub.invars, index)
                        if not hasattr(eqn.invars[i], "val") and eqn.invars[i] in tags
                    },
                )
            if subs:
                continue
            for v in eqn.invars:
                if not hasattr(v, "val") and v in tags:
                    first_use.setdefault(tags[v], counter[0])

    walk(closed.jaxpr, {v: i for i, v in enumerate(closed.jaxpr.invars[: len(p_leaves)])})
    never = len(p_leaves) + counter[0] + 1
    return sorted(range(len(p_leaves)), key=lambda i: (first_use.get(i, never), i))


# ----------------------------------------------------------------------------- the monitor


def _norm(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32) if not jnp.issubdtype(x.dtype, jnp.complexfloating) else jnp.abs(x)
    n = jnp.sqrt(jnp.sum(jnp.square(x)))
    return jnp.where(jnp.isfinite(n), n, -1.0)


def leaf_norms(tree: PyTree) -> jax.Array:
    """Per float leaf of ``tree``: its L2 norm in float32 (-1 where it is not finite). Jit-safe."""
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if is_inexact(x)]
    if not leaves:
        return jnp.zeros((0,), jnp.float32)
    return jnp.stack([_norm(x) for x in leaves])


def finite_or_minus_one(x: jax.Array) -> jax.Array:
    """``x`` with its non-finite entries replaced by -1 (telemetry never trips a guard). Jit-safe."""
    return jnp.where(jnp.isfinite(x), x, -1.0)


class Monitor:
    """Telemetry for a train step, computed inside its compiled program, and a :class:`History`.

    Args:
      adapted: a :class:`~jaxsane.PureExperiment` (``jaxsane.PureExperiment(experiment)``, the pure view
        whose ``init``/``step`` the training loop runs), or an :class:`~jaxsane.Experiment`, viewed so here.
      every: compute norm telemetry (and gradient norms) every this many steps; 1 = every step.
        The bare step runs in between. A telemetry step costs about 1.3x a bare step, and on CPU
        every switch between compiled programs costs a little too (measured: ~1.2x overall with
        every=10 on a 0.5 ms step, within noise of 1.0x on a 100 ms step), hence the sparse default.
      dead_every: compute dead-ReLU fractions every this many steps (needs ``apply``); 0 = never.
      grads: compute per-leaf gradient norms (needs ``loss``) at sampled steps.
      log_every: move queued telemetry to the host every this many recorded steps.
      lag: when pulling, leave this many newest steps queued so the host never waits for running steps.
      underflow: on telemetry steps of a model with bf16/fp16 parameters, also measure per leaf the fraction
        of updates lost to rounding (a float32 shadow step, see ``_precision/underflow.py``); a float32 model
        pays nothing.
      writer: also send what reaches the host (train metrics and gradient norms at each pull, evaluations at
        :meth:`record_eval`) to this object with clu's ``write_scalars(step, scalars)`` / ``flush()``
        protocol; None keeps everything in :attr:`history` only.

    Not jit-safe to construct. :meth:`step` ``(state, batch, mode) -> (state, metrics)`` dispatches to one
    jitted program per ``mode`` (see :meth:`mode_for`); :attr:`compiled_step` is the same as one jitted
    function with a static ``mode`` (what :func:`jaxsane.fit` wraps in :func:`jaxsane.guard`).

    Example:
      >>> import itertools, jaxsane
      >>> from jaxsane.examples import load
      >>> exp = load("digits_optax"); pure = jaxsane.PureExperiment(exp)
      >>> mon = jaxsane.Monitor(pure, every=1)
      >>> state = pure.init(jax.random.key(0))
      >>> for i, batch in enumerate(itertools.islice(exp.train, 3)):
      ...     state, metrics = mon.step(state, batch, mon.mode_for(i)); mon.record(i, metrics)
      >>> len(mon.pull().loss)
      3
    """

    def __init__(
        self,
        adapted: PureExperiment,
        *,
        every: int = 50,
        dead_every: int = 250,
        grads: bool = True,
        log_every: int = 100,
        lag: int = 2,
        writer: Any = None,
        underflow: bool = True,
    ):
        require_experiment("Monitor", adapted, "adapted")
        self.writer = require_writer("Monitor", writer)
        adapted = (
            adapted if isinstance(adapted, PureExperiment) else PureExperiment(adapted)
        )  # an Experiment is adapted here
        require_int("Monitor", "every", every, min=1)
        require_int("Monitor", "log_every", log_every, min=1)
        require_int("Monitor", "dead_every", dead_every, min=0)
        require_int("Monitor", "lag", lag, min=0)
        require_bool("Monitor", "grads", grads)
        require_bool("Monitor", "underflow", underflow)
        self.underflow = underflow
        self._shadow_ok: bool | None = None  # can the step run on a float32-upcast state? (decided once)
        self.lag = int(lag)
        self.adapted = adapted
        self.every, self.dead_every, self.log_every = int(every), int(dead_every), int(log_every)
        self.grads = grads and adapted.loss_fn is not None
        self.dead = self.dead_every > 0 and adapted.apply_fn is not None
        self.history = History()
        self._pending: list[tuple[int, dict]] = []
        self._layout_done = False
        # one jitted function per mode (the bare one is the user's step itself), so that a call
        # costs exactly a plain jit dispatch; compiled_step takes the mode as a static argument
        # for wrappers such as guard that need one callable.
        self._jitted = {
            MODE_BARE: jax.jit(adapted.step),
            MODE_NORMS: jax.jit(functools.partial(self._monitored_step, mode=MODE_NORMS)),
            MODE_FULL: jax.jit(functools.partial(self._monitored_step, mode=MODE_FULL)),
        }
        self.compiled_step = jax.jit(self._monitored_step, static_argnums=(2,))

    def step(self, state: PyTree, batch: PyTree, mode: int = MODE_NORMS) -> tuple[PyTree, dict]:
        """Run the monitored step in ``mode`` (see :meth:`mode_for`). Jitted per mode; call it outside jit."""
        return self._jitted[mode](state, batch)

    # ------------------------------------------------------------------ in-graph
    def _monitored_step(self, state: PyTree, batch: PyTree, mode: int = MODE_NORMS):
        """The user's step plus telemetry (``mode`` static). Jit-safe."""
        adapted = self.adapted
        if mode == MODE_BARE:
            return adapted.step(state, batch)
        p0 = adapted.params(state)
        # read the values now: NNX states hold Variables that the step may update in place
        leaves0 = [x for x in jax.tree_util.tree_leaves(p0) if is_inexact(x)]
        grad_norm = handle_loss = grads = None
        if self.grads and (loss_fn := adapted.loss_fn) is not None:  # self.grads implies a loss handle
            handle_loss, grads = jax.value_and_grad(loss_fn, allow_int=True)(p0, batch)  # int leaves: float0
            grad_norm = leaf_norms(grads)
        shadow = self._shadow_params(state, batch, p0)
        new_state, metrics = adapted.step(state, batch)
        if "loss" not in metrics and handle_loss is not None:
            # a step that reports no loss (it returns only the state): record Experiment.loss before
            # the step instead, so the loss-based detectors judge a real curve, never a NaN one
            metrics = {**metrics, "loss": handle_loss}
        p1 = adapted.params(new_state)
        leaves1 = [x for x in jax.tree_util.tree_leaves(p1) if is_inexact(x)]
        tel = {"param_norm": leaf_norms(leaves0), "update_norm": leaf_norms([a - b for a, b in zip(leaves1, leaves0)])}
        if grad_norm is not None:
            tel["grad_norm"] = grad_norm
        if shadow is not None:
            tel["update_lost"] = lost_fractions(leaves0, leaves1, shadow)
        elif grads is not None and self.underflow and has_low_precision(p0):
            tel["update_lost"] = proxy_lost_fractions(leaves0, leaves1, float_leaves(grads))
        if mode == MODE_FULL and self.dead and (apply_fn := adapted.apply_fn) is not None:  # dead: apply exists
            inputs = get_inputs(adapted.experiment, batch)
            tel["dead_fraction"] = finite_or_minus_one(dead_fractions(relu_outputs(apply_fn, p0, inputs)))
        return new_state, {**metrics, "telemetry": tel}

    def _shadow_params(self, state: PyTree, batch: PyTree, p0: PyTree) -> list | None:
        """The float parameter leaves after the float32 shadow step (``_precision/underflow.py``), or None
        when the parameters hold no bf16/fp16 leaf or the step cannot run upcast. Jit-safe (traced once per
        mode)."""
        adapted = self.adapted
        if not (self.underflow and has_low_precision(p0)):
            return None
        if self._shadow_ok is None:
            self._shadow_ok = shadow_supported(adapted.step, state, batch, adapted.params)
        if not self._shadow_ok:
            return None
        shadow_state, _ = adapted.step(upcast(state), batch)
        return float_leaves(adapted.params(shadow_state))

    # ------------------------------------------------------------------ host side
    def mode_for(self, i: int) -> int:
        """The static mode for step index ``i`` (0-based): bare, norms, or full (norms + dead ReLUs). Host-side (a
        Python int, passed to :meth:`step` as a static mode); not jit-safe."""
        if self.dead and i % self.dead_every == 0:
            return MODE_FULL
        return MODE_NORMS if i % self.every == 0 else MODE_BARE

    def _layout(self, state: PyTree, batch: PyTree) -> None:
        """Leaf paths, kernels and depth order of the parameters (traced once, on the host)."""
        if self._layout_done:
            return
        self._layout_done = True
        adapted, h = self.adapted, self.history
        params = adapted.params(state)
        pairs = [(p, x) for p, x in leaves_with_paths(params, "params") if is_inexact(x)]
        h.leaf_paths = [p for p, _ in pairs]
        h.weight_leaves = [i for i, (_, x) in enumerate(pairs) if np.ndim(x) >= 2]
        order = list(range(len(pairs)))
        floats = lambda t: [x for x in jax.tree_util.tree_leaves(t) if is_inexact(x)]
        try:
            if (apply_fn := adapted.apply_fn) is not None:
                fn = lambda leaves, x: apply_fn(_rebuild(params, leaves), x)
                order = depth_order(fn, floats(params), get_inputs(adapted.experiment, batch))
            elif (loss_fn := adapted.loss_fn) is not None:
                fn = lambda leaves, b: loss_fn(_rebuild(params, leaves), b)
                order = depth_order(fn, floats(params), batch)
        except Exception:  # ordering is a nicety: fall back to tree order
            pass
        h.depth = order
        if self.dead and (labelled := adapted.apply_fn) is not None:  # self.dead implies an apply handle
            try:
                h.relu_labels = relu_labels(labelled, params, get_inputs(adapted.experiment, batch))
            except Exception:  # labels are a nicety: the plot falls back to "ReLU #j"
                h.relu_labels = []

    def record(self, i: int, metrics: dict, state: PyTree = None, batch: PyTree = None) -> None:
        """Queue step ``i``'s metrics (device arrays, no sync); pulls every ``log_every`` records. Call it outside
        jit (not jit-safe)."""
        if not self._layout_done and state is not None:
            self._layout(state, batch)
        self._pending.append((i, metrics))
        if len(self._pending) >= self.log_every + self.lag:
            self.pull(keep=self.lag)

    def pull(self, keep: int = 0) -> History:
        """Move queued metrics to the host (one transfer for the whole queue) and append them. Not jit-safe.

        ``keep`` leaves the newest records queued: their steps may still be running, and waiting for
        them would stall the dispatch pipeline (the others finished long ago, so reading them does not block).
        """
        if len(self._pending) <= keep:
            return self.history
        cut = len(self._pending) - keep
        pending, self._pending = self._pending[:cut], self._pending[cut:]
        groups: dict = {}
        for i, m in pending:  # one group per step mode (bare / norms / full): same structure, same shapes
            groups.setdefault(jax.tree_util.tree_structure(m), []).append((i, m))
        train, tele, grad, dead, lost = [], [], [], [], []
        for items in groups.values():
            steps = [i for i, _ in items]
            cols = _stacked([m for _, m in items])
            if not isinstance(cols, dict):
                cols = {"loss": cols}
            tel = cols.pop("telemetry", None)
            loss = cols.pop("loss", None)
            loss = (
                np.asarray(loss, np.float64).reshape(len(steps), -1).mean(axis=1)
                if loss is not None
                else np.full(len(steps), np.nan)
            )
            scalars = {
                k: np.asarray(v, np.float64).reshape(len(steps))
                for k, v in cols.items()
                if np.size(v) == len(steps) and np.issubdtype(np.asarray(v).dtype, np.number)
            }
            train += [(i, loss[k], {n: v[k] for n, v in scalars.items()}) for k, i in enumerate(steps)]
            if tel is not None:
                tele += [(i, tel["param_norm"][k], tel["update_norm"][k]) for k, i in enumerate(steps)]
                if "grad_norm" in tel:
                    grad += [(i, tel["grad_norm"][k]) for k, i in enumerate(steps)]
                if "dead_fraction" in tel:
                    dead += [(i, tel["dead_fraction"][k]) for k, i in enumerate(steps)]
                if "update_lost" in tel:
                    lost += [(i, tel["update_lost"][k]) for k, i in enumerate(steps)]
        h = self.history
        for i, loss, scalars in sorted(train, key=lambda r: r[0]):
            h.steps.append(i)
            h.loss.append(float(loss))
            for n, v in scalars.items():
                h.train_metrics.setdefault(n, []).append(float(v))
        _append_telemetry(h, tele, grad, dead, lost)
        if self.writer is not None:
            write_scalars(
                self.writer,
                [{"kind": "train", "step": i, "loss": float(loss), **scalars} for i, loss, scalars in train]
                + [{"kind": "grad", "step": i, "grad_norm": g.tolist()} for i, g in grad],
                h.leaf_paths,
            )
        return h

    def record_eval(self, step: int, loss: float, **metrics: float) -> None:
        """Record an evaluation made after ``step`` steps (host floats). Not jit-safe."""
        h = self.history
        h.eval_steps.append(int(step))
        h.eval_loss.append(float(loss))
        for k, v in metrics.items():
            h.eval_metrics.setdefault(k, []).append(float(v))
        if self.writer is not None:
            write_scalars(self.writer, [{"kind": "eval", "step": int(step), "loss": float(loss), **metrics}])

    def check(self, **thresholds: Any) -> list[Finding]:
        """Pull, then run :func:`jaxsane.check_training` on the history. Not jit-safe."""
        return check_training(self.pull(), **thresholds)


@jax.jit
def _stack_jit(trees: list) -> PyTree:
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *trees)


_FETCH_EACH_MAX_LEAVES = 4096  # up to this many arrays in all (a short run), fetching each beats compiling a stack


def _stacked(trees: list) -> PyTree:
    """Stack same-structure metric trees on the device and fetch them in one transfer per leaf.

    Lists are padded to a power of two so that only a few stacking programs are ever compiled. A short
    history (doctor's run) is fetched leaf by leaf and stacked on the host: the same values, no compile.
    Falls back to a per-leaf fetch for leaves that cannot be stacked. Not jit-safe.
    """
    n = len(trees)
    if n * len(jax.tree_util.tree_leaves(trees[0])) <= _FETCH_EACH_MAX_LEAVES:
        return _stacked_on_host(trees)
    size = 1 << max(0, (n - 1).bit_length())
    try:
        out = jax.device_get(_stack_jit(list(trees) + [trees[-1]] * (size - n)))
        return jax.tree_util.tree_map(lambda a: np.asarray(a)[:n], out)
    except Exception:  # e.g. a metric whose shape changes between steps
        return _stacked_on_host(trees)


def _stacked_on_host(trees: list) -> PyTree:
    host = jax.device_get(list(trees))
    return jax.tree_util.tree_map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *host)


def _rebuild(params: PyTree, float_leaves: list) -> PyTree:
    it = iter(float_leaves)
    return jax.tree_util.tree_map(lambda x: next(it) if is_inexact(x) else x, params)


def _append_telemetry(h: History, tele: list, grad: list, dead: list, lost: list) -> None:
    """Append pulled telemetry rows (``(step, values...)``) to ``h`` in step order. Host-side."""
    for i, p, u in sorted(tele, key=lambda r: r[0]):
        h.tele_steps.append(i)
        h.param_norm.append(p.tolist())
        h.update_norm.append(u.tolist())
    for i, g in sorted(grad, key=lambda r: r[0]):
        h.grad_steps.append(i)
        h.grad_norm.append(g.tolist())
    for i, d in sorted(dead, key=lambda r: r[0]):
        h.dead_steps.append(i)
        h.dead_fraction.append(d.tolist())
    for i, f in sorted(lost, key=lambda r: r[0]):
        h.lost_steps.append(i)
        h.update_lost.append(f.tolist())
