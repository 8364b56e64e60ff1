"""A dataset with a few corrupt examples: the loss spikes on the batch that holds them.

Two examples of batch 40 have their pixels multiplied by 50 (a decoding bug: uint8 read as scaled float
twice) and their labels shifted by one (a misaligned label file). No value is NaN or Inf, so nothing trips; the loss jumps for one step and Adam's second moment,
small after 40 quiet steps, lets the update through at full size. fit's loss-spike watch names the batch, the
two examples carrying the gradient and Adam's lag. Fix: drop or repair those examples (c93: the clean data).
"""

import numpy as np
import optax

import jaxsane
from benchmarks.faults._common import NUM_CLASSES, dense_params, mlp_apply, optax_step, xent
from jaxsane.examples._digits import load_digits_split

EXPECTED = ["train.loss_spike"]
STYLE = "optax"
BAD_BATCH, BAD_EXAMPLES, STEPS = 40, (5, 21), 60
tx = optax.adam(3e-3)


def loss(params, batch):
    return xent(mlp_apply(params, batch["x"]), batch["y"])


def init(key):
    params = dense_params(key, (64, 64, NUM_CLASSES))
    return params, tx.init(params)


def batches(corrupt: bool, n: int = 32):
    x, y, _, _ = load_digits_split()
    out = []
    for i in range(STEPS):
        idx = np.arange(i * n, (i + 1) * n) % len(x)
        bx, by = np.array(x[idx], np.float32), np.array(y[idx])
        if corrupt and i == BAD_BATCH:  # FAULT: two corrupt examples in one batch (pixels x50, labels shifted)
            bad = list(BAD_EXAMPLES)
            bx[bad], by[bad] = bx[bad] * 50.0, (by[bad] + 1) % NUM_CLASSES
        out.append({"x": bx, "y": by})
    return out


def experiment(corrupt: bool = True):
    return jaxsane.Experiment(init=init, step=optax_step(loss, tx), train=batches(corrupt), loss=loss,
                              num_classes=NUM_CLASSES, name="f93_corrupt_examples_spike")


def check(corrupt: bool = True):
    result = jaxsane.fit(experiment(corrupt), steps=STEPS, progress=False, rollback_every=5)
    return list(result.diagnosis)
