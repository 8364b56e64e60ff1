"""Rare corrupt rows in an endless stream: a sensor glitch writes NaN into one row in 300, the first
at row 1300, so the first 40 batches of 32 are clean and the loss goes NaN only at step ~40.

A reader that checks only the first batches passes it; reading the stream for its time budget finds
the rows. Fix: drop or repair glitched rows in the pipeline (``np.isfinite(x).all(1)``).
"""

import numpy as np
import optax

import jaxsane
from benchmarks.faults._common import dense_params, mlp_apply, optax_step

EXPECTED = ["nonfinite.input"]
STYLE = "optax"
STAGES = ["data"]
tx = optax.adam(1e-3)
FEATURES, BATCH = 16, 32


def loss(params, batch):
    return ((mlp_apply(params, batch["x"])[:, 0] - batch["y"]) ** 2).mean()


def init(key):
    params = dense_params(key, (FEATURES, 32, 1))
    return params, tx.init(params)


def sensor_stream(seed=0):
    """Endless fresh readings: y is a noisy linear function of 16 standardised features."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=FEATURES) / 4
    row = 0
    while True:
        x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
        glitched = (row + np.arange(BATCH) - 1300) % 300 == 0
        x[glitched & (row + np.arange(BATCH) >= 1300), 5] = np.nan  # FAULT: glitched readings reach the batch
        y = (x @ w + 0.1 * rng.normal(size=BATCH)).astype(np.float32)
        yield {"x": x, "y": y}
        row += BATCH


def experiment():
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=sensor_stream(), loss=loss,
                              apply=mlp_apply, name="f82_stream_corrupt_rows")
