"""Sequence-model checks: future leakage in a model declared causal (a missing mask, a mask on the
wrong axis) and padding that reaches the loss; causal, masked programs stay silent."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsane
from jaxsane import ExperimentError, check_causal, check_padding_in_loss
from jaxsane._checks.causal import check_teacher_forced, teacher_forced_leaves

V, D, T, B = 11, 8, 7, 4
rng = np.random.default_rng(0)
PARAMS = {"emb": jnp.asarray(rng.normal(size=(V, D)).astype(np.float32)),
          "q": jnp.asarray(rng.normal(size=(D, D)).astype(np.float32) / 3),
          "k": jnp.asarray(rng.normal(size=(D, D)).astype(np.float32) / 3),
          "out": jnp.asarray(rng.normal(size=(D, V)).astype(np.float32))}
TOKENS = np.concatenate([np.ones((B, 1), np.int32), rng.integers(2, V, (B, T - 1)).astype(np.int32)], 1)
LENGTHS = np.array([7, 5, 4, 6])
MASK = (np.arange(T)[None] < LENGTHS[:, None]).astype(np.float32)
TOKENS = np.where(MASK > 0, TOKENS, 0).astype(np.int32)


def attention_lm(mask_fn):
    """A one-layer attention LM whose attention mask is ``mask_fn(T) -> [T(query), T(key)] bool``."""
    def apply(p, tokens):
        h = p["emb"][tokens]
        scores = (h @ p["q"]) @ (h @ p["k"]).swapaxes(-1, -2)
        allowed = mask_fn(tokens.shape[1])[None] & (tokens != 0)[:, None, :]
        scores = jnp.where(allowed, scores, -1e9)
        return (h + jax.nn.softmax(scores, -1) @ h) @ p["out"]
    return apply


causal = attention_lm(lambda t: jnp.tril(jnp.ones((t, t), bool)))


def test_a_causal_mask_is_silent():
    assert check_causal(causal, PARAMS, TOKENS) == []
    assert check_causal(jax.jit(causal), PARAMS, TOKENS, probes=[0, 1, 2, 3, 4, 5]) == []


def test_a_missing_causal_mask_is_future_leakage():
    leaky = attention_lm(lambda t: jnp.ones((t, t), bool))  # BUG: no causal mask
    [f] = check_causal(leaky, PARAMS, TOKENS)
    assert f.code == "seq.future_leakage" and f.severity == "error"
    assert 0 in f.extra["probes"][0][2] and "tril" in f.hint


@pytest.mark.parametrize("wrong", [
    lambda t: jnp.tril(jnp.ones((t, t), bool)).T,           # [key, query]: the mask on the wrong axis
    lambda t: jnp.triu(jnp.ones((t, t), bool)),             # triu for tril
    lambda t: jnp.tril(jnp.ones((t, t), bool), k=1),        # off by one: t sees t + 1
])
def test_a_mask_on_the_wrong_axis_or_direction_is_future_leakage(wrong):
    [f] = check_causal(attention_lm(wrong), PARAMS, TOKENS)
    assert f.code == "seq.future_leakage"


def test_padding_queries_that_attend_to_every_key_are_not_leakage():
    """Flax's combine_masks(causal, padding x padding) masks a padding query from every key: softmax then spreads
    it over all of them alike, the future too. The loss never reads that position, so with the mask it is not
    compared; without it, it is the only thing that moved."""
    def flax_style(p, tokens):
        h = p["emb"][tokens]
        valid = tokens != 0
        allowed = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))[None] & valid[:, :, None] & valid[:, None, :]
        scores = jnp.where(allowed, (h @ p["q"]) @ (h @ p["k"]).swapaxes(-1, -2), -1e9)
        return (h + jax.nn.softmax(scores, -1) @ h) @ p["out"]

    late = [4, 5]  # rows of 4 and 5 tokens: padding queries at t <= 5
    assert check_causal(flax_style, PARAMS, TOKENS, mask=MASK, probes=late) == []
    targets = np.roll(TOKENS, -1, 1) * (MASK > 0)
    assert check_teacher_forced(flax_style, PARAMS, TOKENS, targets, mask=MASK, probes=late) == []
    # undeclared and no mask: a row's trailing run of one id is read as its padding
    assert check_teacher_forced(flax_style, PARAMS, TOKENS, targets, probes=late) == []
    [f] = check_causal(flax_style, PARAMS, TOKENS, probes=late)
    assert min(f.extra["probes"][0][2]) >= LENGTHS.min()  # only padding positions moved


def test_float_inputs_and_a_future_looking_convolution():
    x = rng.normal(size=(B, T, 3)).astype(np.float32)
    w = jnp.asarray(rng.normal(size=(3, 5)).astype(np.float32))
    past = lambda p, x: jnp.cumsum(x @ p, axis=1)                            # causal: prefix sums
    future = lambda p, x: x @ p + jnp.roll(x @ p, -1, axis=1)                 # BUG: sees t + 1
    assert check_causal(past, w, x) == []
    assert [f.code for f in check_causal(future, w, x)] == ["seq.future_leakage"]


def test_inputs_without_a_time_axis_are_an_error():
    with pytest.raises(ExperimentError, match="time axis"):
        check_causal(lambda p, x: x @ p, jnp.ones((3, 2)), np.ones((4, 3), np.float32))
    with pytest.raises(ExperimentError, match="per-position"):
        check_causal(lambda p, x: jnp.sum(p["emb"][x], 1), PARAMS, TOKENS)


def per_token(p, batch):
    return optax.softmax_cross_entropy_with_integer_labels(causal(p, batch["tokens"]), batch["targets"])


def batch_of(targets=None):
    targets = np.roll(TOKENS, -1, 1) * (MASK > 0) if targets is None else targets
    return {"tokens": TOKENS, "targets": targets.astype(np.int32), "mask": MASK}


def test_a_masked_loss_is_silent():
    masked = lambda p, b: jnp.sum(per_token(p, b) * b["mask"]) / jnp.maximum(jnp.sum(b["mask"]), 1.0)
    batch = batch_of()
    assert check_padding_in_loss(masked, PARAMS, batch, batch["mask"], inputs=batch["tokens"],
                                 labels=batch["targets"]) == []
    # an ignore index instead of the mask in the loss: also correct
    ignore = batch_of(np.where(MASK > 0, np.roll(TOKENS, -1, 1), -100))
    by_ignore = lambda p, b: (jnp.sum(jnp.where(b["targets"] >= 0, optax.softmax_cross_entropy_with_integer_labels(
        causal(p, b["tokens"]), jnp.maximum(b["targets"], 0)), 0.0)) / jnp.sum(b["targets"] >= 0))
    assert check_padding_in_loss(by_ignore, PARAMS, ignore, ignore["mask"], inputs=ignore["tokens"],
                                 labels=ignore["targets"]) == []


def test_a_plain_mean_over_padding_is_padding_in_loss():
    plain = lambda p, b: jnp.mean(per_token(p, b))  # BUG: padded positions counted
    batch = batch_of()
    [f] = check_padding_in_loss(plain, PARAMS, batch, batch["mask"], inputs=batch["tokens"], labels=batch["targets"])
    assert f.code == "seq.padding_in_loss" and f.severity == "error"
    assert all(r > 1e-3 for r in f.extra["relative_change"].values()) and "mask" in f.hint


def test_a_per_example_mask_judges_the_padding_slots_targets():
    """A batch padded to a fixed size (a graph batch's empty slots, an eval batch's padding examples) with a mask
    per example: a masked mean never reads the padding slots' targets; a plain mean does."""
    r = np.random.default_rng(7)
    batch = {"x": r.normal(size=(8, 4)).astype(np.float32), "y": r.integers(0, 3, 8).astype(np.int32),
             "mask": np.array([1, 1, 1, 1, 1, 0, 0, 0], np.float32)}
    batch["y"][5:] = 0  # padding slots hold label 0, as a padded batch does
    batch["x"][5:] = 0.0  # and no input: their logits are uniform, their loss ln 3 whatever the label (not its gradient)
    w = {"w": jnp.asarray(r.normal(size=(4, 3)).astype(np.float32)), "b": jnp.zeros(3)}
    per_example = lambda p, b: optax.softmax_cross_entropy_with_integer_labels(b["x"] @ p["w"] + p["b"], b["y"])
    masked = lambda p, b: jnp.sum(per_example(p, b) * b["mask"]) / jnp.maximum(jnp.sum(b["mask"]), 1.0)
    plain = lambda p, b: jnp.mean(per_example(p, b))  # BUG: the padding slots counted
    assert check_padding_in_loss(masked, w, batch, batch["mask"], labels=batch["y"]) == []
    [f] = check_padding_in_loss(plain, w, batch, batch["mask"], labels=batch["y"])
    assert f.code == "seq.padding_in_loss" and "3 of 8 examples" in f.message and "per_example" in f.hint


