"""fit checks its eval batches against the first train batch before the first step: a mismatch is a DataError
naming both batches' leaves, not a failure deep inside jnp.matmul at the first evaluation."""

import numpy as np
import pytest
from _programs import batch, optax_init, optax_loss, optax_step

import jaxsane
from jaxsane import DataError


def _fit(eval_, train=None, steps=2):
    exp = jaxsane.Experiment(init=optax_init, step=optax_step, train=train or batch(), eval=eval_, loss=optax_loss)
    return jaxsane.fit(exp, steps=steps, eval_every=1, progress=False)


@pytest.mark.parametrize("eval_, needles", [
    ({"x": np.ones((8, 5), np.float32), "y": np.zeros(8, np.int32)},
     ["its leaf ['x'] has per-example shape [5] float32 but the train batch's ['x'] has [4] float32",
      "Experiment.loss fails on it (TypeError: dot_general"]),
    ({"x": np.ones((8, 4), np.float32), "y": np.zeros((8, 1), np.int32)},
     ["its leaf ['y'] has per-example shape [1] and dtype int32 but the train batch's ['y'] has [] and int32"]),
    ({"x": np.ones((8, 4), np.int32), "y": np.zeros(8, np.int32)},
     ["['x'] has per-example shape [4] and dtype int32 but the train batch's ['x'] has [4] and float32"]),
    ({"inputs": np.ones((8, 4), np.float32), "y": np.zeros(8, np.int32)},
     ["its leaves are [['inputs'] [4] float32, ['y'] [] int32] but the train batch's are", "KeyError"]),
])
def test_an_eval_batch_of_another_kind_is_a_data_error_naming_both(eval_, needles):
    with pytest.raises(DataError) as info:
        _fit(eval_)
    message = str(info.value)
    assert message.startswith("[jaxsane] fit: eval batch 0 does not match train batch 0: "), message
    for needle in needles:
        assert needle in message, message


def test_an_eval_batch_the_loss_runs_on_passes_and_no_train_batch_is_lost():
    extra_key = {"x": np.ones((4, 4), np.float32), "y": np.zeros(4, np.int32), "id": np.arange(4)}
    train = [batch(seed=s) for s in range(3)]
    result = _fit(extra_key, train=train, steps=3)  # the loss ignores "id"; a smaller eval batch is fine
    assert result.step == 3 and result.data_exhausted_at is None
    assert len(result.history.eval_loss) == 4  # before step 1 and after each step
