"""scikit-learn's bundled 8x8 digits (offline), split and served as deterministic batches."""

from __future__ import annotations

import functools
import importlib.util
import os

import numpy as np

NUM_CLASSES = 10


def _digits_csv() -> str | None:
    """Path of scikit-learn's ``digits.csv.gz``, found without importing scikit-learn (whose import,
    with scipy's, takes seconds: longer than doctor's checks of these examples); None when absent."""
    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(root, "datasets", "data", "digits.csv.gz")
        if os.path.exists(path):
            return path
    return None


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """``(data [1797, 64] float64 in 0..16, target [1797] int)``, as ``sklearn.datasets.load_digits``."""
    path = _digits_csv()
    if path is not None:
        table = np.loadtxt(path, delimiter=",")
        return table[:, :-1], table[:, -1].astype(int)
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover
        raise ImportError("[jaxsane] the bundled examples need scikit-learn: pip install 'jaxsane[examples]'") from e
    digits = load_digits()
    return digits.data, digits.target


@functools.lru_cache(maxsize=1)
def load_digits_split(eval_fraction: float = 0.2, seed: int = 0):
    """(x_train, y_train, x_eval, y_eval): float32 pixels scaled to [0, 1], int32 labels."""
    data, target = load_digits_arrays()
    x = (data / 16.0).astype(np.float32)
    y = target.astype(np.int32)
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
                idx = order[start : start + self.batch_size]
                yield {"x": self.x[idx], "y": self.y[idx]}
            epoch += 1


def train_eval(batch_size: int = 64):
    x, y, xe, ye = load_digits_split()
    return Batches(x, y, batch_size), {"x": xe, "y": ye}