def test_nothing_to_judge_without_padding_or_with_a_nan_loss():
    full = {"tokens": TOKENS, "targets": TOKENS, "mask": np.ones((B, T), np.float32)}
    plain = lambda p, b: jnp.mean(per_token(p, b))
    assert check_padding_in_loss(plain, PARAMS, full, full["mask"]) == []
    nan = lambda p, b: jnp.mean(per_token(p, b)) * jnp.nan
    assert check_padding_in_loss(nan, PARAMS, batch_of(), MASK) == []
    with pytest.raises(ExperimentError, match=r"\[B, T\]"):
        check_padding_in_loss(plain, PARAMS, batch_of(), MASK[:, :, None])


def _experiment(apply, loss, causal_flag=True):
    import optax as ox
    tx = ox.sgd(0.1)

    def step(state, batch):
        p, s = state
        g = jax.grad(loss)(p, batch)
        u, s = tx.update(g, s, p)
        return (ox.apply_updates(p, u), s), {}

    return jaxsane.Experiment(init=lambda key: (PARAMS, tx.init(PARAMS)), step=jax.jit(step), train=batch_of(),
                              loss=loss, apply=apply, causal=causal_flag)


@pytest.mark.slow
def test_doctor_batch_stage_runs_the_sequence_checks():
    masked = lambda p, b: jnp.sum(per_token(p, b) * b["mask"]) / jnp.maximum(jnp.sum(b["mask"]), 1.0)
    leaky = attention_lm(lambda t: jnp.ones((t, t), bool))
    plain = lambda p, b: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(leaky(p, b["tokens"]),
                                                                                   b["targets"]))
    ok = jaxsane.doctor(_experiment(causal, masked), stages=["batch"])
    assert not [f for f in ok if f.severity == "error"], [f.code for f in ok]
    bad = jaxsane.doctor(_experiment(leaky, plain), stages=["batch"])
    assert {"seq.future_leakage", "seq.padding_in_loss"} <= set(bad.codes)
    # declared not causal: a bidirectional model is allowed to see the future
    assert "seq.future_leakage" not in jaxsane.doctor(_experiment(leaky, masked, causal_flag=False),
                                                      stages=["batch"]).codes
    # not declared: its targets are its inputs one position ahead, so reading the next input is copying the answer
    undeclared = jaxsane.doctor(_experiment(leaky, masked, causal_flag=None), stages=["batch"])
    assert "teacher forcing" in undeclared.by_code("seq.future_leakage")[0].message, undeclared
    assert "seq.future_leakage" not in jaxsane.doctor(_experiment(causal, masked, causal_flag=None),
                                                      stages=["batch"]).codes


