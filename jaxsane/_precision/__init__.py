"""Precision: updates that round away in bf16/fp16 weights, and where a low-precision program loses its
digits against a float32 reference (``compare_precision``)."""
