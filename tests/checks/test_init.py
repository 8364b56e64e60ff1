"""Init checks: per-layer activation statistics read from the jaxpr (NNX, linen, plain functions),
init.scale through depth and saturation, init.symmetric units, init.loss."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _programs import nnx_classifier_experiment
from flax import nnx

import jaxsane
from jaxsane import activation_stats, check_init
from jaxsane._checks.init_loss import classification_of
from jaxsane._experiment.contract import PureExperiment
from jaxsane.testing import CheckFailed, assert_init_ok

X = np.random.default_rng(0).normal(size=(32, 16)).astype(np.float32)
Y = (np.arange(32) % 4).astype(np.int32)


def _mlp(key, sizes, scale, act=jax.nn.relu):
    """A plain-function MLP; ``scale(fan_in)`` is the std of the weights."""
    params = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:]):
        key, sub = jax.random.split(key)
        params.append({"w": jax.random.normal(sub, (n_in, n_out)) * scale(n_in), "b": jnp.zeros(n_out)})

    def apply(params, x):
        for layer in params[:-1]:
            x = act(x @ layer["w"] + layer["b"])
        return x @ params[-1]["w"] + params[-1]["b"]

    return params, apply


@pytest.mark.slow
def test_stats_name_layers_and_the_output_layer():
    params, apply = _mlp(jax.random.key(0), (16, 32, 32, 4), lambda n: np.sqrt(2.0 / n))
    layers = activation_stats(apply, params, X)
    assert [l.name for l in layers] == ["params[0]", "params[1]", "params[2]"]
    assert [l.activation for l in layers] == ["relu", "relu", None]
    assert [l.is_output for l in layers] == [False, False, True]
    assert layers[0].units == 32 and layers[0].shape == (32, 32)
    assert 0.3 < layers[0].act_frac_zero < 0.7  # ReLU at init: about half the units off
    assert layers[0].location.endswith(f"test_init.py:{_mlp.__code__.co_firstlineno + 9}")  # the `x @ w + b` line
    params[-1]["w"] = params[-1]["w"] * 0.1  # a small head, as Karpathy's recipe advises
    assert check_init(apply, params, X, Y) == []


@pytest.mark.slow
def test_exploding_init_is_init_scale_with_the_layer():
    params, apply = _mlp(jax.random.key(0), (16, 64, 64, 64, 4), lambda n: np.sqrt(2.0 / n))
    params[1]["w"] = params[1]["w"] / np.sqrt(2.0 / 64) * 3.0  # BUG: std 3 in one layer, not sqrt(2/fan_in)
    findings = [f for f in check_init(apply, params, X) if f.code == "init.scale"]
    assert len(findings) == 1
    assert "grows" in findings[0].message and findings[0].path == "params[1]"
    assert findings[0].extra["ratio"] > 10 and "he_normal" in findings[0].hint


def test_vanishing_init_is_init_scale():
    params, apply = _mlp(jax.random.key(0), (16, 64, 64, 64, 4), lambda n: 0.01)  # BUG: tiny constant std
    findings = [f for f in check_init(apply, params, X) if f.code == "init.scale"]
    assert len(findings) == 1 and "shrinks" in findings[0].message


def _two_towers(deep_scale):
    """A CLIP-style model: an image tower on unit-scale vectors and a text tower on a mean of small embeddings
    (std 0.1), each He-initialised and L2-normalised; ``deep_scale`` is the text tower's deeper layers' std."""
    keys = jax.random.split(jax.random.key(0), 6)
    he = lambda k, n_in, n_out: jax.random.normal(k, (n_in, n_out)) * np.sqrt(2.0 / n_in)  # noqa: E731
    params = {
        "image": [he(keys[0], 16, 32), he(keys[1], 32, 8)],
        "embed": jax.random.normal(keys[2], (50, 16)) * 0.1,
        "text": [he(keys[3], 16, 32), jax.random.normal(keys[4], (32, 32)) * deep_scale, he(keys[5], 32, 8)],
    }

    def tower(layers, x):
        for w in layers[:-1]:
            x = jax.nn.relu(x @ w)
        x = x @ layers[-1]
        return x / jnp.linalg.norm(x, axis=-1, keepdims=True)

    def apply(params, inputs):
        image, tokens = inputs
        text = params["embed"][tokens].mean(axis=1)
        return tower(params["image"], image) @ tower(params["text"], text).T

    tokens = np.random.default_rng(1).integers(0, 50, (32, 6))
    return params, apply, (X, tokens)


def test_two_towers_are_two_chains_and_their_input_scales_are_not_compared():
    """The text tower's inputs are 10x smaller than the image tower's: no layer shrinks the signal, so no
    init.scale (it read the two towers as one chain and said the signal shrinks 18x); a tower whose own layers
    shrink it still is."""
    params, apply, inputs = _two_towers(np.sqrt(2.0 / 32))
    layers = activation_stats(apply, params, inputs)
    assert len({lay.chain for lay in layers}) == 2, [(lay.name, lay.chain) for lay in layers]
    assert not [f for f in check_init(apply, params, inputs) if f.code == "init.scale"]
    params, apply, inputs = _two_towers(1e-3)  # BUG: one layer of the text tower at std 1e-3
    (f,) = [f for f in check_init(apply, params, inputs) if f.code == "init.scale"]
    assert "shrinks" in f.message and "text" in f.path, f


class _PreNormTransformer(nn.Module):
    """A pre-norm transformer in GPT-2's init: every kernel at std 0.02, the last layer of each branch (the
    attention's output projection, the MLP's second layer) at 0.02 / sqrt(2 n_layers), added back into the
    stream that skipped the branch."""

    depth: int = 4
    width: int = 64

    @nn.compact
    def __call__(self, x):
        dense = functools.partial(nn.Dense, self.width, kernel_init=nn.initializers.normal(0.02))
        branch_end = functools.partial(
            nn.Dense, self.width, kernel_init=nn.initializers.normal(0.02 / np.sqrt(2 * self.depth))
        )
        x = dense()(x)
        for _ in range(self.depth):
            h = nn.LayerNorm()(x)
            q, k, v = dense()(h), dense()(h), dense()(h)
            att = jax.nn.softmax(q @ k.swapaxes(-1, -2) / np.sqrt(self.width), axis=-1)
            x = x + branch_end()(att @ v)
            h = nn.Dense(4 * self.width, kernel_init=nn.initializers.normal(0.02))(nn.LayerNorm()(x))
            x = x + branch_end()(nn.gelu(h))
        return nn.Dense(4)(nn.LayerNorm()(x))


@pytest.mark.slow
def test_a_pre_norm_transformer_with_down_scaled_branch_ends_is_not_init_scale():
    """The attention's output projection and the MLP's second layer are ~10x below the layers fed by a
    LayerNorm, on purpose (GPT-2's residual scaling): neither a branch's last layer nor a chain across a
    LayerNorm is judged (it read a block's output projection, MLP and the next block's query, key and value as
    one chain and said the scale grows 30x)."""
    model = _PreNormTransformer()
    tokens = X.reshape(4, 8, 16)
    params = model.init(jax.random.key(0), tokens)
    layers = activation_stats(model.apply, params, tokens)
    ends = [lay for lay in layers if lay.merged]
    assert len(ends) == 2 * model.depth and all(lay.shape[-1] == model.width for lay in ends), layers
    firsts = [lay for lay in layers if lay.shape[-1] == 4 * model.width]
    assert len({lay.chain for lay in firsts}) == model.depth  # each fed through its own LayerNorm
    assert [f for f in check_init(model.apply, params, tokens) if f.code == "init.scale"] == []


def _normalized_mlp(key, norm, input_scale):
    """An MLP with a normalization after every hidden activation, on inputs ``input_scale`` times too small."""
    params, _ = _mlp(key, (16, 64, 64, 64, 64, 4), lambda n: np.sqrt(2.0 / n))

    def apply(params, x):
        x = x * input_scale
        for layer in params[:-1]:
            x = norm(jax.nn.relu(x @ layer["w"] + layer["b"]))
        return x @ params[-1]["w"] + params[-1]["b"]

    return params, apply


def _rms_norm(x):
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)


def _standardize(x):
    return (x - jnp.mean(x, -1, keepdims=True)) / jnp.sqrt(jnp.var(x, -1, keepdims=True) + 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("norm", [_rms_norm, _standardize], ids=["rms_norm", "standardize"])
def test_a_normalization_starts_a_chain(norm):
    """Inputs 1000x too small make the first layer's outputs tiny, and the normalization after it restores the
    scale: the layers after it start a chain of their own (it said the scale grows 1000x); the layers between two
    normalizations still form one, so a layer that blows up the scale inside it is still found."""
    params, apply = _normalized_mlp(jax.random.key(0), norm, 1e-3)
    layers = activation_stats(apply, params, X)
    assert len({lay.chain for lay in layers}) == len(layers)
    assert [f for f in check_init(apply, params, X) if f.code == "init.scale"] == []

    params, apply = _mlp(jax.random.key(0), (16, 64, 64, 64, 4), lambda n: 1.0)  # BUG: std 1, no norm between

    def normed_input(params, x):
        return apply(params, norm(x))

    (f,) = [f for f in check_init(normed_input, params, X) if f.code == "init.scale"]
    assert "grows" in f.message


@pytest.mark.slow
def test_a_residual_mlp_with_a_huge_init_is_still_init_scale():
    """``x + relu(W x)``: each branch is one layer, fed by the stream it is added to, so it stays on the chain,
    and a std-1 init that grows the stream 8x per block is still found."""
    params, _ = _mlp(jax.random.key(0), (16, 64, 64, 64, 64, 4), lambda n: 1.0)  # BUG: std 1, not sqrt(2/n)

    def apply(params, x):
        x = x @ params[0]["w"]
        for layer in params[1:-1]:
            x = x + jax.nn.relu(x @ layer["w"] + layer["b"])
        return x @ params[-1]["w"]

    assert not [lay for lay in activation_stats(apply, params, X) if lay.merged]
    (f,) = [f for f in check_init(apply, params, X) if f.code == "init.scale"]
    assert "grows" in f.message


def test_saturated_tanh_is_init_scale():
    params, apply = _mlp(jax.random.key(0), (16, 32, 4), lambda n: 3.0, act=jnp.tanh)  # BUG: huge for tanh
    findings = [f for f in check_init(apply, params, X) if f.code == "init.scale"]
    assert len(findings) == 1 and "saturated" in findings[0].message and findings[0].path == "params[0]"


def test_lecun_relu_drift_is_not_flagged():
    """Flax's default lecun_normal halves the variance per ReLU layer: a slow drift, not a bug."""
    params, apply = _mlp(jax.random.key(1), (16, 64, 64, 64, 64, 4), lambda n: np.sqrt(1.0 / n))
    assert [f for f in check_init(apply, params, X) if f.code == "init.scale"] == []


class _ConstNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(16, kernel_init=nn.initializers.constant(0.1))(x))  # BUG: constant init
        return nn.Dense(4, kernel_init=nn.initializers.zeros)(h)  # fine: zero-init head is common


