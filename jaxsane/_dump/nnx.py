"""Flax NNX objects in dumps: how a dump records them, and how they come back as real objects.

A guarded NNX step ``train_step(model, optimizer, batch)`` is dumped with each NNX object as its pure
``nnx.State`` (split jointly, as the guard ran it). The dump also records, as data, which positional
arguments were NNX objects and their classes' names (``{"arg": 0, "class": "mymodel.MLP"}`` under the
description's ``"nnx"`` key): for messages only, never imported. A class cannot be rebuilt from data,
so the objects come back only from templates the user builds in their own code:

- ``load_dump(path, like=(model, optimizer, batch))``: live NNX objects in ``like=`` give their
  ``graphdef``; the dumped state is merged into fresh objects (``nnx.merge``), the templates are not
  touched (:func:`nnx_templates`);
- without templates the states come back as :class:`NNXStateShape` (a dict of the state that says, when
  it is used as the object, how to get the object back) and ``locate`` / ``replay`` refuse them with
  :func:`objects_error`.

Nothing here imports, calls or evaluates a name found in a dump. Not jit-safe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._core.errors import DumpError, DumpShapeError
from .._experiment.purify import is_nnx_object, nnx_module

_STATE_SUFFIX = ":State"  # a dumped nnx.State node's recorded type ends so (flax.nnx.statelib:State)


def class_name(obj: Any) -> str:
    """``module.qualname`` of ``obj``'s class, shortened to ``flax.nnx.Name`` for flax's public classes
    (``flax.nnx.Optimizer``). Only for messages. Not jit-relevant."""
    cls = type(obj)
    if cls.__module__.startswith("flax.nnx"):
        try:
            if getattr(nnx_module(), cls.__qualname__, None) is cls:
                return f"flax.nnx.{cls.__qualname__}"
        except ImportError:  # pragma: no cover
            pass
    return f"{cls.__module__}.{cls.__qualname__}"


def split_for_dump(args: tuple) -> tuple[tuple, list[dict]]:
    """``(args, records)``: the NNX objects among ``args`` replaced by their pure ``nnx.State`` (split
    together, so shared variables are kept once, as a guarded step runs them) and one record
    ``{"arg": position, "class": name}`` per object. ``args`` without NNX objects come back as they are.
    The objects are not modified. Not jit-safe."""
    positions = [i for i, a in enumerate(args) if is_nnx_object(a)]
    if not positions:
        return tuple(args), []
    _, state = nnx_module().split(tuple(args[i] for i in positions))
    out = list(args)
    for k, p in enumerate(positions):
        out[p] = state[k]
    return tuple(out), records_for(positions, [args[p] for p in positions])


def records_for(positions: tuple | list, objects: tuple | list) -> list[dict]:
    """The dump's ``"nnx"`` records of NNX ``objects`` at argument ``positions``. Not jit-safe."""
    return [{"arg": int(p), "class": class_name(o)} for p, o in zip(positions, objects)]


def read_records(meta: dict, args_node: dict, where: str) -> dict[int, str]:
    """``{position: class name}`` of the NNX objects a dump holds, from its ``"nnx"`` records (a dump
    written before records were kept has none: its states read as generic dicts, as they always did).
    Raises DumpError for a malformed record. Nothing is imported."""
    n = len(args_node["c"])
    found: dict[int, str] = {}
    records = meta.get("nnx")
    if records is not None:
        if not isinstance(records, list) or len(records) > n:
            raise DumpError(f"{where} is malformed at nnx: expected a list of at most {n} records.")
        for r in records:
            if (
                not isinstance(r, dict)
                or type(r.get("arg")) is not int
                or not 0 <= r["arg"] < n
                or not isinstance(r.get("class"), str)
                or len(r["class"]) > 500
            ):
                raise DumpError(
                    f"{where} is malformed at nnx: each record is {{'arg': a position below {n}, 'class': a name}}."
                )
            if not is_state_node(args_node["c"][r["arg"]]):
                raise DumpError(
                    f"{where} is malformed at nnx: args[{r['arg']}] is recorded as an NNX object but "
                    "its data is not an nnx.State."
                )
            found[r["arg"]] = r["class"]
    return dict(sorted(found.items()))


def is_state_node(node: dict) -> bool:
    """True for a dumped ``nnx.State`` node (by its recorded type string only)."""
    t = node.get("type")
    return node.get("t") == "node" and isinstance(t, str) and t.startswith("flax.nnx") and t.endswith(_STATE_SUFFIX)


