"""Test-suite set-up: 8 CPU devices (for sharding tests) before jax initialises its backend.

The persistent compilation cache is off for the suite (``JAXSANE_CACHE=0``): tests never write into
the user's ``~/.cache``, and compile counts stay those of the process. Should a test turn it on, it
lands in a temporary directory of this session (``JAXSANE_CACHE_DIR``); the cache's own tests run
doctor in subprocesses with their own directories (tests/test_compile_cache.py).
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ["JAXSANE_CACHE"] = "0"
_CACHE_DIR = tempfile.mkdtemp(prefix="jaxsane-test-cache-")
os.environ["JAXSANE_CACHE_DIR"] = _CACHE_DIR
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