def test_teacher_forcing_makes_a_model_that_reads_the_next_input_leak():
    """Undeclared models are probed only on the inputs their targets are one position ahead of: an LM (tokens
    against next tokens) and a decoder ([BOS, y[:, :-1]] against y) must be causal in them; a tagger (a label
    per token, not shifted) and an encoder's source may be read whole."""
    leaky = attention_lm(lambda t: jnp.ones((t, t), bool))
    targets = batch_of()["targets"]
    [f] = check_teacher_forced(leaky, PARAMS, TOKENS, targets)
    assert f.code == "seq.future_leakage" and "teacher forcing" in f.message and "causal=False" in f.hint
    assert check_teacher_forced(causal, PARAMS, TOKENS, targets) == []
    tags = np.random.default_rng(3).integers(0, V, TOKENS.shape).astype(np.int32)
    assert teacher_forced_leaves([TOKENS], tags) == [] and check_teacher_forced(leaky, PARAMS, TOKENS, tags) == []
    src = np.random.default_rng(5).integers(1, V, (B, T)).astype(np.int32)
    dec_in = np.asarray(_shift_right(TOKENS))
    assert teacher_forced_leaves([src, dec_in], TOKENS) == [1]
    assert check_teacher_forced(encoder_decoder(False), PARAMS, (src, dec_in), TOKENS) == []
    [f] = check_teacher_forced(_no_causal_mask, PARAMS, (src, dec_in), TOKENS)
    assert f.code == "seq.future_leakage"