def objects_error(path: str, objects: dict[int, str], names: list[str] | None = None) -> DumpError:
    """The DumpError that says a dump's NNX objects need templates, and the three ways to give them."""
    names = [n for n in (names or []) if isinstance(n, str) and n.isidentifier()]
    listed = ", ".join(f"args[{p}]: {c}" for p, c in objects.items())
    like = (
        ", ".join(names)
        if len(names) > max(objects)
        else ", ".join(f"<args[{p}]>" for p in range(max(objects) + 1)) + ", ..."
    )
    return DumpError(
        f"[jaxsane] the dump at {path} holds NNX objects ({listed}); their classes cannot be rebuilt from data "
        f"(a dump never imports a class). Pass like=({like}) built as in your training script to "
        "jaxsane.load_dump, or replay with --step module:experiment, or --like module:make_objects (a "
        "zero-argument function returning those objects)."
    )


class NNXStateShape(dict):
    """The dumped ``nnx.State`` of an NNX object, read without a template: a dict you can inspect
    (``state['l1']['kernel']``) that refuses to be used as the object itself (a call or an attribute
    raises :class:`~jaxsane.DumpShapeError` saying how to get the object back). A pytree like a dict."""

    __slots__ = ("_jaxsane_message",)

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise DumpShapeError(f"{self._jaxsane_message} (asked for attribute {attr!r} of this dumped state)")

    def __call__(self, *args, **kwargs):
        raise DumpShapeError(f"{self._jaxsane_message} (this dumped state was called as the object)")


def _flatten(s: NNXStateShape):
    keys = sorted(dict.keys(s), key=lambda k: (isinstance(k, str), k))
    return [(jax.tree_util.DictKey(k), dict.__getitem__(s, k)) for k in keys], (tuple(keys), s._jaxsane_message)


def _unflatten(aux, children) -> NNXStateShape:
    return standin(dict(zip(aux[0], children)), aux[1])


jax.tree_util.register_pytree_with_keys(NNXStateShape, _flatten, _unflatten)


def standin(state: Any, message: str) -> NNXStateShape | Any:
    """``state`` (a dict read from a dump) as an :class:`NNXStateShape` carrying ``message``."""
    if not isinstance(state, dict):
        return state
    s = NNXStateShape(state)
    object.__setattr__(s, "_jaxsane_message", message)
    return s


def find_standins(args: tuple) -> list[int]:
    """The positions of :class:`NNXStateShape` stand-ins among ``args``. Not jit-relevant."""
    return [i for i, a in enumerate(args) if isinstance(a, NNXStateShape)]


def standin_message(args: tuple) -> str | None:
    """The message of the first stand-in among ``args`` (it names the dump and every object), or None."""
    for a in args:
        if isinstance(a, NNXStateShape):
            return a._jaxsane_message
    return None


def nnx_templates(like_args: tuple, args_node: dict) -> tuple[tuple, Callable[[list], list]]:
    """``(templates, finish)`` for ``load_dump(like=...)`` holding live NNX objects.

    Each NNX object of ``like_args`` at a position where the dump holds an ``nnx.State`` is replaced by its
    ``nnx.State`` (split together, as the guard dumps them), the pytree the dump's data fits;
    ``finish(args)`` then merges the loaded states into fresh objects (``nnx.merge`` with the templates'
    ``graphdef``), leaving the templates untouched. Other NNX objects (one nested in a tuple, dumped as
    a pytree node) stay templates as they are. Not jit-safe.
    """
    kids = args_node["c"]
    positions = [p for p, a in enumerate(like_args) if is_nnx_object(a) and p < len(kids) and is_state_node(kids[p])]
    if not positions:
        return like_args, lambda args: args
    nnx = nnx_module()
    graphdef, state = nnx.split(tuple(like_args[p] for p in positions))
    templates = list(like_args)
    for k, p in enumerate(positions):
        templates[p] = state[k]
    full_def = jax.tree_util.tree_structure(state)

    def finish(args: list) -> list:
        leaves = [x for p in positions for x in jax.tree_util.tree_leaves(args[p])]
        objs = nnx.merge(graphdef, jax.tree_util.tree_unflatten(full_def, leaves))
        args = list(args)
        for p, obj in zip(positions, objs):
            args[p] = obj
        return args

    return tuple(templates), finish


__all__ = [
    "NNXStateShape",
    "class_name",
    "find_standins",
    "is_state_node",
    "nnx_templates",
    "objects_error",
    "read_records",
    "records_for",
    "split_for_dump",
    "standin",
    "standin_message",
]
