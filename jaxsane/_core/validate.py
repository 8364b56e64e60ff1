"""Argument checks at the public boundary, shared by every public function.

Each ``require_*`` raises :class:`~jaxsane.ArgumentError` (a ``JaxsaneError`` that is also a
``TypeError`` and a ``ValueError``, so existing ``except`` clauses keep working) with the four
parts of a jaxsane message: what is wrong, where (``function(argument=...)``), the likely cause and
what to do. They return the value, normalised (``require_int`` gives a Python int), so a call site
reads ``steps = require_int("overfit", "steps", steps, min=1)``.

Host-side only: none of these may be called inside ``jit`` on traced values.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, overload

from .errors import ArgumentError


def show(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def message(fn: str, name: str, expected: str, value: Any, *, cause: str | None = None, fix: str | None = None) -> str:
    """The four-part text for a bad ``fn(name=value)``: what, where, likely cause, fix."""
    msg = f"{fn}({name}=...): expected {expected}, got {show(value)}."
    if cause:
        msg += f" Likely cause: {cause}."
    return msg + f" Fix: {fix or f'pass {name}= ' + expected}."


def fail(
    fn: str, name: str, expected: str, value: Any, *, cause: str | None = None, fix: str | None = None
) -> ArgumentError:
    """The :class:`ArgumentError` for ``fn(name=value)`` (returned, so the caller writes ``raise``)."""
    return ArgumentError(message(fn, name, expected, value, cause=cause, fix=fix))


def _is_int(value: Any) -> bool:
    if isinstance(value, numbers.Integral):
        return not isinstance(value, bool)
    return _scalar_kind(value) in ("i", "u")


def _is_real(value: Any) -> bool:
    if isinstance(value, numbers.Real):
        return not isinstance(value, bool)
    return _scalar_kind(value) in ("i", "u", "f")


def _scalar_kind(value: Any) -> str:
    """The dtype kind of a concrete 0-d array (numpy or jax), else ''. Tracers are refused: these checks
    run on the host."""
    dtype, shape = getattr(value, "dtype", None), getattr(value, "shape", None)
    if dtype is None or shape != () or type(value).__name__.endswith("Tracer"):
        return ""
    return getattr(dtype, "kind", "")


@overload
def require_int(
    fn: str,
    name: str,
    value: Any,
    *,
    min: int | None = None,
    max: int | None = None,
    optional: Literal[False] = False,
    fix: str | None = None,
) -> int: ...
@overload
def require_int(
    fn: str,
    name: str,
    value: Any,
    *,
    min: int | None = None,
    max: int | None = None,
    optional: bool = False,
    fix: str | None = None,
) -> int | None: ...
def require_int(
    fn: str,
    name: str,
    value: Any,
    *,
    min: int | None = None,
    max: int | None = None,
    optional: bool = False,
    fix: str | None = None,
) -> int | None:
    """``value`` as a Python int in ``[min, max]`` (None allowed when ``optional``). Not jit-safe."""
    if value is None and optional:
        return None
    bounds = _bounds(min, max)
    expected = f"an int{bounds}" + (" or None" if optional else "")
    if not _is_int(value):
        cause = None
        if isinstance(value, str):
            cause = "a number read from a config file or the command line was not converted"
        elif isinstance(value, float):
            cause = "a float where a count is needed (e.g. 3.5 steps)"
        raise fail(fn, name, expected, value, cause=cause, fix=fix)
    value = int(value)
    if (min is not None and value < min) or (max is not None and value > max):
        raise fail(fn, name, expected, value, cause="the value is out of range", fix=fix)
    return value


@overload
def require_float(
    fn: str,
    name: str,
    value: Any,
    *,
    min: float | None = None,
    max: float | None = None,
    positive: bool = False,
    optional: Literal[False] = False,
    fix: str | None = None,
) -> float: ...
@overload
def require_float(
    fn: str,
    name: str,
    value: Any,
    *,
    min: float | None = None,
    max: float | None = None,
    positive: bool = False,
    optional: bool = False,
    fix: str | None = None,
) -> float | None: ...
def require_float(
    fn: str,
    name: str,
    value: Any,
    *,
    min: float | None = None,
    max: float | None = None,
    positive: bool = False,
    optional: bool = False,
    fix: str | None = None,
) -> float | None:
    """``value`` as a finite Python float in ``[min, max]`` (``> 0`` when ``positive``). Not jit-safe."""
    if value is None and optional:
        return None
    bounds = " > 0" if positive else _bounds(min, max)
    expected = f"a finite number{bounds}" + (" or None" if optional else "")
    if not _is_real(value):
        cause = (
            "a number read from a config file or the command line was not converted" if isinstance(value, str) else None
        )
        raise fail(fn, name, expected, value, cause=cause, fix=fix)
    value = float(value)
    if (
        not math.isfinite(value)
        or (positive and value <= 0)
        or (min is not None and value < min)
        or (max is not None and value > max)
    ):
        raise fail(fn, name, expected, value, cause="the value is out of range", fix=fix)
    return value


def _bounds(lo: float | None, hi: float | None) -> str:
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    if lo is not None:
        return f" >= {lo}"
    if hi is not None:
        return f" <= {hi}"
    return ""


def require_bool(fn: str, name: str, value: Any) -> bool:
    """``value`` when it is a bool (numpy bools included). Not jit-safe."""
    if not isinstance(value, bool) and type(value).__name__ != "bool_":
        raise fail(
            fn,
            name,
            "True or False",
            value,
            cause="a string such as 'false' is truthy, so it would silently mean True"
            if isinstance(value, str)
            else None,
        )
    return bool(value)


def require_str(fn: str, name: str, value: Any, *, optional: bool = False, fix: str | None = None) -> str | None:
    """``value`` when it is a str (None allowed when ``optional``). Not jit-safe."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise fail(fn, name, "a str" + (" or None" if optional else ""), value, fix=fix)
    return value


