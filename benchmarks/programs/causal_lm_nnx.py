"""A small causal transformer LM as people write it in Flax NNX: 2 layers, d=64, sequence 32, vocabulary
50, padding masks, dropout, adamw with warmup; next-token targets shifted inside the loss. The model, data,
loss and step are the ladder's (``scaling.py``, ``lm_experiment``) at this size.

Used by benchmarks/doctor_speed.py (doctor time on a real sequence model); healthy, so doctor must give
no error on it.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scaling.py beside it, however this file is loaded
from scaling import lm_experiment  # noqa: E402


def experiment():
    return lm_experiment("lm_nnx", (2, 64, 4, 50), seq=32, batch=16, peak_lr=3e-3, eval_examples=64)
