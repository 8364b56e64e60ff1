"""One process-wide lock held while jaxsane runs the user's own Python functions (init, step, loss, apply).

doctor traces the user's functions from two threads (its stages in the main thread, the later stages' work in
its background threads). User code is not written to be traced from two threads at once: JAX's
``linear_util`` stores, Equinox's ``filter_jit`` caches and NNX's graph contexts are shared per function, and
two concurrent traces of an ``eqx.filter_jit`` raised ``StoreException: Store occupied`` in the user's code.
So every call into the user's code (a trace, or an eager call) holds :data:`USER_CODE`; XLA compiles and runs
the lowered programs outside it, so the background threads still overlap with the stages where it counts.

Re-entrant (a step that jaxsane traces may call a loss that jaxsane also wraps). Host-side; not jit-relevant:
taking the lock inside a trace only orders the traces.
"""

from __future__ import annotations

import threading

USER_CODE = threading.RLock()