def require_choice(fn: str, name: str, value: Any, choices: Sequence[Any]) -> Any:
    """``value`` when it is one of ``choices``. Not jit-safe."""
    try:
        ok = value in choices
    except TypeError:  # unhashable or incomparable
        ok = False
    if not ok:
        raise fail(
            fn, name, "one of " + ", ".join(map(repr, choices)), value, fix=f"pass {name}= one of {list(choices)}"
        )
    return value


def require_callable(fn: str, name: str, value: Any, *, signature: str = "", optional: bool = False) -> Any:
    """``value`` when it is callable (None allowed when ``optional``). Not jit-safe."""
    if value is None and optional:
        return None
    if not callable(value):
        what = "a callable" + (f" {signature}" if signature else "") + (" or None" if optional else "")
        cause = (
            "the result of calling the function was passed instead of the function itself"
            if value is not None
            else "the argument was left out"
        )
        raise fail(fn, name, what, value, cause=cause, fix=f"pass the function itself, e.g. {name}=my_fn")
    return value


@overload
def require_sequence(
    fn: str,
    name: str,
    value: Any,
    *,
    of: str = "number",
    min_len: int = 1,
    min: float | None = None,
    optional: Literal[False] = False,
) -> list: ...
@overload
def require_sequence(
    fn: str,
    name: str,
    value: Any,
    *,
    of: str = "number",
    min_len: int = 1,
    min: float | None = None,
    optional: bool = False,
) -> list | None: ...
def require_sequence(
    fn: str,
    name: str,
    value: Any,
    *,
    of: str = "number",
    min_len: int = 1,
    min: float | None = None,
    optional: bool = False,
) -> list | None:
    """``value`` as a list of ``of`` (``"number"``, ``"int"`` or ``"str"``) with at least ``min_len``
    items, each ``>= min`` when given; a str is refused (it would be iterated character by
    character). Not jit-safe."""
    if value is None and optional:
        return None
    each = f" >= {min}" if min is not None else ""
    expected = f"a non-empty sequence of {of}s" if min_len == 1 else f"a sequence of at least {min_len} {of}s"
    expected += each
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        cause = (
            "a str is iterated character by character; a comma-separated list was not split"
            if isinstance(value, str)
            else None
        )
        raise fail(fn, name, expected, value, cause=cause, fix=f"pass {name}=[...] (a list)")
    items = list(value)
    if len(items) < min_len:
        raise fail(fn, name, expected, value, cause="the sequence is empty", fix=f"pass {name}=[...] (a list)")
    for i, item in enumerate(items):
        if of == "str":
            ok = isinstance(item, str)
        else:
            ok = _is_int(item) if of == "int" else _is_real(item) and math.isfinite(float(item))
            ok = ok and (min is None or item >= min)
        if not ok:
            raise fail(fn, f"{name}[{i}]", f"a {of}{each}", item, fix=f"make every item of {name} a {of}{each}")
    return items


def require_count_or_list(fn: str, name: str, value: Any, *, of: str = "int") -> int | list:
    """``value`` as an int >= 1 (a count) or a non-empty list of ``of`` (e.g. ``seeds=4`` or
    ``seeds=[0, 7]``). Not jit-safe."""
    if _is_int(value):
        return require_int(fn, name, value, min=1)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise fail(
            fn,
            name,
            f"an int >= 1 or a list of {of}s",
            value,
            fix=f"pass {name}=N (a count) or {name}=[...] (a list of {of}s)",
        )
    return require_sequence(fn, name, value, of=of)