def test_experiment_causal_must_be_a_bool():
    with pytest.raises(ExperimentError, match="causal must be True, False or None"):
        jaxsane.Experiment(init=lambda k: 0, step=lambda s, b: s, train=np.ones((2, 2)), causal="yes")


def test_padding_that_reaches_a_pooled_classifier():
    x = rng.normal(size=(B, T, 3)).astype(np.float32) * MASK[..., None]
    batch = {"x": x, "y": np.arange(B) % 2, "mask": MASK}
    w = jnp.asarray(rng.normal(size=(3, 2)).astype(np.float32))

    def xent(logits, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    masked = lambda p, b: xent(jnp.sum((b["x"] @ p) * b["mask"][..., None], 1)
                               / jnp.maximum(b["mask"].sum(1, keepdims=True), 1.0), b["y"])
    unmasked = lambda p, b: xent(jnp.mean(b["x"] @ p, 1), b["y"])  # BUG: the pool averages padding in
    assert check_padding_in_loss(masked, w, batch, MASK, inputs=batch["x"], labels=batch["y"]) == []
    [f] = check_padding_in_loss(unmasked, w, batch, MASK, inputs=batch["x"], labels=batch["y"])
    assert list(f.extra["relative_change"]) == ["inputs"]


def test_targets_equal_to_inputs_with_a_loss_that_shifts_inside_are_not_flagged():
    tokens = np.where(MASK > 0, TOKENS, 0).astype(np.int32)
    batch = {"tokens": tokens, "labels": tokens.copy(), "mask": MASK}  # Hugging Face style: labels = input_ids

    def hf_loss(p, b):  # shifts inside: position t's logits against label t + 1
        per = optax.softmax_cross_entropy_with_integer_labels(causal(p, b["tokens"])[:, :-1], b["labels"][:, 1:])
        return jnp.sum(per * b["mask"][:, 1:]) / jnp.maximum(jnp.sum(b["mask"][:, 1:]), 1.0)

    def copy_loss(p, b):  # BUG: position t against label t, and labels are the inputs
        per = optax.softmax_cross_entropy_with_integer_labels(causal(p, b["tokens"]), b["labels"])
        return jnp.sum(per * b["mask"]) / jnp.maximum(jnp.sum(b["mask"]), 1.0)

    from jaxsane._checks.sequence import loss_reads_first_target
    assert loss_reads_first_target(hf_loss, PARAMS, batch, batch["labels"], batch["tokens"]) is False
    assert loss_reads_first_target(copy_loss, PARAMS, batch, batch["labels"], batch["tokens"]) is True
    assert loss_reads_first_target(copy_loss, PARAMS, batch, batch["tokens"], batch["tokens"]) is None  # shared

    def exp(loss):
        import optax as ox
        tx = ox.sgd(0.1)
        step = jax.jit(lambda s, b: ((ox.apply_updates(s[0], tx.update(jax.grad(loss)(s[0], b), s[1])[0]), s[1]), {}))
        return jaxsane.Experiment(init=lambda key: (PARAMS, tx.init(PARAMS)), step=step, train=batch, loss=loss,
                                  apply=causal, causal=True)

    assert "data.unshifted_targets" in jaxsane.check_data(batch).codes  # the data alone cannot tell
    assert "data.unshifted_targets" not in jaxsane.doctor(exp(hf_loss), stages=["data"]).codes
    assert "data.unshifted_targets" in jaxsane.doctor(exp(copy_loss), stages=["data"]).codes


# ----------------------------------------------------------------------------- weights derived from the ids


def _shift_right(x):
    """Flax lm1b/wmt style: the model's input is the targets moved one position right, 0 in front."""
    return jnp.pad(x, ((0, 0), (1, 0)))[:, :-1]


def lm1b_apply(p, ids):
    """lm1b style: the model takes the target ids, shifts them right inside, and masks attention causally
    and by ``ids > 0`` of the unshifted ids."""
    h = p["emb"][_shift_right(ids)]
    scores = (h @ p["q"]) @ (h @ p["k"]).swapaxes(-1, -2)
    allowed = jnp.tril(jnp.ones((ids.shape[1],) * 2, bool))[None] & (ids > 0)[:, None, :]
    return (h + jax.nn.softmax(jnp.where(allowed, scores, -1e9), -1) @ h) @ p["out"]


def lm1b_loss(p, b):
    """lm1b style: the batch holds only the token ids, and the loss weights each position by ``ids > 0``."""
    ids = b["inputs"]
    weights = jnp.where(ids > 0, 1.0, 0.0)
    per = optax.softmax_cross_entropy_with_integer_labels(lm1b_apply(p, ids), ids)
    return jnp.sum(per * weights) / jnp.sum(weights)


def dropped_weights_loss(p, b):
    ids = b["inputs"]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(lm1b_apply(p, ids), ids))  # BUG: no weights


