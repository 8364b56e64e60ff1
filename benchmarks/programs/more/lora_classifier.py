"""LoRA fine-tuning of a Flax linen transformer text classifier (~5M params, 4 classes).

The base weights (embeddings, attention and MLP kernels, LayerNorms) are frozen with
optax.multi_transform(set_to_zero); only the LoRA A/B matrices (B starts at zero, so the
fine-tuned model starts as the base model) and the classification head are trained with adam.
Mean pooling over non-padding tokens. A TrainState with a dropout key.

``python lora_classifier.py [--steps 30]``: the cold run, JSON timings.
"""

from __future__ import annotations

import json
import sys
import time

_T0 = time.perf_counter()

from typing import Any  # noqa: E402

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax.training import train_state  # noqa: E402

import jaxsane  # noqa: E402

VOCAB, SEQ, BATCH, CLASSES = 8000, 128, 16, 4
DIM, LAYERS, HEADS, MLP = 256, 4, 4, 1024
RANK, ALPHA = 8, 16.0
PAD = 0


class LoRADense(nn.Module):
    """A Dense layer with a frozen base kernel plus a trainable low-rank update (alpha/r) * x A B."""

    features: int
    rank: int = RANK
    alpha: float = ALPHA

    @nn.compact
    def __call__(self, x):
        base = nn.Dense(self.features, name="base")(x)
        a = self.param("lora_a", nn.initializers.kaiming_uniform(), (x.shape[-1], self.rank))
        b = self.param("lora_b", nn.initializers.zeros, (self.rank, self.features))
        return base + (x @ a @ b) * (self.alpha / self.rank)


class SelfAttention(nn.Module):
    dim: int
    heads: int

    @nn.compact
    def __call__(self, x, mask, deterministic):
        b, t, _ = x.shape
        hd = self.dim // self.heads
        q = LoRADense(self.dim, name="query")(x).reshape(b, t, self.heads, hd)
        k = nn.Dense(self.dim, name="key")(x).reshape(b, t, self.heads, hd)
        v = LoRADense(self.dim, name="value")(x).reshape(b, t, self.heads, hd)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd)
        scores = jnp.where(mask, scores, -1e9)
        probs = nn.Dropout(0.1)(jax.nn.softmax(scores, axis=-1), deterministic=deterministic)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, self.dim)
        return nn.Dense(self.dim, name="out")(out)


class EncoderBlock(nn.Module):
    dim: int
    heads: int
    mlp: int

    @nn.compact
    def __call__(self, x, mask, deterministic):
        h = SelfAttention(self.dim, self.heads)(nn.LayerNorm()(x), mask, deterministic)
        x = x + nn.Dropout(0.1)(h, deterministic=deterministic)
        h = nn.Dense(self.mlp)(nn.LayerNorm()(x))
        h = nn.Dense(self.dim)(nn.gelu(h))
        return x + nn.Dropout(0.1)(h, deterministic=deterministic)


class Classifier(nn.Module):
    vocab: int = VOCAB
    dim: int = DIM
    layers: int = LAYERS
    heads: int = HEADS
    mlp: int = MLP
    classes: int = CLASSES
    max_len: int = SEQ

    @nn.compact
    def __call__(self, tokens, pad_mask, deterministic=True):
        x = nn.Embed(self.vocab, self.dim)(tokens)
        pos = self.param("pos_embedding", nn.initializers.normal(0.02), (self.max_len, self.dim))
        x = x + pos[: tokens.shape[1]]
        attn_mask = nn.make_attention_mask(pad_mask, pad_mask)
        for i in range(self.layers):
            x = EncoderBlock(self.dim, self.heads, self.mlp, name=f"block_{i}")(x, attn_mask, deterministic)
        x = nn.LayerNorm()(x)
        m = pad_mask[..., None].astype(x.dtype)
        pooled = (x * m).sum(axis=1) / jnp.maximum(m.sum(axis=1), 1.0)
        return nn.Dense(self.classes, name="head")(pooled)


# ----------------------------------------------------------------------------- data