def require_same_rows(fn: str, name_a: str, a: Any, name_b: str, b: Any) -> None:
    """Both ``a`` and ``b`` have the same leading (example) size. Not jit-safe."""
    na, nb = _rows(a), _rows(b)
    if na is not None and nb is not None and na != nb:
        raise ArgumentError(
            f"{fn}: {name_a} has {na} examples but {name_b} has {nb} (leading axis). Likely cause: the two were "
            f"sliced or batched differently, or {name_b} belongs to another batch. Fix: pass one {name_b} per "
            f"example of {name_a}."
        )


def _rows(x: Any) -> int | None:
    import jax  # jaxsane imports jax anyway; kept local so this module stays light

    sizes = [leaf.shape[0] for leaf in jax.tree_util.tree_leaves(x) if getattr(leaf, "ndim", 0) >= 1]
    return sizes[0] if sizes else None


def is_prng_key(value: Any) -> bool:
    """True for a concrete or traced PRNG key: a typed key array (``jax.random.key``) or a raw ``uint32`` key of
    shape ``(..., 2)`` (``jax.random.PRNGKey``). Jit-safe (reads dtype and shape only)."""
    import jax

    dtype, shape = getattr(value, "dtype", None), getattr(value, "shape", None)
    if dtype is None or shape is None or isinstance(value, (bool, int, float, complex)):
        return False
    try:
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            return True
    except TypeError:
        return False
    return str(dtype) == "uint32" and tuple(shape)[-1:] == (2,)


def require_batch(fn: str, name: str, value: Any) -> Any:
    """``value`` when it is a batch: a pytree (dict, tuple, list, dataclass) whose leaves are numeric or bool
    arrays or Python numbers, with at least one leaf. Not jit-safe (it reads leaf types on the host)."""
    import jax  # jaxsane imports jax anyway; kept local so this module stays light

    expected = "a batch: a pytree (dict, tuple) of numeric arrays"
    try:
        leaves = jax.tree_util.tree_leaves_with_path(value)
    except Exception as e:  # a pytree node whose flatten raises
        raise fail(fn, name, expected, value, cause=f"it cannot be flattened as a pytree ({type(e).__name__})") from e
    if not leaves:
        raise fail(fn, name, expected, value, cause="it has no array leaves")
    for path, leaf in leaves:
        where = f"{name}{jax.tree_util.keystr(path)}"
        what = expected if where == name else "a numeric array"
        if isinstance(leaf, (str, bytes)):
            raise fail(fn, where, what, leaf, cause="text that was not tokenized or encoded to numbers")
        kind = getattr(getattr(leaf, "dtype", None), "kind", None)
        number = isinstance(leaf, (bool, int, float, complex, numbers.Number))
        if (kind is None and not number) or (kind is not None and kind not in "biufcV"):
            raise fail(
                fn,
                where,
                what,
                leaf,
                cause="an object or string leaf (ragged rows, a Python list left unconverted)",
                fix="convert it with np.asarray(..., dtype) (pad ragged rows first)",
            )
    return value


def require_writable_file(fn: str, name: str, path: Any) -> str:
    """``path`` (str or os.PathLike) whose parent directory exists and is writable, and which is not a
    directory. Not jit-safe."""
    if not isinstance(path, (str, os.PathLike)):
        raise fail(fn, name, "a file path (str or os.PathLike)", path)
    path = os.fspath(path)
    if not path:
        raise fail(fn, name, "a non-empty file path", path)
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ArgumentError(
            f"{fn}({name}={path!r}): the path is a directory, not a file. Fix: name a file "
            f"inside it, e.g. {os.path.join(path, 'report.html')!r}."
        )
    if not os.path.isdir(parent):
        raise ArgumentError(
            f"{fn}({name}={path!r}): the parent directory {parent!r} does not exist. Likely "
            "cause: a typo in the path, or the output directory was never created. Fix: create it "
            "first (os.makedirs(parent, exist_ok=True)) or choose an existing directory."
        )
    if not os.access(parent, os.W_OK):
        raise ArgumentError(
            f"{fn}({name}={path!r}): the directory {parent!r} is not writable. Fix: choose a "
            "directory you can write to."
        )
    return path


# ----------------------------------------------------------------------------- one on_nonfinite vocabulary

