"""guard around a ``chex.chexify``-ed step: chex stays the outermost transform, its failed finite
assertions become jaxsane findings.

``chex.chexify(step)`` must wrap every jit (it refuses tracers), so guard does not trace it inside its
own compiled program: it calls the chexified step as it is and reads the finite flags of its inputs and
outputs with a small compiled function of its own (:func:`flags_of`). chex raises its value assertions
on the host, as an ``AssertionError`` starting ``[Chex] chexify assertion 'NAME' failed``: at the failing
call with ``chexify(step, async_check=False)``, else at a later call or at
``chex.block_until_chexify_assertions_complete()``. When a guarded call meets one about finiteness
(:data:`FINITE_ASSERTIONS`), guard first reads its own pending flags (a NaN in the outputs is reported
with its step, origin and dump, chex's error as the cause); otherwise it replays the calls it still holds
(and the current one) with :func:`jaxsane.locate` on the step under the chexify layer, chex's
assertions switched off (they need chexify's functionalisation, which locate's replay is not), and
reports the first whose values go non-finite (:func:`chex_failure`). Other chex assertions propagate as
chex raised them.

Everything here runs on the host. Not jit-safe.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from .._core.errors import NonFiniteError
from .._core.finding import Finding
from .._core.frames import user_stacklevel
from .._core.tree import finite_flags, to_host
from .._experiment.chex import chex_asserts_off, locate_target
from .flags import grouped_flags


@jax.jit
def flags_of(inputs: Any, kwargs: Any, out: Any) -> jax.Array:
    """guard's flag vector for a call it did not compile itself: the inputs after the state, per leaf, and
    the outputs grouped, as ``Guarded._body`` lays them out (inputs count only when an output is bad).
    Jit-safe."""
    in_flags = finite_flags((inputs, kwargs))
    out_flags = grouped_flags((None, out))
    return jnp.concatenate([in_flags | jnp.all(out_flags), out_flags])


def chex_failure(guarded: Any, exc: AssertionError, candidates: list[tuple[int, tuple, dict]]) -> NonFiniteError:
    """The NonFiniteError for chex's failed finite assertion ``exc``: the first of ``candidates`` (``(step,
    args, kwargs)`` the guard still holds, oldest first) on which locate finds a non-finite value gives the
    step, origin and dump; chex's message is kept in the text (and the caller raises it ``from exc``)."""
    from .._locate.locate import locate_failure  # (chex's assertion failed in the compiled step: not latent)

    chex_text = " ".join(str(exc).split())
    target = locate_target(guarded.step)
    step: int = guarded.step_count
    args: tuple | None = None
    kwargs: dict | None = None
    if candidates:
        step, args, kwargs = candidates[-1]
    located: Any = None
    if guarded.locate_on_failure:
        for s, a, k in candidates:
            try:
                with chex_asserts_off():
                    report = locate_failure(target, *a, **k)
            except Exception as e:  # locate must never hide the original failure
                warnings.warn(
                    f"[jaxsane] locate failed on the inputs of step {s}: {type(e).__name__}: {e}",
                    stacklevel=user_stacklevel(),
                )
                continue
            if report is not None:
                step, args, kwargs, located = s, a, k, report
                break
    origin = located.origins[0] if located is not None and getattr(located, "origins", None) else None
    code = getattr(origin, "code", "nonfinite.forward") if origin is not None else "nonfinite.forward"
    when = f"step {step}" if located is not None else f"reported at step {step}"
    message = f"a chex assertion failed in the guarded step ({when}): {chex_text}"
    if origin is not None:
        message += f"; origin: {origin.summary()}"
    elif located is None:
        message += (
            "; locate finds no NaN/Inf reaching the step's outputs on the inputs guard still holds: the "
            "asserted value may be masked before the outputs, or (chexify's async_check) the failing call "
            "is older than those; chex.chexify(step, async_check=False) pins it to its call"
        )
    inputs = (to_host(args), to_host(kwargs)) if args is not None else None
    dump_path, dump_error = None, None
    if guarded.dump_dir and inputs is not None:
        from .._dump.dump import save_dump

        dump_path = os.path.join(guarded.dump_dir, f"step_{step:06d}")
        try:
            save_dump(
                dump_path, inputs[0], inputs[1], meta={"step": step, "finding": {"code": code, "message": message}}
            )
            message += f" (inputs dumped to {dump_path})"
        except Exception as e:  # a failed dump is a warning inside the failure, never a replacement for it
            dump_error, dump_path = str(e), None
    hint = (getattr(origin, "fix", None) if origin is not None else None) or (
        "run jaxsane.locate on the step under chex.chexify (step.__wrapped__) with the dumped inputs to find the line"
    )
    finding = Finding(
        code,
        message,
        hint,
        step=step,
        file=getattr(origin, "file", None),
        line=getattr(origin, "line", None),
        extra={"chex": chex_text, "policy": guarded.on_nonfinite, **({"dump": dump_path} if dump_path else {})},
    )
    guarded.failures.append(finding)
    text = f"[jaxsane] {code} at step {step}: {message}\n  fix: {hint}" + (
        f"\n{located}" if located is not None else ""
    )
    return NonFiniteError(text, finding, dump_path=dump_path, inputs=inputs, located=located, dump_error=dump_error)


__all__ = ["chex_failure", "flags_of"]
