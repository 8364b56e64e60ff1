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
      dump_error: why the dump could not be written (then ``dump_path`` is None), or None.
    """

    def __init__(
        self,
        message: str,
        finding: Any = None,
        *,
        dump_path: str | None = None,
        inputs: Any = None,
        located: Any = None,
        dump_error: str | None = None,
    ):
        super().__init__(message)
        self.finding = finding
        self.dump_path = dump_path
        self.dump_error = dump_error
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


class DumpError(JaxsaneError, ValueError):
    """A dump cannot be written exactly, or a file read as a dump is damaged, hostile or over a limit."""


class DumpShapeError(JaxsaneError, AttributeError):
    """An attribute was asked of a generic shape rebuilt from a dump; pass ``like=`` for your own classes."""


class ArgumentError(JaxsaneError, TypeError, ValueError):
    """A public function got an argument of the wrong type or out of range. It is also a TypeError
    and a ValueError, so code that caught those before keeps working."""


class DoctorOptionError(ArgumentError):
    """An unknown or ill-typed ``doctor`` option (or ``-o NAME=VALUE`` on the command line)."""


class CheckpointError(JaxsaneError, RuntimeError):
    """fit cannot read or write its checkpoints: none intact on resume, or a write failed (disk full,
    read-only, no permission).

    Attributes:
      skipped: ``(step, reason)`` for each damaged checkpoint that was found (empty for write failures).
    """

    def __init__(self, message: str, skipped: Any = None):
        super().__init__(message)
        self.skipped = list(skipped or [])


EXIT_PREEMPTED = 82  # fit stopped on SIGTERM/SIGINT after saving a verified checkpoint: run it again to resume


class Preempted(JaxsaneError):
    """:func:`jaxsane.fit` stopped on a preemption notice (SIGTERM, the ``jax.distributed`` coordination
    service's notice) or Ctrl-C (SIGINT): every process finished its current step, all stopped at the same
    step, one checkpoint was saved there and verified, and the report and the metrics were written. Calling
    ``fit`` again with the same arguments resumes bitwise from that checkpoint.

    A script should end with ``sys.exit(e.exit_code)`` (:data:`EXIT_PREEMPTED`, 82): a scheduler can
    then tell "stopped cleanly, resume me" from a crash (1) or a kill by signal N (128+N).

    Attributes:
      step: the step (data position) all processes stopped at.
      checkpoint: the path of the verified checkpoint of that step, or None without ``checkpoint_dir``.
      signal: the name of the signal that asked for the stop (``"SIGTERM"``, ``"SIGINT"``), or
        ``"preemption notice"`` when another process of the job received it.
      result: the :class:`~jaxsane.FitResult` of the run so far (state, history, diagnosis).
      exit_code: :data:`EXIT_PREEMPTED` (82).
    """

    exit_code = EXIT_PREEMPTED

    def __init__(self, message: str, *, step: int, checkpoint: str | None, signal: str, result: Any = None):
        super().__init__(message)
        self.step = step
        self.checkpoint = checkpoint
        self.signal = signal
        self.result = result


class FitArgumentError(ArgumentError, ExperimentError):
    """An argument of :func:`jaxsane.fit` has the wrong type or value (checked before any work)."""


class FindingError(JaxsaneError, ValueError, TypeError):
    """A :class:`~jaxsane.Finding` or :class:`~jaxsane.Diagnosis` was built or queried with a bad value."""


class GuardConfigError(ArgumentError):
    """``jaxsane.guard`` was given an argument of the wrong type or out of range (raised at the call,
    before any work). Both a ``ValueError`` and a ``TypeError``, so either ``except`` catches it."""


class ExampleAxisError(DataError):
    """A batch cannot be cut into examples: its leaves disagree on the leading axis (a graph batch,
    packed sequences) and the Experiment does not say what one example is (``Experiment(examples=...)``)."""


class DistHangError(JaxsaneError, RuntimeError):
    """A process of a ``jax.distributed`` job stopped entering the guarded step (``dist.hang``), found by
    ``guard(step, hang_timeout=...)``. The message names the missing processes, the last step each reached
    and where their threads are.

    Attributes:
      finding: the ``dist.hang`` :class:`~jaxsane.Finding`.
    """

    def __init__(self, message: str, finding: Any = None):
        super().__init__(message)
        self.finding = finding


class ReplicaDivergenceError(JaxsaneError):
    """Values meant to be replicated differ across devices or processes (raised by ``guard``).

    Attributes:
      findings: the ``dist.replica_divergence`` :class:`~jaxsane.Finding` objects.
    """

    def __init__(self, message: str, findings: Any = None):
        super().__init__(message)
        self.findings = findings


class JaxsaneWarning(RuntimeWarning):
    """Issued by ``guard(..., on_nonfinite="warn")``, ``fit`` and the monitor when they carry on past a problem.

    Attributes:
      finding: the :class:`~jaxsane.Finding` behind the warning, when there is one (else None).
    """

    finding: Any = None