#: What a tool does with a step whose outputs hold NaN/Inf (``on_nonfinite=``). One word means one thing in
#: every tool that accepts it; a tool accepts the words it can carry out (``guard``: raise/skip/warn, default
#: raise; ``fit``: rollback/skip/raise, default rollback).
NONFINITE_POLICIES = {
    "raise": "stop with NonFiniteError, which carries the Finding",
    "skip": "drop the failing step's update (the state from before it is kept, selected in-graph) and go on",
    "warn": "issue a JaxsaneWarning and keep the step's result as it is",
    "rollback": "restore the last verified state, replay the good batches since then and skip the failing one",
}
#: The words of :data:`NONFINITE_POLICIES` that ``guard`` and ``fit`` carry out, in the order their errors list them.
GUARD_POLICIES: tuple[str, ...] = ("raise", "skip", "warn")
FIT_POLICIES: tuple[str, ...] = ("rollback", "skip", "raise")
_WHY_NOT = {
    "warn": "a training loop cannot go on from a non-finite state (every later step would be NaN too)",
    "rollback": "a rollback needs the verified host copies of the state that only fit keeps",
}


#: Words a tool takes only through ``JAXSANE_ON_NONFINITE`` (like equinox's ``EQX_ON_ERROR=breakpoint``), never as
#: an ``on_nonfinite=`` argument: a debugger stop is a choice for one interactive run; written into the code it would
#: leave an unattended job waiting for input.
ENV_ONLY_POLICIES = {
    "breakpoint": "open a post-mortem debugger (pdb) at the origin of the first non-finite step, in the user's own "
    "line, then raise NonFiniteError as 'raise' does",
}


def require_policy(fn: str, value: Any, allowed: Sequence[str], error: type = ArgumentError) -> str:
    """``value`` if it is one of ``allowed`` on_nonfinite policies, else ``error`` naming each allowed word
    and its meaning (and, for a word another tool accepts, why this one does not). Host-side."""
    if isinstance(value, str) and value in allowed:
        return value
    valid = "; ".join(f"{p!r}: {NONFINITE_POLICIES[p]}" for p in allowed)
    if isinstance(value, str) and value in ENV_ONLY_POLICIES:
        cause = (
            f"{value!r} is taken only from the environment, {ON_NONFINITE_ENV}={value} (for one interactive "
            "run: written into the code, a debugger stop would leave an unattended job waiting for input)"
        )
    elif isinstance(value, str) and value in _WHY_NOT:
        cause = f"{value!r} is another tool's policy, and {fn} cannot carry it out: {_WHY_NOT[value]}"
    else:
        cause = "a misspelt policy" if isinstance(value, str) else "a flag or a number was passed instead of a policy"
    raise error(
        f"on_nonfinite must be one of {', '.join(map(repr, allowed))} in {fn}(...), got {show(value)}. "
        f"Likely cause: {cause}. Fix: pass one of them ({valid})."
    )


#: Overrides guard's ``on_nonfinite`` without code changes (as ``EQX_ON_ERROR`` does for equinox), e.g.
#: ``JAXSANE_ON_NONFINITE=raise python train.py`` to stop at the first NaN of a run written to skip them, or
#: ``JAXSANE_ON_NONFINITE=breakpoint python train.py`` to debug it where it is born.
ON_NONFINITE_ENV = "JAXSANE_ON_NONFINITE"


def policy_from_env(
    fn: str, value: str, allowed: Sequence[str], error: type = ArgumentError, env_only: Sequence[str] = ()
) -> str:
    """``$JAXSANE_ON_NONFINITE`` when it is set and not empty, else ``value`` (the ``on_nonfinite=`` argument).

    Read when the step is wrapped, so a change of the variable later does not change a wrapped step.
    ``env_only``: the words of :data:`ENV_ONLY_POLICIES` that ``fn`` carries out (``guard``: ``breakpoint``).
    Host-side.

    Raises:
      error: the variable holds a word ``fn`` cannot carry out, naming the valid words.
    """
    setting = os.environ.get(ON_NONFINITE_ENV, "").strip()
    if not setting:
        return value
    if setting in env_only:
        return setting
    valid = ", ".join(map(repr, (*allowed, *env_only)))
    unset = f"set {ON_NONFINITE_ENV} to one of {valid}, or unset it to use the on_nonfinite= argument ({value!r})"
    if setting not in allowed:
        cause = (
            f"{setting!r} is another tool's policy, and {fn} cannot carry it out: {_WHY_NOT[setting]}"
            if setting in _WHY_NOT
            else f"{fn} does not stop in a debugger"
            if setting in ENV_ONLY_POLICIES
            else "a misspelt policy"
        )
        raise error(
            f"{ON_NONFINITE_ENV}={setting!r} is not a policy of {fn} (valid: {valid}). "
            f"Likely cause: {cause}. Fix: {unset}."
        )
    return setting