def make_data(n, seed, seq=SEQ, vocab=VOCAB):
    """Each class has 16 keyword tokens; a sentence is random tokens with 3-8 keywords of its class; lengths vary
    and the rest is PAD."""
    rng = np.random.default_rng(seed)
    keywords = np.random.default_rng(1234).choice(np.arange(1, vocab), size=(CLASSES, 16), replace=False)
    labels = rng.integers(0, CLASSES, n).astype(np.int32)
    tokens = rng.integers(1, vocab, size=(n, seq)).astype(np.int32)
    lengths = rng.integers(16, seq + 1, size=n)
    for i in range(n):
        k = rng.integers(3, 9)
        pos = rng.choice(lengths[i], size=k, replace=False)
        tokens[i, pos] = rng.choice(keywords[labels[i]], size=k)
    mask = np.arange(seq)[None] < lengths[:, None]
    return {"tokens": np.where(mask, tokens, PAD).astype(np.int32), "mask": mask, "label": labels}


def train_batches(data, bs=BATCH, seed=0):
    n = len(data["label"])
    rng = np.random.default_rng(seed)
    while True:
        perm = rng.permutation(n)
        for i in range(0, n - bs + 1, bs):
            idx = perm[i : i + bs]
            yield {k: v[idx] for k, v in data.items()}


TRAIN = make_data(2048, seed=0)
EVAL = make_data(256, seed=1)


# ----------------------------------------------------------------------------- LoRA optimizer


def lora_labels(params):
    """'train' for LoRA factors and the head, 'frozen' for everything else."""
    flat = flax.traverse_util.flatten_dict(params)
    labels = {
        path: "train" if (path[-1] in ("lora_a", "lora_b") or path[0] == "head") else "frozen"
        for path in flat
    }
    return flax.traverse_util.unflatten_dict(labels)


def make_optimizer(lr=1e-3):
    return optax.multi_transform({"train": optax.adam(lr), "frozen": optax.set_to_zero()}, lora_labels)


class TrainState(train_state.TrainState):
    dropout_key: Any = None


model = Classifier()


def init(key):
    pkey, dkey = jax.random.split(key)
    dummy = jnp.ones((1, SEQ), jnp.int32)
    params = model.init(pkey, dummy, dummy != PAD)["params"]  # stands in for the pretrained checkpoint
    return TrainState.create(apply_fn=model.apply, params=params, tx=make_optimizer(), dropout_key=dkey)


def loss_fn(params, batch, dropout_key=None):
    logits = model.apply(
        {"params": params}, batch["tokens"], batch["mask"], deterministic=dropout_key is None,
        rngs=None if dropout_key is None else {"dropout": dropout_key},
    )
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


@jax.jit
def train_step(state, batch):
    dropout_key = jax.random.fold_in(state.dropout_key, state.step)
    loss, grads = jax.value_and_grad(loss_fn)(state.params, batch, dropout_key)
    return state.apply_gradients(grads=grads), {"loss": loss}


@jax.jit
def eval_step(state, batch):
    logits = model.apply({"params": state.params}, batch["tokens"], batch["mask"])
    return (logits.argmax(-1) == batch["label"]).mean()


experiment = jaxsane.Experiment(
    init=init,
    step=train_step,
    train=lambda: train_batches(TRAIN),
    eval=EVAL,
    loss=loss_fn,
    apply=lambda params, tokens: model.apply({"params": params}, tokens, tokens != PAD),
    inputs=lambda b: b["tokens"],
    labels=lambda b: b["label"],
    mask=lambda b: b["mask"],
    num_classes=CLASSES,
    name="lora_classifier",
)


def count(tree):
    return int(sum(np.size(x) for x in jax.tree.leaves(tree)))


if __name__ == "__main__":
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 31
    imported = time.perf_counter() - _T0
    state = experiment.init(jax.random.key(0))
    it = iter(experiment.train())
    t = time.perf_counter()
    first_done = None
    losses = []
    for i in range(steps):
        state, metrics = experiment.step(state, next(it))
        if i == 0:
            jax.block_until_ready(metrics["loss"])
            first_done = time.perf_counter()
        if i % 10 == 0 or i == steps - 1:
            losses.append(float(metrics["loss"]))
    jax.block_until_ready(state)
    end = time.perf_counter()
    trainable = jax.tree.map(lambda lab, p: p if lab == "train" else None, lora_labels(state.params), state.params)
    print(json.dumps({
        "program": "lora_classifier", "params": count(state.params), "trainable_params": count(trainable),
        "import_s": imported, "init_s": t - _T0 - imported, "first_step_s": first_done - t,
        "steps_s": end - first_done, "total_s": end - _T0, "losses_every_10": losses,
        "final_loss": float(metrics["loss"]), "eval_acc": float(eval_step(state, EVAL)),
    }))
