"""Checkpoints and metrics files for :func:`jaxsane.fit` that survive damage, kills and full disks.

- Each checkpoint's JSON ``meta`` item (written by orbax in the same atomic step directory as the arrays)
  carries a crc32 of every state leaf's bytes and the run's metric history. On resume the checkpoints are
  verified newest first (readable, every item present, checksums equal, every float finite) and the newest
  intact one is used; damaged newer ones are renamed aside (``<step>.jaxsane-damaged``), never deleted.
- ``metrics.jsonl`` is append-only with flush + fsync per batch of records, and at resume it is replaced
  atomically (temp file + ``os.replace``) by the history stored in the restored checkpoint.
- A write that fails for lack of space or permission becomes a :class:`~jaxsane.CheckpointError` that names
  the last complete checkpoint.

Nothing here is jit-safe: it all runs on the host.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import threading
import time
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.errors import CheckpointError
from .._core.history import History
from .._core.tree import PyTree, is_key, leaves_with_paths

DAMAGED_SUFFIX = ".jaxsane-damaged"


def leaf_checksum(x: Any) -> str | None:
    """crc32 of a leaf's dtype, shape and bytes as 8 hex digits; None for arrays not on this host. Not jit-safe."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return None
    a = np.ascontiguousarray(np.asarray(x))
    crc = zlib.crc32(f"{a.dtype.str}{a.shape}".encode())
    data = a.view(np.uint8).reshape(-1) if a.size else b""
    return f"{zlib.crc32(data, crc):08x}"  # type: ignore[arg-type]  # numpy's stubs: ndarray is a Buffer


def _nonfinite_leaf(leaves: list, paths: list[str]) -> str | None:
    for path, x in zip(paths, leaves):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            continue
        a = np.asarray(x)
        if np.issubdtype(a.dtype, np.inexact) and not np.isfinite(a).all():
            return path
    return None