def test_constant_linen_init_is_symmetric_and_zero_head_is_exempt():
    model = _ConstNet()
    params = model.init(jax.random.key(0), X)["params"]
    apply = lambda p, x: model.apply({"params": p}, x)
    findings = check_init(apply, params, X)
    assert [(f.code, f.path) for f in findings] == [("init.symmetric", "params['Dense_0']")]
    assert findings[0].severity == "error" and findings[0].file.endswith("test_init.py")
    with pytest.raises(CheckFailed, match="init.symmetric"):
        assert_init_ok(apply, params, X)


class _ZeroHidden(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(16, 8, kernel_init=nnx.initializers.zeros, rngs=rngs)  # BUG: zero init
        self.out = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.tanh(self.hidden(x)))


def _nnx_experiment(module, lr=1e-3, loss=False):
    return nnx_classifier_experiment(module, X, Y, lr=lr, num_classes=4, loss=loss)


@pytest.mark.slow
def test_zero_init_nnx_layer_is_symmetric_in_doctor():
    diagnosis = jaxsane.doctor(_nnx_experiment(_ZeroHidden), stages=["init"], progress=False)
    symmetric = diagnosis.by_code("init.symmetric")
    assert [f.path for f in symmetric] == ["params['hidden']"]
    assert "random" in symmetric[0].hint
    layers = diagnosis.artifacts["init_activations"]
    assert [l["name"] for l in layers] == ["params['hidden']", "params['out']"]
    assert layers[0]["activation"] == "tanh"


