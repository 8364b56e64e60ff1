"""JAX's persistent compilation cache under a jaxsane directory, so a second ``doctor`` on unchanged
code loads its compiled programs from disk instead of compiling them again.

The directory is, in order: the ``directory`` argument, ``$JAXSANE_CACHE_DIR``, then
``$XDG_CACHE_HOME/jaxsane/xla`` (``~/.cache/jaxsane/xla``). ``JAXSANE_CACHE=0`` (or ``directory=False``)
turns it off. A cache the user configured themselves (``jax_compilation_cache_dir``) is left as it is.
Not jit-safe.
"""

from __future__ import annotations

import os
import warnings

import jax

_ENABLED_BY_JAXSANE: list[str] = []


def default_cache_dir() -> str:
    """``$JAXSANE_CACHE_DIR``, else ``$XDG_CACHE_HOME/jaxsane/xla`` (``~/.cache/jaxsane/xla``)."""
    explicit = os.environ.get("JAXSANE_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxsane", "xla")


def cache_disabled_by_env() -> bool:
    return os.environ.get("JAXSANE_CACHE", "1").strip().lower() in ("0", "false", "no", "off")


def enable_compilation_cache(directory: str | bool | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache; return the directory in use, or None when off.

    Args:
      directory: where to keep compiled programs (default: see the module docstring); ``False`` turns
        the cache off for this call.

    Programs compiled before the first call are not cached; jaxsane calls this at the start of
    ``doctor``. A directory that cannot be created turns the cache off with a warning (the checks
    run as before, only slower). Not jit-safe.
    """
    if directory is False or (directory is None and cache_disabled_by_env()):
        return None
    configured = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # a flag jax sets at run time; not in its stubs
    if configured and configured not in _ENABLED_BY_JAXSANE:
        return configured  # the user's own cache: leave it alone
    path = os.path.abspath(os.path.expanduser(str(directory) if directory not in (None, True) else default_cache_dir()))
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is not writable")
    except OSError as e:
        warnings.warn(
            f"[jaxsane] the compilation cache is off: cannot use {path} ({e}); set JAXSANE_CACHE_DIR to "
            "a writable directory or JAXSANE_CACHE=0 to silence this",
            stacklevel=2,
        )
        return None
    if configured != path:
        jax.config.update("jax_compilation_cache_dir", path)
    # doctor compiles many small programs: cache them all, however quick their compile
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _reset_if_decided_without_cache()
    _ENABLED_BY_JAXSANE.append(path)
    return path


def _reset_if_decided_without_cache() -> None:
    """JAX decides once, at its first compile, whether a cache is in use; a compile that happened
    before the directory was set (at the user's module import, say) decided "no". Ask again."""
    try:
        from jax._src import compilation_cache  # private: the public API has no "decide again"
    except ImportError:
        return
    if not compilation_cache.is_initialized():
        compilation_cache.reset_cache()