class _DiskErrorLogFilter(logging.Filter):
    """Drops orbax's own ERROR records (with their tracebacks, one per background thread) about a write that
    failed for lack of space or permission: fit raises one CheckpointError that says it all."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or "orbax" not in (record.pathname or ""):
            return True
        error = record.exc_info[1] if record.exc_info else None
        found = _find_oserror(error) if error is not None else None
        if found is None:
            found = _find_oserror(RuntimeError(record.getMessage()))  # "[Errno 28] ..." in the message
            if found is None and "[Errno " in record.getMessage():
                return False
        return found is None or found.errno not in _DISK_HINTS


def join_background_saves(timeout: float = 120.0) -> None:
    """Wait for orbax's save threads that are still running. A composite save whose one item failed leaves the
    other items' commits running; raising past them, the interpreter would exit under them (``ImportError:
    sys.meta_path is None``, ``cannot schedule new futures after interpreter shutdown``). Not jit-safe."""
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread is threading.current_thread() or not thread.is_alive():
            continue
        if type(thread).__module__.startswith("orbax."):
            thread.join(max(0.0, deadline - time.monotonic()))


class Checkpoints:
    """orbax ``CheckpointManager`` over the flattened pure state plus a JSON ``meta`` item (loop state,
    per-leaf checksums, metric history). Not jit-safe."""

    def __init__(self, directory: str, keep: int, like: PyTree):
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, save_interval_steps=1, enable_async_checkpointing=True, cleanup_tmp_directories=True
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self._log_filter = _DiskErrorLogFilter()
        logging.getLogger("absl").addFilter(self._log_filter)
        leaves, self.treedef = jax.tree_util.tree_flatten(like)
        self.paths = [p for p, _ in leaves_with_paths(like, "state")]
        self.key_impls = [jax.random.key_impl(x) if is_key(x) else None for x in leaves]
        self.abstract = [ocp.utils.to_shape_dtype_struct(jnp.asarray(x)) for x in self._encode(leaves)]

    def _encode(self, leaves: list) -> list:
        return [jax.random.key_data(x) if impl is not None else x for x, impl in zip(leaves, self.key_impls)]

    def steps(self) -> list[int]:
        """Finalized checkpoint steps on disk, oldest first (orbax's own listing)."""
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: PyTree, meta: dict) -> None:
        """Save asynchronously; an OSError (now or from the previous async save) becomes a CheckpointError."""
        leaves = self._encode(jax.tree_util.tree_leaves(state))
        meta = {**meta, "checksums": [leaf_checksum(x) for x in leaves]}
        args = self.ocp.args.Composite(
            state=self.ocp.args.StandardSave(leaves), meta=self.ocp.args.JsonSave(_json_safe(meta))
        )
        try:
            self.manager.save(step, args=args, force=True)
        except Exception as e:
            raise self.write_error(
                e, f"checkpoint of step {step} (or of the one before it, still being written in the background)"
            ) from e

    def restore(self, step: int) -> tuple[PyTree, dict]:
        """Restore ``step`` as saved (no verification; see :meth:`restore_verified`)."""
        args = self.ocp.args.Composite(
            state=self.ocp.args.StandardRestore(self.abstract), meta=self.ocp.args.JsonRestore()
        )
        out = self.manager.restore(step, args=args)
        leaves = [
            jax.random.wrap_key_data(x, impl=impl) if impl is not None else x
            for x, impl in zip(out.state, self.key_impls)
        ]
        return jax.tree_util.tree_unflatten(self.treedef, leaves), dict(out.meta)

    def verify(self, step: int) -> tuple[PyTree, dict] | str:
        """``(state, meta)`` of ``step`` when it is intact, else the reason it is not."""
        try:
            state, meta = self.restore(step)
        except Exception as e:  # orbax/tensorstore raise many types for unreadable data
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            return f"cannot be restored ({type(e).__name__}: {first})"
        if not isinstance(meta, dict) or not isinstance(meta.get("position"), int):
            return "its meta item has no loop position"
        encoded = self._encode(jax.tree_util.tree_leaves(state))
        sums = meta.get("checksums")
        if sums is not None:
            if not isinstance(sums, list) or len(sums) != len(encoded):
                count = len(sums) if isinstance(sums, list) else "no"
                return f"its checksum list has {count} entries for {len(encoded)} leaves"
            for path, x, want in zip(self.paths, encoded, sums):
                got = leaf_checksum(x) if want is not None else None
                if got != want:
                    return f"checksum mismatch at {path} (saved {want}, read {got})"
        bad = _nonfinite_leaf(encoded, self.paths)
        if bad is not None:
            return f"{bad} holds NaN/Inf (a checkpoint is only written from a finite state)"
        return state, meta

    def restore_verified(self, only: int | None = None) -> tuple[int, PyTree, dict, list[tuple[int, str]]]:
        """The newest intact checkpoint (or exactly ``only``): ``(step, state, meta, skipped)`` where ``skipped``
        lists ``(step, reason)`` of the newer damaged ones, which are renamed aside so that new checkpoints can
        take their step numbers. Raises CheckpointError, changing no file, when none is intact."""
        skipped: list[tuple[int, str]] = []
        for step in [only] if only is not None else reversed(self.steps()):
            out = self.verify(step)
            if isinstance(out, str):
                skipped.append((step, out))
                continue
            if only is None:
                self._set_aside([s for s, _ in skipped])
            return step, out[0], out[1], skipped
        listing = "\n".join(f"  step {s}: {why}" for s, why in skipped)
        raise CheckpointError(
            f"no intact checkpoint in {self.directory}:\n{listing}\n  No file was changed or deleted. "
            "fix: restore the directory from a backup, or start afresh with another checkpoint_dir "
            "(or move this one away).",
            skipped=skipped,
        )

    def _set_aside(self, steps: list[int]) -> None:
        for step in steps:
            src = os.path.join(self.directory, str(step))
            dst, n = src + DAMAGED_SUFFIX, 1
            while os.path.exists(dst):
                dst, n = f"{src}{DAMAGED_SUFFIX}.{n}", n + 1
            os.rename(src, dst)
        if steps:
            self.manager.reload()

    def write_error(self, error: BaseException, what: str) -> BaseException:
        """A CheckpointError for a failed write (when ``error`` comes from an OSError), else ``error``."""
        try:  # saves still in flight may complete: count them
            self.manager.wait_until_finished()
        except Exception:
            pass
        join_background_saves()  # no save thread outlives the error (it would die noisily at exit)
        return disk_error(error, what, self.directory, self.complete_steps())

    def complete_steps(self) -> list[int]:
        """Step directories orbax finished writing (they hold ``_CHECKPOINT_METADATA``), oldest first."""
        try:
            return sorted(
                int(d)
                for d in os.listdir(self.directory)
                if d.isdigit() and os.path.exists(os.path.join(self.directory, d, "_CHECKPOINT_METADATA"))
            )
        except OSError:
            return []

    def close(self) -> None:
        """Wait for the last async save and close; an OSError from that save becomes a CheckpointError."""
        try:
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
        except Exception as e:
            raise self.write_error(e, "the last checkpoint") from e
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Close the manager without checking the last save; no save thread is left running after it."""
        try:
            self.manager.close()
        finally:
            join_background_saves()
            logging.getLogger("absl").removeFilter(self._log_filter)


_TS_OS_ERROR = re.compile(r"os_error_code='?(\d+)")


def _find_oserror(error: BaseException | None) -> OSError | None:
    """The OSError behind ``error`` (its cause chain), also when tensorstore reported it as a ValueError
    (``RESOURCE_EXHAUSTED: ... [os_error_code='28']``)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and not isinstance(error, CheckpointError):
            return error
        match = _TS_OS_ERROR.search(str(error))
        if match:
            code = int(match.group(1))
            return OSError(code, f"{os.strerror(code)}: {str(error).splitlines()[0][:200]}")
        error = error.__cause__ or error.__context__
    return None


