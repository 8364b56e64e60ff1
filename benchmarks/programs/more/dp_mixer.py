"""Data-parallel MLP-Mixer on 8 (host) devices: params replicated, batch sharded on the 'data' axis."""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import json
import sys
import time

_T0 = time.perf_counter()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxsane  # noqa: E402

NUM_CLASSES = 10
IMAGE = (32, 32, 3)
BATCH = 64

mesh = Mesh(np.array(jax.devices()), ("data",))
replicated = NamedSharding(mesh, P())
data_sharding = NamedSharding(mesh, P("data"))


# ----------------------------------------------------------------------------- model


class MlpBlock(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        x = nn.Dense(self.hidden)(x)
        x = nn.gelu(x)
        return nn.Dense(d)(x)


class MixerBlock(nn.Module):
    tokens_hidden: int
    channels_hidden: int

    @nn.compact
    def __call__(self, x):  # x: [B, tokens, channels]
        y = nn.LayerNorm()(x)
        y = jnp.swapaxes(y, 1, 2)
        y = MlpBlock(self.tokens_hidden, name="token_mixing")(y)
        y = jnp.swapaxes(y, 1, 2)
        x = x + y
        y = nn.LayerNorm()(x)
        return x + MlpBlock(self.channels_hidden, name="channel_mixing")(y)


class MlpMixer(nn.Module):
    num_classes: int
    patch: int = 8
    hidden: int = 256
    depth: int = 6
    tokens_hidden: int = 128
    channels_hidden: int = 1024

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(self.hidden, (self.patch, self.patch), strides=(self.patch, self.patch), name="stem")(x)
        b, h, w, c = x.shape
        x = x.reshape(b, h * w, c)
        for _ in range(self.depth):
            x = MixerBlock(self.tokens_hidden, self.channels_hidden)(x)
        x = nn.LayerNorm(name="pre_head_norm")(x)
        x = jnp.mean(x, axis=1)
        return nn.Dense(self.num_classes, kernel_init=nn.initializers.zeros, name="head")(x)


model = MlpMixer(NUM_CLASSES)


# ----------------------------------------------------------------------------- data


_PROTOS = np.random.default_rng(1234).normal(size=(NUM_CLASSES, *IMAGE)).astype(np.float32)


def make_split(n, seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, NUM_CLASSES, n).astype(np.int32)
    images = 0.5 * _PROTOS[labels] + rng.normal(size=(n, *IMAGE)).astype(np.float32)
    return {"image": images, "label": labels}


TRAIN = make_split(4096, 0)
EVAL = make_split(512, 1)


def shard(batch):
    return jax.device_put(batch, data_sharding)


def train_batches(seed=0):
    """Shuffled epochs over TRAIN; each batch placed on the mesh, sharded on the batch axis."""
    rng = np.random.default_rng(seed)
    n = len(TRAIN["label"])
    while True:
        perm = rng.permutation(n)
        for i in range(0, n - BATCH + 1, BATCH):
            idx = perm[i : i + BATCH]
            yield shard({k: v[idx] for k, v in TRAIN.items()})


eval_batch = shard({k: v[:256] for k, v in EVAL.items()})


# ----------------------------------------------------------------------------- training


def create_state(key):
    params = model.init(key, jnp.zeros((1, *IMAGE)))["params"]
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 2000), weight_decay=0.05)
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def init(key):
    # replicate the whole train state over the mesh
    return jax.jit(create_state, out_shardings=replicated)(key)


def apply(params, images):
    return model.apply({"params": params}, images)


def loss_fn(params, batch):
    logits = apply(params, batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def _train_step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
    state = state.apply_gradients(grads=grads)
    return state, {"loss": loss}


train_step = jax.jit(
    _train_step,
    in_shardings=(replicated, data_sharding),
    out_shardings=(replicated, replicated),
    donate_argnums=0,
)


experiment = jaxsane.Experiment(
    init=init,
    step=train_step,
    train=train_batches,
    eval=eval_batch,
    loss=loss_fn,
    apply=apply,
    inputs=lambda b: b["image"],
    labels=lambda b: b["label"],
    num_classes=NUM_CLASSES,
    name="dp_mixer",
)


def user_run(steps=31):
    imported = time.perf_counter() - _T0
    state = init(jax.random.key(0))
    it = train_batches()
    jax.block_until_ready(state)
    t = time.perf_counter()
    first_done = None
    for i in range(steps):
        state, metrics = train_step(state, next(it))
        if i == 0:
            jax.block_until_ready(metrics["loss"])
            first_done = time.perf_counter()
    loss = float(metrics["loss"])
    end = time.perf_counter()
    return {
        "program": "dp_mixer",
        "devices": jax.device_count(),
        "params": int(sum(np.size(x) for x in jax.tree_util.tree_leaves(state.params))),
        "import_s": imported,
        "init_s": t - _T0 - imported,
        "first_step_s": first_done - t,
        "steps_s": end - first_done,
        "total_s": end - _T0,
        "loss": loss,
    }


if __name__ == "__main__":
    n = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 31
    print(json.dumps(user_run(n)))
