"""The batch stage's time-axis probes (``_checks/causal.py``, ``_checks/sequence.py``): ``seq.future_leakage`` in
a model declared causal, or, when ``Experiment.causal`` is left unset, in one whose targets are an input one
position ahead (teacher forcing), and ``seq.padding_in_loss`` where the batch has a padding mask (``[B, T]``, or
``[B]`` per example). Not jit-safe."""

from __future__ import annotations

import functools
from typing import Any

from .._checks.causal import check_causal, check_teacher_forced
from .._checks.sequence import check_padding_in_loss
from .._core.errors import ExperimentError
from .._core.finding import Finding
from .._experiment.batches import get_inputs, get_mask
from .handles import labels_or_none, traceable_handle


def sequence_checks(ctx: Any) -> list[Finding]:
    """The probes that apply to ``ctx``'s experiment (a doctor ``StageContext``); nothing for a model with no
    time axis."""
    exp, adapted = ctx.experiment, ctx.pure
    params = None
    out: list[Finding] = []
    if exp.causal is not False and adapted.apply_fn is None:
        if exp.causal:
            out.append(
                Finding(
                    "doctor.skipped",
                    "causal check not run: Experiment(causal=True) needs "
                    "Experiment.apply ((params, inputs) -> per-position outputs)",
                    "pass apply=...",
                )
            )
    elif exp.causal is not False:
        params = adapted.params(adapted.init(ctx.key))
        out += _future_leakage(ctx, params)
    mask = get_mask(exp, ctx.batch)
    if adapted.loss_fn is not None and mask is not None and getattr(mask, "ndim", 0) in (1, 2):
        params = adapted.params(adapted.init(ctx.key)) if params is None else params
        probe = functools.partial(
            check_padding_in_loss, params=params, batch=ctx.batch, mask=mask, inputs=get_inputs(exp, ctx.batch),
            labels=labels_or_none(exp, ctx.batch),
        )  # fmt: skip
        shared = adapted.jitted("loss")
        assert shared is not None, "Experiment.loss is present (checked above)"
        try:  # at the train batch's shape, the loss program the init stage compiled (the run's eval uses it too)
            out += probe(shared)
        except ExperimentError:
            raise
        except Exception:  # a loss that jit cannot take as it is (an NNX model updating its statistics)
            out += probe(traceable_handle(adapted, "loss"))
    return out


def _future_leakage(ctx: Any, params: Any) -> list[Finding]:
    """``seq.future_leakage``: a declared-causal model probed on every time input, an undeclared one on the inputs
    its targets are one position ahead of (none: nothing probed)."""
    exp, adapted = ctx.experiment, ctx.pure
    apply, inputs = traceable_handle(adapted, "apply"), get_inputs(exp, ctx.batch)
    labels, mask = labels_or_none(exp, ctx.batch), get_mask(exp, ctx.batch)
    if not exp.causal:
        if labels is None:
            return []
        try:  # the apply program the init stage compiled at this batch's shapes
            return check_teacher_forced(adapted.jitted("apply"), params, inputs, labels, compiled=True, mask=mask)
        except Exception:  # noqa: BLE001 - an apply that jit cannot take as it is: traced afresh
            return check_teacher_forced(apply, params, inputs, labels, mask=mask)
    try:
        return check_causal(apply, params, inputs, labels=labels, mask=mask)
    except ExperimentError as e:
        return [Finding("doctor.skipped", f"causal check not run: {e}", "")]