class _LoRA(nnx.Module):
    """A projection with a LoRA adapter (as on an attention projection): B starts at zero (the recipe), its output
    added to the projection's, which the next layer reads."""

    def __init__(self, rngs, b_init=nnx.initializers.zeros_init(), hidden_init=nnx.initializers.lecun_normal()):
        self.base = nnx.Linear(16, 16, kernel_init=hidden_init, rngs=rngs)
        self.lora_a = nnx.Linear(16, 4, use_bias=False, rngs=rngs)
        self.lora_b = nnx.Linear(4, 16, use_bias=False, kernel_init=b_init, rngs=rngs)
        self.mid = nnx.Linear(16, 16, kernel_init=hidden_init, rngs=rngs)
        self.out = nnx.Linear(16, 4, kernel_init=hidden_init, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.tanh(self.mid(self.base(x) + self.lora_b(self.lora_a(x)))))


@pytest.mark.slow
def test_symmetric_units_are_judged_by_their_first_gradient_in_doctor():
    """LoRA's B = 0 parts on the first update (the residual reads each unit differently): no finding. A zero
    hidden layer before tanh parts only through the next layer's weights: a warning. Every layer constant: the
    units get the same gradient too and never part: the error."""
    lora = jaxsane.doctor(_nnx_experiment(_LoRA), stages=["init"], progress=False)
    assert not lora.by_code("init.symmetric"), lora
    (slow,) = jaxsane.doctor(_nnx_experiment(_ZeroHidden), stages=["init"], progress=False).by_code("init.symmetric")
    assert slow.severity == "warning" and slow.extra["parts_by_gradient"] and "first update" in slow.message
    const = nnx.initializers.constant(0.1)
    stuck = _nnx_experiment(lambda rngs: _LoRA(rngs, b_init=const, hidden_init=const))
    found = jaxsane.doctor(stuck, stages=["init"], progress=False).by_code("init.symmetric")
    assert found and all(f.severity == "error" for f in found), found


