"""The peers' own test suites (jax_debug_nans, checkify), ported case by case: see run.py."""
