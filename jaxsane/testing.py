"""Helpers for users' own pytest suites: each ``assert_*`` runs a jaxsane check and raises on an
error finding (``check_*`` never raises on a finding; these do).

Example:
  >>> import jax.numpy as jnp
  >>> from jaxsane.testing import assert_grads_match
  >>> assert_grads_match(lambda p, x: jnp.sum(jnp.sin(x @ p)), jnp.ones((3, 2)), jnp.ones((4, 3)))
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ._checks.batch import check_batch_independence
from ._checks.grads import check_grads
from ._checks.init import check_init
from ._checks.step import check_step, count_compilations
from ._core.errors import GradCheckError, JaxsaneError
from ._core.finding import Finding
from ._core.tree import same_structure
from ._jaxpr.recompile import recompile_finding

__all__ = [
    "CheckFailed",
    "GradCheckError",
    "assert_batch_independent",
    "assert_compiles_once",
    "assert_grads_match",
    "assert_init_ok",
    "assert_step_ok",
    "count_compilations",
]


class CheckFailed(JaxsaneError, AssertionError):
    """A jaxsane check reported problems in a test (``findings`` holds them)."""

    def __init__(self, message: str, findings: Any = None):
        super().__init__(message)
        self.findings = findings


def _failing(findings: Iterable[Finding], warnings: bool) -> list[Finding]:
    levels = ("error", "warning") if warnings else ("error",)
    return [f for f in findings if f.severity in levels]


def _message(what: str, findings: Sequence[Finding]) -> str:
    return f"{what}: {len(findings)} problem(s)\n" + "\n".join(str(f) for f in findings)


def assert_grads_match(f: Callable, *args: Any, allow_missing: bool = False, **kwargs: Any) -> None:
    """Raise :class:`~jaxsane.GradCheckError` unless ``f``'s gradients match finite differences.

    Runs :func:`jaxsane.check_grads` (same arguments: ``argnums``, ``order``, ``modes``, ``eps``,
    ``atol``, ``rtol``, ``dtype``...). ``grad.missing`` (a float leaf with identically zero
    gradient) fails too unless ``allow_missing``. Not jit-safe.
    """
    findings = check_grads(f, *args, **kwargs)
    bad = [x for x in findings if x.code == "grad.mismatch" or (x.code == "grad.missing" and not allow_missing)]
    if bad:
        raise GradCheckError(_message("gradients do not match finite differences", bad), findings=bad)


def assert_init_ok(
    apply: Callable, params: Any, inputs: Any, labels: Any = None, *, warnings: bool = True, **kwargs: Any
) -> None:
    """Raise :class:`CheckFailed` on ``init.loss``/``init.scale``/``init.symmetric`` findings
    (warnings included unless ``warnings=False``). Arguments as :func:`jaxsane.check_init`."""
    bad = _failing(check_init(apply, params, inputs, labels, **kwargs), warnings)
    if bad:
        raise CheckFailed(_message("the model's init looks wrong", bad), findings=bad)


def assert_step_ok(experiment: Any, batch: Any = None, *, warnings: bool = True, **kwargs: Any) -> None:
    """Raise :class:`CheckFailed` when :func:`jaxsane.check_step` finds a wiring problem
    (no update, frozen optimizer state, reused randomness, recompilation)."""
    bad = _failing(check_step(experiment, batch, **kwargs), warnings)
    if bad:
        raise CheckFailed(_message("the train step is mis-wired", bad), findings=bad)


def assert_batch_independent(apply: Callable, params: Any, inputs: Any, **kwargs: Any) -> None:
    """Raise :class:`CheckFailed` when an example's output depends on another example's input
    (:func:`jaxsane.check_batch_independence`, ``apply`` in eval mode)."""
    bad = check_batch_independence(apply, params, inputs, **kwargs)
    if bad:
        raise CheckFailed(_message("examples are not independent", bad), findings=bad)


def assert_compiles_once(step: Callable, *args: Any, calls: int = 3, thread_state: bool = False) -> Any:
    """Call ``step(*args)`` ``calls`` times and raise :class:`CheckFailed` if any call after the first
    compiles again; the message names what changed in the arguments since the last compile (path, old
    and new shape/dtype/weak type/sharding/static value/key) or says the arguments were identical (a new
    ``jax.jit`` or closure per call). Returns the last output. Not jit-safe.

    Args:
      step: the (jitted) step.
      *args: its positional arguments.
      calls: how many calls (>= 2).
      thread_state: feed each call's new state back as the first argument, as a training loop does (the
        output itself, or ``output[0]`` when the step returns ``(state, metrics)``), so a state whose
        dtypes or weak types drift across a step is caught.

    (optax's own tests make the same assertion about their jitted steps.)
    """
    with count_compilations() as counter:
        watched = counter.watch(step)
        for _ in range(max(2, calls)):
            out = watched(*args)
            if thread_state and args:
                new = out[0] if isinstance(out, tuple) and len(out) == 2 and same_structure(out[0], args[0]) else out
                args = (new, *args[1:])
    if counter.reasons:
        findings = [recompile_finding(r) for r in counter.reasons]
        raise CheckFailed(_message("the step recompiles", findings), findings=findings)
    return out