class _ZeroOutResidual(nnx.Module):
    """A diffusion U-Net's recipe in small: the residual branch's last layer and the output layer start at zero, so
    at init the zero output layer blocks every gradient behind it (the residual layer's is identically zero)."""

    def __init__(self, rngs, zero=nnx.initializers.zeros):
        self.inp = nnx.Linear(16, 16, rngs=rngs)
        self.branch = nnx.Linear(16, 16, rngs=rngs)
        self.merge = nnx.Linear(16, 16, kernel_init=zero, rngs=rngs)  # the residual branch's last layer
        self.out = nnx.Linear(16, 4, kernel_init=zero, rngs=rngs)

    def __call__(self, x):
        h = self.inp(x)
        h = h + self.merge(nnx.tanh(self.branch(h)))
        return self.out(nnx.tanh(h))


@pytest.mark.slow
def test_a_layer_blocked_by_a_zero_layer_further_on_is_judged_after_a_synthetic_update():
    """A zero gradient at init is no evidence: the zero residual layer parts once the zero output layer moves (no
    finding), judged by the loss after a synthetic update, or with no loss by the step's first updates that move
    something (a warmup from a rate of 0 moves nothing at first); in an all-zero network the gradient stays zero
    after that update too: still the error."""
    warmup, zero = optax.linear_schedule(0.0, 1e-3, 10), nnx.initializers.zeros
    for loss in (True, False):
        blocked = _nnx_experiment(_ZeroOutResidual, lr=warmup, loss=loss)
        found = jaxsane.doctor(blocked, stages=["init"], progress=False)
        assert not found.by_code("init.symmetric"), (loss, found)
        stuck = _nnx_experiment(lambda rngs: _LoRA(rngs, b_init=zero, hidden_init=zero), lr=warmup, loss=loss)
        found = jaxsane.doctor(stuck, stages=["init"], progress=False).by_code("init.symmetric")
        assert found and all(f.severity == "error" for f in found), (loss, found)


