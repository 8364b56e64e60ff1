"""The fault benchmark: small faulty and correct training programs, run by ``run.py``."""