def test_weights_from_the_ids_are_not_padding_in_loss_and_dropped_weights_are():
    batch = {"inputs": TOKENS}
    mask = TOKENS > 0  # Experiment(mask=lambda b: b["inputs"] > 0): the padding is the pad id itself
    assert check_padding_in_loss(lm1b_loss, PARAMS, batch, mask, inputs=batch["inputs"], labels=batch["inputs"]) == []
    [f] = check_padding_in_loss(dropped_weights_loss, PARAMS, batch, mask, inputs=batch["inputs"],
                                labels=batch["inputs"])
    assert f.code == "seq.padding_in_loss" and "cut off" in f.message


def test_pad_ids_with_no_padding_to_cut_say_doctor_skipped():
    fixed = lambda p, b: dropped_weights_loss(p, b) + 0.0 * b["inputs"].reshape(B, T).sum()  # needs length T
    batch = {"inputs": TOKENS}
    [f] = check_padding_in_loss(fixed, PARAMS, batch, TOKENS > 0)
    assert f.code == "doctor.skipped" and "pad id" in f.message


def test_a_soft_mask_at_the_float_noise_level_is_not_evidence():
    """A clean masked loss whose attention masks padding with a finite bias: padded keys keep a weight of
    about e^-12, so changing them moves the loss by ~1e-5 relative, float noise, not a bug."""
    x = rng.normal(size=(B, T, D)).astype(np.float32)
    y = rng.integers(0, V, (B,)).astype(np.int32)
    batch = {"x": x, "y": y, "mask": MASK}

    def soft(p, b):
        h = b["x"]
        scores = jnp.einsum("btd,d->bt", h, p["q"][0]) + (b["mask"] - 1.0) * 12.0  # padded keys: weight ~ e^-12
        pooled = jnp.einsum("bt,btd->bd", jax.nn.softmax(scores, -1), h)
        return optax.softmax_cross_entropy_with_integer_labels(pooled @ p["out"], b["y"]).mean()

    change = _relative_change(soft, batch)
    assert 1e-6 < change < 1e-4, change  # the edge of the old tolerance (1e-5)
    assert check_padding_in_loss(soft, PARAMS, batch, MASK, inputs=batch["x"], labels=batch["y"]) == []


def _relative_change(loss, batch):
    moved = dict(batch, x=np.where(MASK[..., None] > 0, batch["x"], batch["x"] + 3.0))
    a, b = float(loss(PARAMS, batch)), float(loss(PARAMS, moved))
    return abs(a - b) / abs(a)


# ----------------------------------------------------------------------------- models that shift inside


def _sgd_experiment(batch, loss, apply, **handles):
    tx = optax.sgd(0.1)

    def step(state, b):
        p, s = state
        u, s = tx.update(jax.grad(loss)(p, b), s, p)
        return (optax.apply_updates(p, u), s), {}

    return jaxsane.Experiment(init=lambda key: (PARAMS, tx.init(PARAMS)), step=jax.jit(step), train=batch, loss=loss,
                              apply=apply, **handles)


def unshifted_apply(p, ids):  # BUG: the decoder reads target t to predict target t
    return causal(p, ids)


