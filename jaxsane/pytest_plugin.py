"""The jaxsane pytest plugin: simulated CPU devices and fixtures for the common checks.

Installed with jaxsane (entry point ``pytest11``; without installing, load it with ``-p
jaxsane.pytest_plugin``). It does nothing unless asked:

* ``--jaxsane-devices=N`` (or ``jaxsane_devices = N`` in the pytest ini file) makes XLA's CPU platform
  show ``N`` devices, set in ``pytest_configure`` before jax initialises its backend, through
  ``chex.set_n_cpu_devices`` (which writes ``XLA_FLAGS=--xla_force_host_platform_device_count=N``). When
  something already initialised the backend with another count, pytest stops with a usage error that says
  what to move.
* ``@pytest.mark.jaxsane_devices(N)`` skips a test unless at least ``N`` devices are visible, saying
  which option to pass.
* fixtures: ``jaxsane_check`` is :mod:`jaxsane.testing` (``jaxsane_check.assert_grads_match(...)``,
  ``assert_init_ok``, ``assert_step_ok``, ``assert_batch_independent``, ``assert_compiles_once``);
  ``jaxsane_guard(step, **kw)`` wraps a step with :func:`jaxsane.guard` (``sync=True`` by default, so
  the failing call raises) and flushes every guard it made when the test ends, so no NaN goes unheard.

jax is imported only when one of these is used, never when the plugin is loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

OPTION = "--jaxsane-devices"
INI = "jaxsane_devices"
MARKER = "jaxsane_devices"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("jaxsane")
    group.addoption(
        OPTION,
        dest="jaxsane_devices",
        type=int,
        default=None,
        metavar="N",
        help="simulate N CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N), set "
        "before jax initialises its backend",
    )
    parser.addini(INI, "simulate this many CPU devices (as --jaxsane-devices)", default="")


def requested_devices(config: pytest.Config) -> int | None:
    """The device count asked for on the command line, else in the ini file, else None."""
    n = config.getoption("jaxsane_devices")
    if n is None:
        text = str(config.getini(INI)).strip()
        if not text:
            return None
        try:
            n = int(text)
        except ValueError:
            raise pytest.UsageError(
                f"[jaxsane] ini option {INI} = {text!r} is not an int. Fix: set it to the "
                "number of CPU devices to simulate, e.g. 8, or remove it."
            ) from None
    if n < 1:
        raise pytest.UsageError(f"[jaxsane] {OPTION}={n}: the device count must be >= 1. Fix: pass e.g. {OPTION}=8.")
    return n


def set_cpu_devices(n: int) -> None:
    """Make XLA's CPU platform show ``n`` devices; a :class:`pytest.UsageError` when it is too late."""
    import chex  # imports jax, which is fine: importing jax does not initialise its backend

    try:
        chex.set_n_cpu_devices(n)
    except RuntimeError as e:
        raise pytest.UsageError(
            f"[jaxsane] {OPTION}={n}: jax's CPU backend was already initialised with another device count "
            f"before pytest_configure ({e}). Likely cause: a conftest.py or plugin ran a jax operation at import "
            f"(jax.devices(), jnp.ones(...), a jitted call). Fix: move that into a fixture, or start pytest with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n}."
        ) from None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}(n): skip unless at least n jax devices are visible (run with {OPTION}=n)"
    )
    n = requested_devices(config)
    if n is not None:
        set_cpu_devices(n)


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return
    need = int(marker.args[0]) if marker.args else int(marker.kwargs.get("n", 1))
    import jax

    have = jax.device_count()
    if have < need:
        pytest.skip(f"needs {need} jax devices, {have} visible: run pytest with {OPTION}={need}")


@pytest.fixture
def jaxsane_check():
    """:mod:`jaxsane.testing`: ``jaxsane_check.assert_grads_match(f, *args)`` and its siblings."""
    from . import testing

    return testing


@pytest.fixture
def jaxsane_guard() -> Iterator[Callable[..., Any]]:
    """``jaxsane_guard(step, **kw)`` -> a guarded step (``sync=True`` unless given); flushed at teardown."""
    from . import guard

    made: list[Any] = []

    def make(step: Callable, **kwargs: Any) -> Any:
        kwargs.setdefault("sync", True)
        guarded = guard(step, **kwargs)
        made.append(guarded)
        return guarded

    yield make
    for guarded in made:
        guarded.flush()
