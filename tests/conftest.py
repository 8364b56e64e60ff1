"""Test-suite set-up: 8 CPU devices (for sharding tests) before jax initialises its backend."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("MPLBACKEND", "Agg")