def test_a_decoder_that_shifts_inside_is_not_unshifted_targets_and_one_that_does_not_is():
    batch = {"inputs": TOKENS}
    handles = dict(inputs=lambda b: b["inputs"], labels=lambda b: b["inputs"], mask=lambda b: b["inputs"] > 0)
    from jaxsane._checks.sequence import output_sees_own_target
    assert output_sees_own_target(lm1b_apply, PARAMS, TOKENS, TOKENS) is False
    assert output_sees_own_target(unshifted_apply, PARAMS, TOKENS, TOKENS) is True

    def loss_of(apply):
        def loss(p, b):
            ids = b["inputs"]
            w = jnp.where(ids > 0, 1.0, 0.0)
            return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(apply(p, ids), ids) * w) / jnp.sum(w)
        return loss

    clean = jaxsane.doctor(_sgd_experiment(batch, loss_of(lm1b_apply), lm1b_apply, **handles), stages=["data"],
                           progress=False)
    assert "data.unshifted_targets" not in clean.codes, clean
    buggy = jaxsane.doctor(_sgd_experiment(batch, loss_of(unshifted_apply), unshifted_apply, **handles),
                           stages=["data"], progress=False)
    assert "data.unshifted_targets" in buggy.codes, buggy


def encoder_decoder(shift):
    """wmt style: the source is pooled into every decoder position; the decoder reads the targets, shifted
    right inside (``shift=True``) or not (a bug: position t reads target t)."""
    def apply(p, inputs):
        src, tgt = inputs
        memory = p["emb"][src].mean(axis=1, keepdims=True)
        dec_in = _shift_right(tgt) if shift else tgt
        h = p["emb"][dec_in] + memory
        scores = (h @ p["q"]) @ (h @ p["k"]).swapaxes(-1, -2)
        scores = jnp.where(jnp.tril(jnp.ones((tgt.shape[1],) * 2, bool))[None], scores, -1e9)
        return (h + jax.nn.softmax(scores, -1) @ h) @ p["out"]
    return apply


def test_an_encoder_decoder_with_an_unshifted_decoder_input_is_found():
    src = np.random.default_rng(5).integers(1, V, (B, T)).astype(np.int32)
    batch = {"inputs": src, "targets": TOKENS}
    handles = dict(inputs=lambda b: (b["inputs"], b["targets"]), labels=lambda b: b["targets"],
                   mask=lambda b: b["targets"] > 0)

    def loss_of(apply):
        def loss(p, b):
            w = jnp.where(b["targets"] > 0, 1.0, 0.0)
            per = optax.softmax_cross_entropy_with_integer_labels(apply(p, (b["inputs"], b["targets"])), b["targets"])
            return jnp.sum(per * w) / jnp.sum(w)
        return loss

    for shift, expected in ((True, False), (False, True)):
        apply = encoder_decoder(shift)
        d = jaxsane.doctor(_sgd_experiment(batch, loss_of(apply), apply, **handles), stages=["data"], progress=False)
        assert ("data.unshifted_targets" in d.codes) is expected, (shift, d)


def _no_causal_mask(p, inputs):  # BUG: decoder self-attention sees every position
    src_, tgt = inputs
    h = p["emb"][tgt] + p["emb"][src_].mean(axis=1, keepdims=True)
    scores = (h @ p["q"]) @ (h @ p["k"]).swapaxes(-1, -2)
    return (h + jax.nn.softmax(scores, -1) @ h) @ p["out"]


def test_causal_probe_of_an_encoder_decoder_changes_only_the_decoder_input():
    src = np.random.default_rng(5).integers(1, V, (B, T)).astype(np.int32)
    dec_in = np.asarray(_shift_right(TOKENS))
    wmt_like = lambda p, inputs: encoder_decoder(False)(p, inputs)  # decoder input given pre-shifted

    # without the targets, the source (read whole by every position) looks like future leakage
    assert check_causal(wmt_like, PARAMS, (src, dec_in))[0].code == "seq.future_leakage"
    assert check_causal(wmt_like, PARAMS, (src, dec_in), labels=TOKENS) == []
    assert check_causal(encoder_decoder(True), PARAMS, (src, TOKENS), labels=TOKENS) == []
    [f] = check_causal(_no_causal_mask, PARAMS, (src, dec_in), labels=TOKENS)
    assert f.code == "seq.future_leakage"
