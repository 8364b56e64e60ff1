"""The programs of benchmarks/doctor_scaling.py: realistic models at the sizes people train, as they write them.

* ``lm_1m``, ``lm_10m``, ``lm_50m``: a Flax NNX causal transformer LM (pre-LayerNorm blocks, causal
  attention with padding masks, GELU MLP, dropout, adamw with warmup-cosine), sequence 128, batch 8;
  about 1M, 10M and 50M parameters.
* ``cnn_small``, ``cnn_large``: a Flax linen CNN with BatchNorm (conv-BN-ReLU blocks, average pooling,
  a dense head; a ``TrainState`` with ``batch_stats``, sgd with momentum) on 10-class images, 28x28x1
  and 32x32x3, about 0.1M and 1.2M parameters.
* ``lstm_7m``: a Flax linen LM of two stacked LSTM layers (``nn.RNN(nn.OptimizedLSTMCell)``, adam), sequence
  128, batch 16, about 7M parameters: a step bound by its loop over time steps rather than by its flops.

``python benchmarks/programs/scaling.py RUNG [--steps 30]`` is the user's own cold run: import, init, the
first (compiling) step, then the remaining steps, printing one JSON line of timings. ``RUNG`` as a doctor
target: ``benchmarks/programs/scaling.py:lm_1m``. Healthy programs: doctor must report no error on them.
"""

from __future__ import annotations

import json
import sys
import time

_T0 = time.perf_counter()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402
from flax.training import train_state  # noqa: E402

import jaxsane  # noqa: E402

# name -> (layers, width, heads, vocabulary)
LM_SIZES = {"lm_1m": (4, 128, 4, 2048), "lm_10m": (6, 352, 8, 4096), "lm_50m": (8, 704, 8, 4096)}
# name -> (image shape, channels per block, dense width)
CNN_SIZES = {"cnn_small": ((28, 28, 1), (32, 64), 128), "cnn_large": ((32, 32, 3), (64, 128, 256), 256)}
SEQ, BATCH = 128, 8


# ----------------------------------------------------------------------------- the causal LM (NNX)


class Block(nnx.Module):
    def __init__(self, d, heads, rngs):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=heads, in_features=d, qkv_features=d, decode=False, dropout_rate=0.1, rngs=rngs
        )
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.drop(self.down(nnx.gelu(self.up(self.ln2(x)))))


class LM(nnx.Module):
    def __init__(self, layers, d, heads, vocab, rngs, seq=SEQ):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (seq, d)) * 0.02)
        self.blocks = nnx.List([Block(d, heads, rngs) for _ in range(layers)])
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens, pad_mask):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        mask = nnx.combine_masks(nnx.make_causal_mask(tokens), nnx.make_attention_mask(pad_mask, pad_mask))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


