"""scikit-learn's bundled 8x8 digits (offline), split and served as deterministic batches."""

from __future__ import annotations

import functools

import numpy as np

NUM_CLASSES = 10


@functools.lru_cache(maxsize=1)
def load_digits_split(eval_fraction: float = 0.2, seed: int = 0):
    """(x_train, y_train, x_eval, y_eval): float32 pixels scaled to [0, 1], int32 labels."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover
        raise ImportError("[jaxsane] the bundled examples need scikit-learn: pip install 'jaxsane[examples]'") from e
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    n_eval = int(len(x) * eval_fraction)
    ev, tr = order[:n_eval], order[n_eval:]
    return x[tr], y[tr], x[ev], y[ev]


class Batches:
    """A re-iterable, deterministic stream of ``{"x", "y"}`` batches (reshuffled each epoch, seeded)."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int = 64, seed: int = 0, epochs: int | None = None):
        self.x, self.y, self.batch_size, self.seed, self.epochs = x, y, batch_size, seed, epochs

    def __iter__(self):
        epoch = 0
        while self.epochs is None or epoch < self.epochs:
            order = np.random.default_rng(self.seed + epoch).permutation(len(self.x))
            for start in range(0, len(order) - self.batch_size + 1, self.batch_size):
                idx = order[start:start + self.batch_size]
                yield {"x": self.x[idx], "y": self.y[idx]}
            epoch += 1


def train_eval(batch_size: int = 64):
    x, y, xe, ye = load_digits_split()
    return Batches(x, y, batch_size), {"x": xe, "y": ye}