@pytest.mark.slow
def test_conv_layers_are_found():
    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.gelu(nn.Conv(4, (3, 3))(x))
            return nn.Dense(2)(x.reshape(x.shape[0], -1))

    x = np.random.default_rng(1).normal(size=(4, 6, 6, 1)).astype(np.float32)
    model = CNN()
    params = model.init(jax.random.key(0), x)["params"]
    layers = activation_stats(lambda p, x: model.apply({"params": p}, x), params, x)
    assert [(l.kind, l.name, l.activation, l.units) for l in layers] == [
        ("conv", "params['Conv_0']", "gated", 4), ("dense", "params['Dense_0']", None, 2)]
    assert layers[0].symmetry > 1e-3  # jax.nn.gelu is inlined: x * cdf(x) is read as a gated activation
    assert np.isnan(layers[0].act_frac_saturated)  # unbounded: its inner tanh is not "saturation"


def test_overconfident_logits_are_init_loss():
    params, apply = _mlp(jax.random.key(0), (16, 32, 4), lambda n: np.sqrt(2.0 / n))
    params[-1]["w"] = params[-1]["w"] * 30.0  # BUG: huge last layer
    findings = check_init(apply, params, X, Y)
    assert [f.code for f in findings] == ["init.loss"]


def test_init_stage_needs_apply_for_activations():
    exp = _nnx_experiment(_ZeroHidden)
    exp = jaxsane.Experiment(init=exp.init, step=exp.step, train=exp.train, num_classes=4)
    diagnosis = jaxsane.doctor(exp, stages=["init"], progress=False)
    assert any(f.code == "doctor.skipped" and "activation" in f.message for f in diagnosis)
    assert not diagnosis.by_code("init.symmetric")


# ----------------------------------------------------------------------------- init.loss: what the loss is
_T, _V = 12, 6  # time steps, vocabulary (class 0 is CTC's blank)


def _sequence_experiment(kind, scale=1.0):
    """A per-time-step classifier [B, T, V] trained with ``kind``'s loss: "mean_xent" (per-token mean
    cross-entropy: ln V is its chance level), "summed_xent" (a sequence log-likelihood summed over time) or
    "ctc" (optax.ctc_loss over shorter label sequences)."""
    import optax

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, _T, 8)).astype(np.float32)
    labels = rng.integers(1, _V, size=(16, _T if kind != "ctc" else 4)).astype(np.int32)
    params = {"w": jnp.asarray(rng.normal(size=(8, _V)) * 0.3 * scale, jnp.float32), "b": jnp.zeros(_V)}

    def apply(p, x):
        return x @ p["w"] + p["b"]

    def loss(p, b):
        logits = apply(p, b["x"])
        if kind == "ctc":
            pads = jnp.zeros(logits.shape[:2])
            return optax.ctc_loss(logits, pads, b["y"], jnp.zeros(b["y"].shape)).mean()
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits, b["y"])
        return per_token.sum(axis=1).mean() if kind == "summed_xent" else per_token.mean()

    tx = optax.sgd(1e-2)

    def step(state, b):
        p, o = state
        value, g = jax.value_and_grad(loss)(p, b)
        u, o = tx.update(g, o, p)
        return (optax.apply_updates(p, u), o), {"loss": value}

    return jaxsane.Experiment(init=lambda k: (params, tx.init(params)), step=step, train={"x": x, "y": labels},
                              loss=loss, apply=apply, num_classes=_V)


@pytest.mark.parametrize("kind", ["ctc", "summed_xent"])
def test_init_loss_is_not_judged_against_ln_c_for_a_loss_that_is_not_a_mean_cross_entropy(kind):
    d = jaxsane.doctor(_sequence_experiment(kind), stages=["init"], progress=False)
    assert "init.loss" not in [f.code for f in d], [str(f) for f in d]
    skipped = [f for f in d if f.code == "doctor.skipped" and "ln C" in f.message]
    assert d.artifacts["init_loss"]["num_classes"] is None
    assert skipped or "constant_loss" in d.artifacts["init_loss"], [str(f) for f in d]