def lm_data(vocab, n=256, seed=0, seq=SEQ):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, size=(n, seq + 1)).astype(np.int32)
    for t in range(1, seq + 1):  # learnable structure: the next token is often the previous one + 1
        follow = rng.random(n) < 0.7
        tokens[follow, t] = (tokens[follow, t - 1] % (vocab - 1)) + 1
    lengths = rng.integers(seq // 2, seq + 2, size=n)
    mask = np.arange(seq + 1)[None] < lengths[:, None]
    return {"tokens": np.where(mask, tokens, 0), "mask": mask.astype(np.int32)}


def lm_loss(model, batch):
    inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    m = batch["mask"][:, 1:].astype(jnp.float32)
    logits = model(inputs, batch["mask"][:, :-1])
    return (optax.softmax_cross_entropy_with_integer_labels(logits, targets) * m).sum() / m.sum()


@nnx.jit
def lm_step(model, opt, batch):
    model.train()
    loss, grads = nnx.value_and_grad(lm_loss)(model, batch)
    opt.update(model, grads)
    return loss


def lm_experiment(name, sizes=None, *, seq=SEQ, batch=BATCH, peak_lr=1e-3, eval_examples=32):
    """The LM rung ``name`` (``LM_SIZES``), or a model of ``sizes`` = (layers, width, heads, vocabulary)."""
    layers, d, heads, vocab = sizes or LM_SIZES[name]

    def init(key):
        model = LM(layers, d, heads, vocab, nnx.Rngs(params=key, dropout=jax.random.fold_in(key, 1)), seq=seq)
        model.train()
        schedule = optax.warmup_cosine_decay_schedule(0.0, peak_lr, 20, 1000)
        return model, nnx.Optimizer(model, optax.adamw(schedule, weight_decay=0.01), wrt=nnx.Param)

    data, ev = lm_data(vocab, seq=seq), lm_data(vocab, eval_examples, seed=1, seq=seq)
    return jaxsane.Experiment(
        init=init, step=lm_step, train=lambda: batches(data, batch), eval=ev, loss=lm_loss,
        inputs=lambda b: b["tokens"], mask=lambda b: b["mask"], name=name,
    )


# ----------------------------------------------------------------------------- the CNN with BatchNorm (linen)


class CNN(nn.Module):
    channels: tuple
    dense: int

    @nn.compact
    def __call__(self, x, train: bool):
        for c in self.channels:
            x = nn.Conv(c, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.avg_pool(nn.relu(x), (2, 2), (2, 2))
        x = nn.relu(nn.Dense(self.dense)(x.reshape(x.shape[0], -1)))
        return nn.Dense(10)(x)


class BNState(train_state.TrainState):
    batch_stats: dict


def cnn_data(shape, n=256, seed=0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n).astype(np.int32)
    protos = np.random.default_rng(99).normal(size=(10, *shape)).astype(np.float32)
    images = protos[labels] + rng.normal(size=(n, *shape)).astype(np.float32)
    return {"image": images, "label": labels}


def cnn_experiment(name):
    shape, channels, dense = CNN_SIZES[name]
    model = CNN(channels, dense)

    def init(key):
        variables = model.init(key, jnp.zeros((1, *shape)), train=False)
        return BNState.create(
            apply_fn=model.apply, params=variables["params"], batch_stats=variables["batch_stats"],
            tx=optax.sgd(0.05, momentum=0.9),
        )

    @jax.jit
    def step(state, batch):
        def loss_fn(params):
            logits, updates = model.apply(
                {"params": params, "batch_stats": state.batch_stats}, batch["image"], train=True,
                mutable=["batch_stats"],
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
            return loss, updates

        (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        state = state.apply_gradients(grads=grads).replace(batch_stats=updates["batch_stats"])
        return state, {"loss": loss}

    data, ev = cnn_data(shape), cnn_data(shape, 64, seed=1)
    return jaxsane.Experiment(
        init=init, step=step, train=lambda: batches(data, 32), eval=ev,
        inputs=lambda b: b["image"], labels=lambda b: b["label"], num_classes=10, name=name,
    )


# ----------------------------------------------------------------------------- the LSTM LM (linen)


class LSTMLM(nn.Module):
    """Two stacked LSTM layers over token embeddings: a step is a loop over the sequence's time steps, so it costs
    about as much on 2 examples as on 16 (bound by the loop, not by its flops)."""

    vocab: int
    width: int
    hidden: int

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width)(tokens)
        x = nn.RNN(nn.OptimizedLSTMCell(self.hidden))(x)
        x = nn.RNN(nn.OptimizedLSTMCell(self.hidden))(x)
        return nn.Dense(self.vocab)(x)


def lstm_experiment(vocab=4096, width=256, hidden=512, batch=16):
    model = LSTMLM(vocab, width, hidden)
    data, ev = lm_data(vocab, n=512), lm_data(vocab, 64, seed=1)

    def init(key):
        params = model.init(key, jnp.zeros((1, SEQ), jnp.int32))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(2e-3))

    def loss(params, b):
        logits = model.apply({"params": params}, b["tokens"][:, :-1])
        m = b["mask"][:, 1:].astype(jnp.float32)
        return (optax.softmax_cross_entropy_with_integer_labels(logits, b["tokens"][:, 1:]) * m).sum() / m.sum()

    @jax.jit
    def step(state, b):
        value, grads = jax.value_and_grad(loss)(state.params, b)
        return state.apply_gradients(grads=grads), {"loss": value}

    return jaxsane.Experiment(
        init=init, step=step, train=lambda: batches(data, batch), eval=ev, loss=loss,
        inputs=lambda b: b["tokens"], mask=lambda b: b["mask"], name="lstm_7m",
    )


# ----------------------------------------------------------------------------- shared


def batches(data, bs=BATCH):
    n = len(next(iter(data.values())))
    i = 0
    while True:
        idx = np.arange(i, i + bs) % n
        yield {k: v[idx] for k, v in data.items()}
        i += bs


def lm_1m():
    return lm_experiment("lm_1m")


def lm_10m():
    return lm_experiment("lm_10m")


def lm_50m():
    return lm_experiment("lm_50m")


def cnn_small():
    return cnn_experiment("cnn_small")


def cnn_large():
    return cnn_experiment("cnn_large")


def lstm_7m():
    return lstm_experiment()


RUNGS = {
    "lm_1m": lm_1m, "lm_10m": lm_10m, "lm_50m": lm_50m, "cnn_small": cnn_small, "cnn_large": cnn_large,
    "lstm_7m": lstm_7m,
}


def user_run(name, steps=30):
    """The user's own cold run, as they would write it: init, the first step (compiles), the rest. Timings."""
    imported = time.perf_counter() - _T0
    exp = RUNGS[name]()
    state = exp.init(jax.random.key(0))
    it = iter(exp.train())
    nnx_style = isinstance(state, tuple)
    t = time.perf_counter()
    first_done = None
    for i in range(steps):
        batch = next(it)
        if nnx_style:
            loss = exp.step(*state, batch)
        else:
            state, metrics = exp.step(state, batch)
            loss = metrics["loss"]
        if i == 0:
            jax.block_until_ready(loss)
            first_done = time.perf_counter()
    jax.block_until_ready(loss)
    end = time.perf_counter()
    leaves = jax.tree_util.tree_leaves(nnx.state(state[0], nnx.Param) if nnx_style else state.params)
    return {
        "rung": name,
        "params": int(sum(np.size(x) for x in leaves)),
        "import_s": imported,
        "init_s": t - _T0 - imported,
        "first_step_s": first_done - t,
        "steps_s": end - first_done,
        "loss": float(loss),
        "device_peak_mb": device_peak_mb(),
    }


def device_peak_mb():
    """The device's peak memory in MB as its allocator reports it (a GPU or TPU), None where it reports none (CPU)."""
    stats = jax.devices()[0].memory_stats()
    return stats["peak_bytes_in_use"] / 2**20 if stats and "peak_bytes_in_use" in stats else None


if __name__ == "__main__":
    rung = sys.argv[1]
    n_steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 30
    print(json.dumps(user_run(rung, n_steps)))
