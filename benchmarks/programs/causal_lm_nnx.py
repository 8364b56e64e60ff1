"""A small causal transformer LM as people write it in Flax NNX: 2 layers, d=64, sequence 32, vocabulary
50, padding masks, dropout, adamw with warmup; next-token targets shifted inside the loss.

Used by benchmarks/doctor_speed.py (doctor time on a real sequence model); healthy, so doctor must give
no error on it.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxsane

VOCAB, SEQ, D, HEADS = 50, 32, 64, 4


class Block(nnx.Module):
    def __init__(self, rngs):
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, qkv_features=D, decode=False,
                                           dropout_rate=0.1, rngs=rngs)
        self.ln2 = nnx.LayerNorm(D, rngs=rngs)
        self.mlp1 = nnx.Linear(D, 4 * D, rngs=rngs)
        self.mlp2 = nnx.Linear(4 * D, D, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.drop(self.mlp2(nnx.gelu(self.mlp1(self.ln2(x)))))


class LM(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (SEQ, D)) * 0.02)
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, tokens, pad_mask):
        T = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:T]
        causal = nnx.make_causal_mask(tokens)
        mask = nnx.combine_masks(causal, nnx.make_attention_mask(pad_mask, pad_mask))
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln(x))


def make_data(n=256, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, size=(n, SEQ + 1)).astype(np.int32)
    # a simple learnable structure: next token often = previous + 1
    for t in range(1, SEQ + 1):
        follow = rng.random(n) < 0.7
        tokens[follow, t] = (tokens[follow, t - 1] % (VOCAB - 1)) + 1
    lengths = rng.integers(SEQ // 2, SEQ + 2, size=n)
    mask = (np.arange(SEQ + 1)[None] < lengths[:, None])
    tokens = np.where(mask, tokens, 0)
    return {"tokens": tokens, "mask": mask.astype(np.int32)}


def loss_fn(model, batch):
    inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    m = batch["mask"][:, 1:].astype(jnp.float32)
    logits = model(inputs, batch["mask"][:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return (ce * m).sum() / m.sum()


schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 20, 1000)


def init(key):
    model = LM(nnx.Rngs(params=key, dropout=jax.random.fold_in(key, 1)))
    model.train()  # dropout on until eval() is called
    opt = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=0.01), wrt=nnx.Param)
    return model, opt


@nnx.jit
def train_step(model, opt, batch):
    model.train()
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    opt.update(model, grads)
    return loss


def batches(data, bs=16):
    n = len(data["tokens"])
    i = 0
    while True:
        idx = np.arange(i, i + bs) % n
        yield {k: v[idx] for k, v in data.items()}
        i += bs


def experiment():
    data = make_data()
    ev = make_data(64, seed=1)
    return jaxsane.Experiment(init=init, step=train_step, train=lambda: batches(data), eval=ev,
                              loss=loss_fn, inputs=lambda b: b["tokens"], mask=lambda b: b["mask"],
                              name="lm_nnx")
