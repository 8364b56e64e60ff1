"""The overfit verdict judges a curve against what the batch allows: loss floors, ambiguous
batches, losses below zero, outputs that are already probabilities, and targets that are inputs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsane
from jaxsane import overfit
from jaxsane._overfit.verdict import batch_ceiling, curve_verdict
from jaxsane.examples._digits import load_digits_split

STEPS = np.arange(300)


@pytest.mark.parametrize("curve, verdict", [
    (np.full(300, 2.3) + 1e-3 * np.sin(STEPS), "fails"),                        # flat: nothing learned
    (0.6 + 1.7 * np.exp(-STEPS / 20), "floor"),                                  # converged above 0 (KL, dropout)
    (1.4 - 4.4 * (1 - np.exp(-STEPS / 30)), "floor"),                            # a Gaussian NLL crossing 0, settled
    (2.3 - 0.005 * STEPS, "unsettled"),                                          # still falling: run longer
    (-2.3 - 0.3 * STEPS, "unbounded"),                                           # a flipped sign: no lower bound
    (1.7 + 0.6 * np.exp(-STEPS / 20), "high_floor"),                             # settled after falling by 26%
    (np.where(STEPS > 100, np.nan, 2.3), "diverged"),
])
def test_curve_verdicts(curve, verdict):
    assert curve_verdict(curve, reached=False) == verdict


def test_reached_target_fits():
    assert curve_verdict(2.3 * np.exp(-STEPS / 10), reached=True) == "fits"


def test_batch_ceiling_rows_and_prefixes():
    x = np.arange(8, dtype=np.float32).reshape(8, 1)
    x[4:] = x[:4]  # rows 4..7 repeat rows 0..3
    y = np.array([0, 1, 2, 3, 0, 1, 2, 9])  # ... and the last one with another label
    exp = jaxsane.Experiment(init=lambda k: 0, step=lambda s, b: s, train={"x": x, "y": y})
    ceiling = batch_ceiling(exp, {"x": x, "y": y})
    assert ceiling.kind == "rows" and ceiling.accuracy == pytest.approx(7 / 8)
    assert ceiling.ambiguous == pytest.approx(2 / 8) and ceiling.loss == pytest.approx(2 * math.log(2) / 8)
    clean = batch_ceiling(exp, {"x": x, "y": np.array([0, 1, 2, 3, 0, 1, 2, 3])})
    assert clean.accuracy == 1.0 and clean.ambiguous == 0.0

    tokens = np.array([[1, 2, 3], [1, 2, 4], [5, 6, 7]])  # two sequences share the prefix (1, 2)
    labels = np.array([[2, 3, 0], [2, 4, 0], [6, 7, 0]])
    seq = batch_ceiling(exp, {"x": tokens, "y": labels})
    assert seq.kind == "prefixes"
    # position 1 of rows 0 and 1: the same prefix (1, 2), labels 3 and 4 -> one of those two is unreachable
    assert seq.accuracy == pytest.approx(8 / 9)
    masked = batch_ceiling(exp, {"x": tokens, "y": labels, "mask": np.array([[1, 0, 1], [1, 0, 1], [1, 1, 1]])})
    assert masked.accuracy == 1.0


def _digits(n=16):
    x, y, _, _ = load_digits_split()
    return x[:n], y[:n]


def _mlp(kind="healthy", x=None, y=None, lr=1e-2):
    x0, y0 = _digits()
    x = x0 if x is None else x
    y = y0 if y is None else y
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=lr)

    def init(key):
        k1, k2 = jax.random.split(key)
        params = {"w1": jax.random.normal(k1, (64, 32)) / 8.0, "b1": jnp.zeros(32),
                  "w2": jax.random.normal(k2, (32, 10)) / math.sqrt(32), "b2": jnp.zeros(10)}
        return params, tx.init(params)

    def apply(params, x):
        out = jax.nn.relu(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
        return jax.nn.softmax(out) if kind == "double_softmax" else out  # BUG when double_softmax

    def loss(params, batch):
        value = optax.softmax_cross_entropy_with_integer_labels(apply(params, batch["x"]), batch["y"]).mean()
        return -value if kind == "flipped_sign" else value  # BUG when flipped_sign

    @jax.jit
    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    return jaxsane.Experiment(init=init, step=step, train={"x": x, "y": y}, loss=loss, apply=apply, name=kind)


def test_ambiguous_batch_is_judged_against_its_ceiling():
    x, y = _digits()
    x = np.concatenate([x[:8], x[:8]])           # every input twice ...
    y = np.concatenate([y[:8], (y[:8] + 1) % 10])  # ... with two different labels: 50% is the ceiling
    result = overfit(_mlp(x=x, y=y), seeds=1, steps=300, learning_rates=[1e-2, 3e-2])
    assert "overfit.failed" not in result.codes, result.table()
    assert result.target_accuracy == pytest.approx(0.5, abs=1e-3)
    assert "50%" in result.table()


def test_flipped_sign_loss_fails_instead_of_fitting_at_step_0():
    result = overfit(_mlp("flipped_sign"), seeds=1, steps=300, learning_rates=[1e-2, 3e-2], baseline=False)
    assert "overfit.failed" in result.codes, result.table()
    failed = next(f for f in result.findings if f.code == "overfit.failed")
    assert "without bound" in failed.message and "sign" in failed.hint
    assert not any(result.reached[result.real])


def test_outputs_already_probabilities_fail_with_the_cause_even_at_full_accuracy():
    result = overfit(_mlp("double_softmax", lr=3e-2), seeds=1, steps=300, learning_rates=[3e-2, 1e-1])
    failed = [f for f in result.findings if f.code == "overfit.failed"]
    assert failed and "already probabilities" in failed[0].message, result.table()
    assert "model.ignores_input" not in result.codes  # no configuration can fit, real or constant: not the input


def test_healthy_mlp_still_fits_with_no_warning():
    result = overfit(_mlp(), seeds=1, steps=300, learning_rates=[1e-2, 3e-2])
    assert result.ok and "overfit.unsettled" not in result.codes, result.table()
    assert "fits" in result.verdicts


def _causal_lm(shifted_inside_loss: bool, unshifted: bool = False):
    """A tiny causal next-token model (embedding, causal running mean, readout) on 16 sequences where
    pairs of sequences share their first half and continue differently."""
    vocab, length, width = 12, 8, 32
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, vocab, size=(16, length + 1)).astype(np.int32)
    tokens[8:, :4] = tokens[:8, :4]  # ambiguous continuations: the same prefix, other next tokens
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=3e-2)

    def init(key):
        k1, k2 = jax.random.split(key)
        params = {"emb": jax.random.normal(k1, (vocab, width)) * 0.5,
                  "pos": jnp.zeros((length, width)),
                  "out": jax.random.normal(k2, (2 * width, vocab)) / math.sqrt(2 * width)}
        return params, tx.init(params)

    def apply(params, x):
        h = params["emb"][x] + params["pos"][: x.shape[1]]
        context = jnp.cumsum(h, axis=1) / jnp.arange(1, x.shape[1] + 1)[None, :, None]  # causal mixing
        return jnp.concatenate([h, context], -1) @ params["out"]

    def loss(params, batch):
        if shifted_inside_loss:
            x, y = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
        else:
            x, y = batch["x"], batch["y"]
        return optax.softmax_cross_entropy_with_integer_labels(apply(params, x), y).mean()

    @jax.jit
    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    if shifted_inside_loss:
        return jaxsane.Experiment(init=init, step=step, train={"tokens": tokens}, loss=loss,
                                  inputs=lambda b: b["tokens"], name="lm")
    return jaxsane.Experiment(init=init, step=step, train={"x": tokens[:, :-1], "y": tokens[:, 1:]}, loss=loss,
                              apply=apply, name="lm")


@pytest.mark.slow
def test_lm_with_ambiguous_continuations_fits_to_its_ceiling():
    result = overfit(_causal_lm(shifted_inside_loss=False), seeds=1, steps=400, learning_rates=[3e-2, 1e-1])
    assert result.ok, result.table()
    assert result.target_accuracy < 1.0  # the ceiling, not 100%


def test_lm_whose_targets_are_its_inputs_gets_no_baseline_verdict():
    result = overfit(_causal_lm(shifted_inside_loss=True), seeds=1, steps=400, learning_rates=[3e-2, 1e-1])
    assert "model.ignores_input" not in result.codes, result.table()
    skipped = [f for f in result.findings if f.code == "doctor.skipped"]
    assert skipped and "targets" in skipped[0].message
    assert result.baseline is None


def test_ignores_input_on_all_nan_losses_warns_nothing():
    """Every loss NaN (a diverged sweep): no 'All-NaN slice' RuntimeWarning (warnings are errors here), no finding."""
    from types import SimpleNamespace

    from jaxsane._overfit.verdict import _Judged

    losses = np.full((3, 4), np.nan)
    result = SimpleNamespace(losses=losses, real=np.array([True, True, False]), baseline=2)
    judged = _Judged(result, ("diverged",) * 3, None, 0, "", "", "")
    assert judged.ignores_input(1.5) == []


def test_a_curve_still_falling_well_below_the_constant_inputs_does_not_ignore_its_input():
    """Softmax cross-entropy over multi-hot labels has a floor far above 0: the real inputs' curve is still falling
    at 0.75x the constant inputs' when the sweep ends, or flattens there. That is no evidence the model ignores its
    input; a real curve that ends where the constant one does is (and one that hardly moved keeps the old rule)."""
    from types import SimpleNamespace

    from jaxsane._overfit.verdict import _Judged

    falling = np.array([11.5, 10.4, 9.4, 8.8, 8.3])
    constant = np.array([11.5, 11.2, 11.0, 11.0, 11.0])
    result = SimpleNamespace(losses=np.stack([falling, constant]), real=np.array([0]), baseline=1)
    for verdict in ("unsettled", "high_floor"):
        assert _Judged(result, (verdict, "baseline"), None, 0, "", "", "").ignores_input(0.5) == []
        flat = SimpleNamespace(losses=np.stack([constant * 1.001, constant]), real=np.array([0]), baseline=1)
        [f] = _Judged(flat, (verdict, "baseline"), None, 0, "", "", "").ignores_input(0.5)
        assert f.code == "model.ignores_input"
    [f] = _Judged(result, ("fails", "baseline"), None, 0, "", "", "").ignores_input(0.5)
    assert f.code == "model.ignores_input"
