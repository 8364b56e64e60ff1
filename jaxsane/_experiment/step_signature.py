"""The step's call signature: jaxsane calls ``step(state, batch)`` (or ``step(*state, batch)`` for a spread tuple
state); a step whose readable signature cannot take that is an :class:`ExperimentError` before its first call.
Host-side, on the function object; not jit-relevant."""

from __future__ import annotations

import re
from typing import Any

from .._core.errors import ExperimentError
from .purify import call_parameters, unwrap

# the words of CPython's own TypeError when a call's arguments do not bind to the signature
BINDING = re.compile(r"positional argument|required (keyword-only )?argument|unexpected keyword|takes no arguments")


def signature_message(step: Any, spread: bool, example: Any, problem: str) -> str:
    """Why a step of this signature cannot be called, and the signature jaxsane calls it with."""
    n = len(example) + 1 if spread else 2
    call = f"step({', '.join(f'state[{i}]' for i in range(n - 1))}, batch)" if spread else "step(state, batch)"
    name = getattr(unwrap(step), "__name__", type(step).__name__)
    return (
        f"Experiment.step ({name}) cannot be called as {call}: {problem}. jaxsane's tools (fit, doctor, "
        f"guard, check_step, overfit) call the step once per batch as {call}, with the train state init(key) "
        "returned and one batch, and read back (new_state, metrics) or new_state (for NNX objects updated in "
        "place: the loss, metrics or None). Likely cause: a step that closes over its batch or state, or an "
        "evaluation function passed as the step. Fix: give it the signature def step(state, batch), or "
        "step(model, optimizer, batch) for a tuple state of (model, optimizer)."
    )


def check_step_signature(step: Any, example: Any, spread: bool) -> None:
    """Raise :class:`ExperimentError` when ``step``'s readable signature cannot take the arguments the adapter
    passes (``step(state, batch)``, or ``step(*state, batch)`` for a spread tuple state), before its first
    call. A signature that cannot be read (a C callable, ``*args``) passes: the first call's binding is
    checked instead. Not jit-relevant (host-side, on the function object)."""
    params = call_parameters(step)
    if params is None:
        return
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    keyword_only = [p.name for p in params if p.kind == p.KEYWORD_ONLY and p.default is p.empty]
    n = len(example) + 1 if spread else 2
    problem = None
    if len(positional) < n:
        names = ", ".join(p.name for p in positional)
        problem = f"it takes {len(positional)} positional argument{'s' * (len(positional) != 1)} ({names}), not {n}"
    elif len(required) > n:
        names = ", ".join(p.name for p in required)
        problem = f"it requires {len(required)} positional arguments ({names}), more than the {n} it is given"
    elif keyword_only:
        problem = f"it requires the keyword-only argument{'s' * (len(keyword_only) > 1)} {', '.join(keyword_only)}"
    if problem:
        raise ExperimentError(signature_message(step, spread, example, problem))