def test_init_loss_still_judges_a_per_token_cross_entropy_against_ln_c():
    healthy = jaxsane.doctor(_sequence_experiment("mean_xent"), stages=["init"], progress=False)
    assert "init.loss" not in [f.code for f in healthy] and healthy.artifacts["init_loss"]["num_classes"] == _V
    overconfident = jaxsane.doctor(_sequence_experiment("mean_xent", scale=40.0), stages=["init"], progress=False)
    assert "init.loss" in [f.code for f in overconfident], [str(f) for f in overconfident]


def _token_lm_experiment(target="next", scale=1.0):
    """A causal bigram LM over a batch of token ids alone (no labels): the loss predicts token t + 1 from position
    t ("next"), as a language model's does, or token t itself ("same", an autoencoder's objective); padding
    (id 0) at the rows' ends is masked out of the loss."""
    import optax

    rng = np.random.default_rng(0)
    tokens = rng.integers(1, _V, size=(16, _T)).astype(np.int32)
    tokens[::2, -3:] = 0  # trailing padding on half the rows
    params = {"emb": jnp.asarray(rng.normal(size=(_V, 8)) * 0.3, jnp.float32),
              "w": jnp.asarray(rng.normal(size=(8, _V)) * 0.3 * scale, jnp.float32)}

    def apply(p, ids):
        return p["emb"][ids] @ p["w"]

    def loss(p, b):
        ids = b["tokens"]
        inputs, targets = (ids[:, :-1], ids[:, 1:]) if target == "next" else (ids, ids)
        weights = (targets != 0).astype(jnp.float32)
        per_token = optax.softmax_cross_entropy_with_integer_labels(apply(p, inputs), targets)
        return (per_token * weights).sum() / weights.sum()

    tx = optax.sgd(1e-2)

    def step(state, b):
        p, o = state
        value, g = jax.value_and_grad(loss)(p, b)
        u, o = tx.update(g, o, p)
        return (optax.apply_updates(p, u), o), {"loss": value}

    return jaxsane.Experiment(init=lambda k: (params, tx.init(params)), step=step, train={"tokens": tokens},
                              loss=loss, apply=apply, inputs=lambda b: b["tokens"], mask=lambda b: b["tokens"] != 0)


def test_a_language_models_loss_at_init_is_judged_against_ln_vocabulary_through_its_next_tokens():
    healthy = jaxsane.doctor(_token_lm_experiment(), stages=["init"], progress=False)
    assert healthy.artifacts["init_loss"]["num_classes"] == _V, [str(f) for f in healthy]
    assert "init.loss" not in [f.code for f in healthy], [str(f) for f in healthy]
    overconfident = jaxsane.doctor(_token_lm_experiment(scale=40.0), stages=["init"], progress=False)
    assert "init.loss" in [f.code for f in overconfident], [str(f) for f in overconfident]
    # a loss on the token itself is no next-token loss: ln V is not claimed as its chance level
    # (near-uniform logits give every mean cross-entropy over V classes about ln V, its chance level too: told
    # apart only where the logits are not)
    same = _token_lm_experiment("same", scale=40.0)
    adapted = PureExperiment(same)
    c, why = classification_of(adapted, adapted.init(jax.random.key(0)), same.train)
    assert c is None and "next input token" in why, why


