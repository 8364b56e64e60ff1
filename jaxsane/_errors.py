"""The exception hierarchy: every message starts with ``[jaxsane]``."""

from __future__ import annotations

from typing import Any


class JaxsaneError(Exception):
    """Base class. The message says what failed, where, the likely cause and the fix."""

    def __init__(self, message: str):
        if not message.startswith("[jaxsane]"):
            message = "[jaxsane] " + message
        super().__init__(message)


class NonFiniteError(JaxsaneError, FloatingPointError):
    """A guarded step produced (or was fed) NaN/Inf.

    Attributes:
      finding: the :class:`~jaxsane.Finding` describing it.
      dump_path: directory of the dump of the failing step's inputs, or None.
      inputs: the failing step's exact inputs as host numpy pytrees ``(args, kwargs)``.
      located: the :func:`jaxsane.locate` report on those inputs, when one was made.
    """

    def __init__(self, message: str, finding: Any = None, *, dump_path: str | None = None,
                 inputs: Any = None, located: Any = None):
        super().__init__(message)
        self.finding = finding
        self.dump_path = dump_path
        self.inputs = inputs
        self.located = located


class GradCheckError(JaxsaneError, AssertionError):
    """Autodiff gradients disagree with finite differences (raised by ``assert_*``)."""

    def __init__(self, message: str, findings: Any = None):
        super().__init__(message)
        self.findings = findings


class DataError(JaxsaneError, ValueError):
    """The data cannot be read as batches (ragged, missing keys, object dtypes)."""


class ExperimentError(JaxsaneError, TypeError):
    """The Experiment's handles cannot be used as given (not callable, wrong output shape)."""


class GuardConfigError(JaxsaneError, ValueError, TypeError):
    """``jaxsane.guard`` was given an argument of the wrong type or out of range (raised at the call,
    before any work). Both a ``ValueError`` and a ``TypeError``, so either ``except`` catches it."""
