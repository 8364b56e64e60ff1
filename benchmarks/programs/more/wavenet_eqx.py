"""An Equinox WaveNet: stacked dilated causal 1D convolutions (dilations 1..512), gated tanh*sigmoid units,
residual and skip connections, predicting the next mu-law-quantised sample (256 classes) of synthetic audio.

python wavenet_eqx.py              # the cold run: init, first step, 30 more, JSON timings
python wavenet_eqx.py --train 150  # a longer run that prints the train and eval loss
"""

import json
import sys
import time

_T0 = time.perf_counter()

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxsane  # noqa: E402

QUANT = 256
SEQ = 1024
BATCH = 4
DILATIONS = tuple(2**i for i in range(10))  # 1, 2, ..., 512: receptive field 1024
RES, GATE, SKIP = 128, 128, 256


class ResidualBlock(eqx.Module):
    dilated: eqx.nn.Conv1d
    res: eqx.nn.Conv1d
    skip: eqx.nn.Conv1d

    def __init__(self, dilation, key):
        k1, k2, k3 = jax.random.split(key, 3)
        # causal: pad (kernel_size - 1) * dilation on the left only
        self.dilated = eqx.nn.Conv1d(RES, 2 * GATE, kernel_size=2, dilation=dilation, padding=((dilation, 0),), key=k1)
        self.res = eqx.nn.Conv1d(GATE, RES, kernel_size=1, key=k2)
        self.skip = eqx.nn.Conv1d(GATE, SKIP, kernel_size=1, key=k3)

    def __call__(self, x):  # x: [RES, T]
        h = self.dilated(x)
        a, b = jnp.split(h, 2, axis=0)
        z = jnp.tanh(a) * jax.nn.sigmoid(b)
        return x + self.res(z), self.skip(z)


class WaveNet(eqx.Module):
    embed: eqx.nn.Embedding
    causal_in: eqx.nn.Conv1d
    blocks: list
    out1: eqx.nn.Conv1d
    out2: eqx.nn.Conv1d

    def __init__(self, key):
        keys = jax.random.split(key, len(DILATIONS) + 4)
        self.embed = eqx.nn.Embedding(QUANT, RES, key=keys[0])
        self.causal_in = eqx.nn.Conv1d(RES, RES, kernel_size=2, padding=((1, 0),), key=keys[1])
        self.blocks = [ResidualBlock(d, k) for d, k in zip(DILATIONS, keys[2:-2])]
        self.out1 = eqx.nn.Conv1d(SKIP, SKIP, kernel_size=1, key=keys[-2])
        self.out2 = eqx.nn.Conv1d(SKIP, QUANT, kernel_size=1, key=keys[-1])

    def __call__(self, tokens):  # tokens: int [T] -> logits [T, QUANT]
        x = jax.vmap(self.embed)(tokens).T  # [RES, T]
        x = self.causal_in(x)
        skips = 0.0
        for block in self.blocks:
            x, s = block(x)
            skips = skips + s
        h = self.out2(jax.nn.relu(self.out1(jax.nn.relu(skips))))
        return h.T


def mu_law_encode(audio, mu=QUANT - 1):
    y = np.sign(audio) * np.log1p(mu * np.abs(audio)) / np.log1p(mu)
    return ((y + 1) / 2 * mu + 0.5).astype(np.int32)


def make_audio(n, seed, length=SEQ + 1):
    """Sums of 1-3 sines with random frequencies/phases plus a little noise, scaled into [-1, 1], mu-law encoded."""
    rng = np.random.default_rng(seed)
    t = np.arange(length) / 16000.0
    clips = np.zeros((n, length), np.float64)
    for i in range(n):
        for _ in range(rng.integers(1, 4)):
            f = rng.uniform(100, 1000)
            clips[i] += rng.uniform(0.2, 1.0) * np.sin(2 * np.pi * f * t + rng.uniform(0, 2 * np.pi))
        clips[i] += 0.01 * rng.normal(size=length)
        clips[i] /= np.abs(clips[i]).max() * 1.05
    return mu_law_encode(clips)


TRAIN = make_audio(256, seed=0)
EVAL = make_audio(16, seed=1)


def train_batches(bs=BATCH, seed=0):
    rng = np.random.default_rng(seed)
    while True:
        perm = rng.permutation(len(TRAIN))
        for i in range(0, len(TRAIN) - bs + 1, bs):
            yield {"audio": TRAIN[perm[i : i + bs]]}


def apply(model, inputs):
    return jax.vmap(model)(inputs)


def loss_fn(model, batch):
    x, y = batch["audio"][:, :-1], batch["audio"][:, 1:]
    logits = apply(model, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


optim = optax.adam(1e-3)


def init(key):
    model = WaveNet(key)
    return model, optim.init(eqx.filter(model, eqx.is_array))


@eqx.filter_jit
def make_step(model, opt_state, batch):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch)
    updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    model = eqx.apply_updates(model, updates)
    return model, opt_state, loss


experiment = jaxsane.Experiment(
    init=init,
    step=make_step,
    train=train_batches,
    eval={"audio": EVAL},
    loss=loss_fn,
    apply=apply,
    inputs=lambda b: b["audio"][:, :-1],
    labels=lambda b: b["audio"][:, 1:],
    num_classes=QUANT,
    causal=True,
    name="wavenet_eqx",
)


def cold_run(steps=31):
    imported = time.perf_counter() - _T0
    model, opt_state = init(jax.random.key(0))
    it = train_batches()
    t = time.perf_counter()
    model, opt_state, loss = make_step(model, opt_state, next(it))
    jax.block_until_ready(loss)
    first = time.perf_counter()
    for _ in range(steps - 1):
        model, opt_state, loss = make_step(model, opt_state, next(it))
    jax.block_until_ready(loss)
    end = time.perf_counter()
    return {
        "params": int(sum(x.size for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)))),
        "import_s": imported,
        "init_s": t - _T0 - imported,
        "first_step_s": first - t,
        "steps_s": end - first,
        "loss": float(loss),
    }


def long_train(steps):
    model, opt_state = init(jax.random.key(0))
    it = train_batches()
    eval_loss = eqx.filter_jit(loss_fn)
    for i in range(steps):
        model, opt_state, loss = make_step(model, opt_state, next(it))
        if i % 10 == 0 or i == steps - 1:
            print(f"step {i:4d} loss {float(loss):.4f} eval {float(eval_loss(model, {'audio': EVAL})):.4f}", flush=True)


if __name__ == "__main__":
    if "--train" in sys.argv:
        long_train(int(sys.argv[sys.argv.index("--train") + 1]))
    else:
        print(json.dumps(cold_run()))