# ----------------------------------------------------------------------------- init.loss: where the loss comes from
def _regression_experiment(*, donate=False, jitted=True, nan=False, loss_handle=False):
    """A linear regression trained by a (jitted, optionally donating) step that reports its loss, for 10 classes
    (the loss at init is judged); ``Experiment.loss`` only when asked: without it, the loss at init is the one the
    step reports on its first call."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    y = (x @ np.arange(1.0, 5.0, dtype=np.float32))[:, None]
    w = jnp.full((4, 1), jnp.nan if nan else 0.1, jnp.float32)

    def loss(p, b):
        return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)

    def step(state, b):
        value, g = jax.value_and_grad(loss)(state, b)
        return jax.tree_util.tree_map(lambda p, d: p - 0.01 * d, state, g), {"loss": value}

    if jitted:
        step = jax.jit(step, donate_argnums=(0,) if donate else ())
    return jaxsane.Experiment(
        init=lambda k: {"w": w}, step=step, train={"x": x, "y": y}, loss=loss if loss_handle else None,
        params=lambda state: state, num_classes=10,
    )


@pytest.mark.parametrize("donate", [False, True])
def test_a_step_only_experiment_takes_its_init_loss_from_the_users_compiled_step_compiled_once(donate):
    exp = _regression_experiment(donate=donate)
    d = jaxsane.doctor(exp, stages=["init", "step"], progress=False, compile_cache=False)
    record = d.artifacts["init_loss"]
    assert record["source"] == "the loss the step reports on its first call", record
    x, y = exp.train["x"], exp.train["y"]
    assert record["loss"] == pytest.approx(float(np.mean((x @ np.full((4, 1), 0.1, np.float32) - y) ** 2)), rel=1e-5)
    # the init stage's one compile is the user's step, which the step stage reuses (it was compiled twice)
    init, step = (next(s for s in d.stages if s["name"] == name) for name in ("init", "step"))
    assert init["compiles"] == 1 and step["compiles"] == 0, (init, step)
    assert "step.recompiles" not in [f.code for f in d], [str(f) for f in d]


def test_a_nan_loss_from_the_steps_first_call_is_still_init_loss():
    d = jaxsane.doctor(_regression_experiment(nan=True), stages=["init"], progress=False)
    assert d.artifacts["init_loss"]["source"] == "the loss the step reports on its first call"
    assert "init.loss" in [f.code for f in d if f.severity == "error"], [str(f) for f in d]


def test_experiment_loss_comes_first_and_an_unjitted_step_reports_its_own():
    d = jaxsane.doctor(_regression_experiment(loss_handle=True), stages=["init"], progress=False)
    assert d.artifacts["init_loss"]["source"] == "Experiment.loss", d.artifacts["init_loss"]
    unjitted = jaxsane.doctor(_regression_experiment(jitted=False), stages=["init"], progress=False)
    assert unjitted.artifacts["init_loss"]["source"] == "the loss the step reports on its first call"


class _BNNet(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 6, rngs=rngs)
        self.bn = nnx.BatchNorm(6, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.bn(self.l1(x)))))


def test_traceable_loss_shares_the_handles_trace_unless_it_casts():
    """On a float32 model the traceable loss is the loss handle's own function: one trace of the user's loss per
    input signature, shared by every program built on either (the gradient check and the run's telemetry). With
    float64 parameters it copies the other variables in float64 itself (BatchNorm's statistics), its own trace."""
    from jaxsane._checks.init import traceable
    from jaxsane._experiment.contract import PureExperiment

    calls = []

    def loss(model, b):
        calls.append(1)
        return optax.softmax_cross_entropy_with_integer_labels(model(b["x"]), b["y"]).mean()

    def init(key):
        model = _BNNet(nnx.Rngs(params=key, dropout=jax.random.fold_in(key, 1)))
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    batch = {"x": np.ones((8, 4), np.float32), "y": np.arange(8) % 3}
    exp = jaxsane.Experiment(init=init, step=lambda m, o, b: None, train=batch, loss=loss)
    adapted = PureExperiment(exp, key=jax.random.key(0))
    params = adapted.params(adapted.init(jax.random.key(0)))
    shared = traceable(adapted, "loss")
    value = float(jax.jit(shared)(params, batch))
    assert len(calls) == 1
    assert float(jax.jit(adapted.loss_fn)(params, batch)) == value and len(calls) == 1, "one trace, shared"
    with jax.enable_x64(True):
        wide = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float64), params)
        assert np.isfinite(float(jax.jit(shared)(wide, batch)))  # BatchNorm's stats copied in float64: no error
    assert len(calls) == 2, "a cast is the traceable loss's own trace"