_DISK_HINTS = {
    errno.ENOSPC: "the disk is full",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.ENOTDIR: "a path component is a regular file",
}


def disk_error(
    error: BaseException, what: str, directory: str | None, complete: list[int] | None = None
) -> BaseException:
    """Turn a failed write into a CheckpointError naming the cause and the last complete checkpoint; an
    error not caused by an OSError is returned unchanged."""
    os_error = _find_oserror(error)
    if os_error is None:
        return error
    code = os_error.errno
    cause = _DISK_HINTS.get(code, os.strerror(code) if code else str(os_error)) if code is not None else str(os_error)
    last = (
        f"the last complete checkpoint is step {complete[-1]} in {directory}"
        if complete
        else "no checkpoint was completed"
        if directory
        else "no checkpoint_dir was given"
    )
    return CheckpointError(
        f"fit stopped: writing the {what} failed: {cause} ({type(os_error).__name__}: {os_error}).\n"
        f"  {last}; files written before are untouched.\n"
        "  fix: free space or fix the permissions (or pass another checkpoint_dir/metrics_path), then call fit "
        "again with the same arguments to resume.",
        skipped=[],
    )


# ----------------------------------------------------------------------------- metrics files


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (np.generic, np.ndarray)):
        return _json_safe(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def append_lines(path: str, lines: list[str]) -> None:
    """Append ``lines`` to ``path`` and fsync: a crash leaves at most one partial last line. Not jit-safe."""
    with open(path, "a") as fh:
        fh.write("".join(line + "\n" for line in lines))
        fh.flush()
        os.fsync(fh.fileno())


def replace_lines(path: str, lines: list[str]) -> None:
    """Atomically replace ``path`` by ``lines`` (temp file in the same directory, fsync, ``os.replace``):
    a kill leaves the old file or the new one, never half of either. Not jit-safe."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            fh.write("".join(line + "\n" for line in lines))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    try:  # make the rename itself durable
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def history_from_meta(meta: dict, before: int) -> History | None:
    """The metric history stored in a checkpoint's meta (steps ``< before``), or None for older checkpoints."""
    stored = meta.get("history")
    if not isinstance(stored, dict):
        return None
    try:
        return truncate_history(History.from_dict(stored), before)
    except (TypeError, ValueError):
        return None


def truncate_history(h: History, position: int) -> History:
    """Drop in place what ``h`` recorded for steps ``>= position`` (evaluations ``> position``); returns ``h``."""

    def cut(steps: list, inclusive: bool) -> int:
        return sum(1 for s in steps if (s <= position if inclusive else s < position))

    k = cut(h.steps, False)
    del h.steps[k:], h.loss[k:]
    for v in h.train_metrics.values():
        del v[k:]
    k = cut(h.tele_steps, False)
    del h.tele_steps[k:], h.param_norm[k:], h.update_norm[k:]
    k = cut(h.grad_steps, False)
    del h.grad_steps[k:], h.grad_norm[k:]
    k = cut(h.dead_steps, False)
    del h.dead_steps[k:], h.dead_fraction[k:]
    k = cut(h.lost_steps, False)
    del h.lost_steps[k:], h.update_lost[k:]
    k = cut(h.eval_steps, True)
    del h.eval_steps[k:], h.eval_loss[k:]
    for v in h.eval_metrics.values():
        del v[k:]
    return h


def history_json(h: History) -> dict:
    """``h`` as JSON-able data (NaN/Inf as null) for a checkpoint's meta item."""
    return _json_safe(h.to_dict())


def dumps(record: dict) -> str:
    return json.dumps(_json_safe(record))
