"""State the step should change and does not: ``step.stats_frozen``.

A train step that runs a model with a mutable collection (Flax ``batch_stats`` of a BatchNorm in train
mode, an EMA of the parameters, any running statistic) computes the collection's new value from its old
one, and must return it. A step that returns the old collection instead (``state.apply_gradients(grads=g)``
without ``.replace(batch_stats=...)``) trains fine but evaluates with stale statistics: the eval loss stalls
far above the train loss. Such a leaf is found from the step's own jaxpr and a few real calls:

1. the step's calls leave it bitwise unchanged;
2. the step reads it: a primitive of the step's jaxpr consumes it (through ``jit`` and other call
   boundaries: a leaf only passed through is not read);
3. what the step computes from it is thrown away: with the leaf's own output ignored, dead-code
   elimination of the jaxpr no longer needs the leaf (a BatchNorm in eval mode, whose running statistics
   normalise the activations, needs them for the loss and the new parameters: it is not reported);
4. the leaf's output is the old leaf itself, passed through: a step that returns a value it computed (an
   EMA of parameters that did not move yet, under ``optax.MultiSteps`` or a warmup from a learning rate of 0)
   returns its update even when the value comes out bitwise the same.

Not jit-safe (it traces the step and inspects its jaxpr on the host).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._core.finding import Finding

# call-like primitives whose sub-jaxpr takes the equation's inputs one to one: a leaf passed into one is
# only read when the sub-jaxpr's own equations read it
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _sub_jaxpr(eqn: Any) -> Any:
    """The sub-jaxpr of a call-like equation (``pjit``, ``closed_call``, ``remat``, ``custom_jvp_call``) whose
    invars match the equation's one to one, else None."""
    for name in _CALL_PARAMS:
        sub = eqn.params.get(name)
        if sub is None:
            continue
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns") and len(inner.invars) == len(eqn.invars):
            return inner
    return None


def _reads(jaxpr: Any, var: Any) -> bool:
    """Whether a primitive of ``jaxpr`` (or of a call-like equation's sub-jaxpr) consumes ``var``; passing it
    through a call unchanged is not a read. Not jit-safe."""
    for eqn in jaxpr.eqns:
        positions = [k for k, v in enumerate(eqn.invars) if v is var]
        if not positions:
            continue
        sub = _sub_jaxpr(eqn)
        if sub is None:
            return True
        inner = [sub.invars[k] for k in positions]
        if any(_reads(sub, v) for v in inner):
            return True
        # passed through the call: its outputs that are the very input carry the leaf on
        for out, inner_out in zip(eqn.outvars, sub.outvars):
            if any(inner_out is v for v in inner) and _reads_after(jaxpr, eqn, out):
                return True
    return False


def _reads_after(jaxpr: Any, eqn: Any, var: Any) -> bool:
    """:func:`_reads` of ``var`` over the equations after ``eqn``."""
    rest = jaxpr.eqns[jaxpr.eqns.index(eqn) + 1 :]
    return _reads(_Eqns(rest), var)


class _Eqns:
    """A list of equations seen as a jaxpr by :func:`_reads`."""

    def __init__(self, eqns: list):
        self.eqns = eqns


_IDENTITIES = ("copy", "copy_p")  # primitives whose output is their input's value


def _passes_through(jaxpr: Any, out: Any, var: Any) -> bool:
    """Whether ``out`` is ``var`` itself, carried unchanged through call-like equations (and copies): the step
    returns its input as it was, not a value it computed. Not jit-safe."""
    if out is var:
        return True
    for eqn in jaxpr.eqns:
        k = next((k for k, o in enumerate(eqn.outvars) if o is out), None)
        if k is None:
            continue
        sub = _sub_jaxpr(eqn)
        if sub is None:
            return eqn.primitive.name in _IDENTITIES and any(v is var for v in eqn.invars)
        inner = [sub.invars[j] for j, v in enumerate(eqn.invars) if v is var]
        return any(_passes_through(sub, sub.outvars[k], v) for v in inner)
    return False


def _dropped_without_own_output(closed: Any, leaf: int, out: int) -> bool:
    """Whether the step no longer needs input ``leaf`` once its output ``out`` is ignored (dead-code
    elimination of the jaxpr): what it computes from the leaf reaches no other output. Not jit-safe."""
    try:
        from jax._src.interpreters.partial_eval import dce_jaxpr
    except ImportError:  # pragma: no cover - private API moved: judge nothing
        return False
    jaxpr = closed.jaxpr
    used = [k != out for k in range(len(jaxpr.outvars))]
    try:
        _, used_inputs = dce_jaxpr(jaxpr, used, instantiate=False)
    except Exception:  # noqa: BLE001 - a primitive without a DCE rule keeps its inputs: judge nothing
        return False
    return not used_inputs[leaf]


def dropped_state_findings(
    closed: Any, n_state: int, n_out_state: int, candidates: Sequence[int], paths: Sequence[str]
) -> list[Finding]:
    """``step.stats_frozen`` for the state leaves ``candidates`` (indices into the state's leaves, each
    bitwise unchanged by every call) that the step reads and whose new value it throws away.

    Args:
      closed: the step's closed jaxpr on ``(state, batch)``; its first ``n_state`` invars are the state's
        leaves and its first ``n_out_state`` outvars the new state's.
      candidates: float state leaves (not parameters) that no call changed.
      paths: the display path of every state leaf.

    Not jit-safe.
    """
    jaxpr = closed.jaxpr
    if len(jaxpr.invars) < n_state or n_out_state != n_state:
        return []
    dropped = [
        i
        for i in candidates
        if _passes_through(jaxpr, jaxpr.outvars[i], jaxpr.invars[i])
        and _reads(jaxpr, jaxpr.invars[i])
        and _dropped_without_own_output(closed, i, i)
    ]
    if not dropped:
        return []
    shown = [paths[i] for i in dropped]
    return [
        Finding(
            "step.stats_frozen",
            f"the step computes new values of {len(dropped)} state leaf(s) (e.g. {', '.join(shown[:3])}) from "
            "their old ones, then throws them away and returns the old leaves bitwise unchanged: a mutable "
            "collection (BatchNorm running statistics, an EMA) that training never updates",
            "return the collection the model's apply produced: for Flax linen `logits, updates = "
            "model.apply(..., mutable=['batch_stats'])` then `state.apply_gradients(grads=grads)"
            ".replace(batch_stats=updates['batch_stats'])`; eval with stale statistics stalls far above the "
            "train loss",
            path=shown[0],
            extra={"leaves": shown},
        )
    ]
