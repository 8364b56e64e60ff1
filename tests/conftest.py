"""Test-suite set-up: 8 CPU devices (for sharding tests) before jax initialises its backend.

The persistent compilation cache is off for the suite (``JAXSANE_CACHE=0``): tests never write into
the user's ``~/.cache``, and compile counts stay those of the process. Should a test turn it on, it
lands in a temporary directory of this session (``JAXSANE_CACHE_DIR``); the cache's own tests run
doctor in subprocesses with their own directories (tests/test_compile_cache.py).
"""

import atexit
import os
import pathlib
import shutil
import sys
import tempfile

# tests/ mirrors the package, one folder per capability (tests/guard/ for jaxsane/_guard/) plus tests/e2e/.
# Test modules share helpers by module name (``import test_fit as T``, ``from _programs import ...``): every
# folder is on sys.path, as pytest's default import mode puts each test file's own folder there.
_TESTS = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(_TESTS)] + sorted(str(d) for d in _TESTS.iterdir() if d.is_dir() and not d.name.startswith((".", "_")))

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ["JAXSANE_CACHE"] = "0"
_CACHE_DIR = tempfile.mkdtemp(prefix="jaxsane-test-cache-")
os.environ["JAXSANE_CACHE_DIR"] = _CACHE_DIR
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
