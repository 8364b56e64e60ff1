"""What a guarded call kept until its flags are read: :class:`KeptCall` (its inputs and outputs, by
reference) and :class:`PendingStep` (its flag vector, not read yet).

Not jit-safe: these are host-side records.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from .._experiment.purify import combine


@dataclasses.dataclass
class PendingStep:
    """A dispatched guarded step whose flag vector is not read yet."""

    step: int
    flags: jax.Array
    call: KeptCall | None  # what the call saw, kept by reference (None with keep_inputs=False)
    replica: Any = None  # check_replicas: (plan, fingerprints, input state, root names); see _dist


@dataclasses.dataclass
class KeptCall:
    """What one guarded call saw, kept by reference until its flags are read."""

    positions: tuple
    nnx_in: Any  # (leaves, treedef) of the NNX objects' state as it came in, or None
    plain: tuple  # positional args, with NNX objects and static args replaced by None
    kwargs: dict
    new_nnx_state: Any
    out: Any
    graphdef: Any
    statics: tuple = ()  # (position, value) of static positional args
    static_kw: tuple = ()  # (name, value) of static keyword args
    replayed: bool = False  # skip: out/new_nnx_state replaced by the failing step's own (unselected) outputs
    rest: Any = None  # the args' non-array part (an _adapter.Static) when plain/kwargs/out are array parts

    def args(self) -> tuple:
        """The positional args as the step saw them; NNX objects as their pure input ``nnx.State``."""
        args = list(self.plain)
        for i, value in self.statics:
            args[i] = value
        if self.positions:
            state = jax.tree_util.tree_unflatten(self.nnx_in[1], self.nnx_in[0])
            for k, p in enumerate(self.positions):
                args[p] = state[k]
        return tuple(args)

    def user_args(self) -> tuple[tuple, dict]:
        """``(args, kwargs)`` as the user passed them: :meth:`args` with an Equinox model's non-array leaves
        put back (NNX objects stay pure states)."""
        if self.rest is None:
            return self.args(), self.kwargs
        return combine((self.args(), self.kwargs), self.rest)
