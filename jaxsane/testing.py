"""Helpers for users' own pytest suites: each ``assert_*`` runs a jaxsane check and raises on an
error finding (``check_*`` never raises on a finding; these do).

Example:
  >>> import jax.numpy as jnp
  >>> from jaxsane.testing import assert_grads_match
  >>> assert_grads_match(lambda p, x: jnp.sum(jnp.sin(x @ p)), jnp.ones((3, 2)), jnp.ones((4, 3)))
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from ._batch import check_batch_independence
from ._errors import GradCheckError, JaxsaneError
from ._findings import Finding
from ._grads import check_grads
from ._init import check_init
from ._step_checks import check_step, count_compilations

__all__ = ["CheckFailed", "GradCheckError", "assert_batch_independent", "assert_compiles_once",
           "assert_grads_match", "assert_init_ok", "assert_step_ok", "count_compilations"]


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


def assert_init_ok(apply: Callable, params: Any, inputs: Any, labels: Any = None, *, warnings: bool = True,
                   **kwargs: Any) -> None:
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


def assert_compiles_once(step: Callable, *args: Any, calls: int = 3) -> Any:
    """Call ``step(*args)`` ``calls`` times with the same arguments and raise :class:`CheckFailed`
    if any call after the first compiles again. Returns the last output. Not jit-safe.

    (optax's own tests make the same assertion about their jitted steps.)
    """
    out = step(*args)
    counts = []
    for _ in range(max(1, calls - 1)):
        with count_compilations() as counter:
            out = step(*args)
        counts.append(counter.compiles)
    if any(counts):
        finding = Finding("step.recompiles", f"calls 2..{calls} compiled {counts} time(s) with identical arguments",
                          "see jaxsane.check_step: static Python values that change, or jax.jit applied per call")
        raise CheckFailed(_message("the step recompiles", [finding]), findings=[finding])
    return out
