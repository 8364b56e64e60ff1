"""A Flax linen CNN image classifier (10 classes, 32x32x3) with BatchNorm and dropout, trained with gradient
accumulation (optax.MultiSteps, k=4) and a Polyak/EMA copy of the params kept in the TrainState.
Eval uses the EMA params (and the running BatchNorm statistics).

python accum_ema_cnn.py            # the cold run: init, first step, 30 more, JSON timings
python accum_ema_cnn.py --train 150  # a longer run that prints train loss and EMA eval accuracy
"""

import json
import sys
import time

_T0 = time.perf_counter()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import jaxsane  # noqa: E402

NUM_CLASSES = 10
IMAGE = (32, 32, 3)
BATCH = 32
ACCUM = 4
EMA_DECAY = 0.999


class CNN(nn.Module):
    channels: tuple = (32, 64, 128)
    dense: int = 1536
    dropout: float = 0.3

    @nn.compact
    def __call__(self, x, train: bool = False):
        for c in self.channels:
            for _ in range(2):
                x = nn.Conv(c, (3, 3), use_bias=False)(x)
                x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
                x = nn.relu(x)
            x = nn.max_pool(x, (2, 2), (2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
        x = nn.relu(nn.Dense(self.dense)(x))
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return nn.Dense(NUM_CLASSES)(x)


model = CNN()


class EMATrainState(train_state.TrainState):
    batch_stats: dict
    ema_params: dict
    key: jax.Array


def make_data(n, seed):
    """Learnable synthetic images: one smooth random prototype per class plus per-image noise and shifts."""
    protos_rng = np.random.default_rng(1234)
    coarse = protos_rng.normal(size=(NUM_CLASSES, 8, 8, 3)).astype(np.float32)
    protos = coarse.repeat(4, axis=1).repeat(4, axis=2)  # 32x32x3, smooth blocks
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, NUM_CLASSES, n).astype(np.int32)
    images = protos[labels] + 1.0 * rng.normal(size=(n, *IMAGE)).astype(np.float32)
    shifts = rng.integers(-2, 3, size=(n, 2))
    for i, (dy, dx) in enumerate(shifts):
        images[i] = np.roll(images[i], (dy, dx), axis=(0, 1))
    images = (images - images.mean()) / images.std()
    return {"image": images.astype(np.float32), "label": labels}


TRAIN = make_data(2048, seed=0)
EVAL = make_data(256, seed=1)


def train_batches(bs=BATCH, seed=0):
    n = len(TRAIN["label"])
    rng = np.random.default_rng(seed)
    while True:
        perm = rng.permutation(n)
        for i in range(0, n - bs + 1, bs):
            idx = perm[i : i + bs]
            yield {"image": TRAIN["image"][idx], "label": TRAIN["label"][idx]}


def create_state(key):
    pkey, dkey = jax.random.split(key)
    variables = model.init(pkey, jnp.zeros((1, *IMAGE)), train=False)
    params = variables["params"]
    tx = optax.MultiSteps(
        optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 500), weight_decay=1e-4),
        every_k_schedule=ACCUM,
    )
    return EMATrainState.create(
        apply_fn=model.apply,
        params=params,
        tx=tx,
        batch_stats=variables["batch_stats"],
        ema_params=jax.tree_util.tree_map(jnp.copy, params),
        key=dkey,
    )


@jax.jit
def train_step(state, batch):
    dropout_key = jax.random.fold_in(state.key, state.step)

    def loss_fn(params):
        logits, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["image"],
            train=True,
            rngs={"dropout": dropout_key},
            mutable=["batch_stats"],
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, (logits, updates)

    (loss, (logits, updates)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads)
    # Polyak averaging, with the usual warm-up of the decay so the average is useful early on
    decay = jnp.minimum(EMA_DECAY, (1.0 + state.step) / (10.0 + state.step))
    ema = optax.incremental_update(state.params, state.ema_params, step_size=1.0 - decay)
    state = state.replace(batch_stats=updates["batch_stats"], ema_params=ema)
    acc = (logits.argmax(-1) == batch["label"]).mean()
    return state, {"loss": loss, "accuracy": acc}


@jax.jit
def eval_step(state, batch):
    logits = state.apply_fn({"params": state.ema_params, "batch_stats": state.batch_stats}, batch["image"], train=False)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, (logits.argmax(-1) == batch["label"]).mean()


# --- handles for jaxsane: eval-mode model on the initial running statistics (as doctor sees fresh states)
_stats0 = model.init(jax.random.key(0), jnp.zeros((1, *IMAGE)), train=False)["batch_stats"]


def apply_fn(params, images):
    return model.apply({"params": params, "batch_stats": _stats0}, images, train=False)


def loss_fn(params, batch):
    return optax.softmax_cross_entropy_with_integer_labels(apply_fn(params, batch["image"]), batch["label"]).mean()


experiment = jaxsane.Experiment(
    init=create_state,
    step=train_step,
    train=train_batches,
    eval=EVAL,
    loss=loss_fn,
    apply=apply_fn,
    inputs=lambda b: b["image"],
    labels=lambda b: b["label"],
    num_classes=NUM_CLASSES,
    name="accum_ema_cnn",
)


def cold_run(steps=31):
    imported = time.perf_counter() - _T0
    state = create_state(jax.random.key(0))
    it = train_batches()
    t = time.perf_counter()
    state, m = train_step(state, next(it))
    jax.block_until_ready(m["loss"])
    first = time.perf_counter()
    for _ in range(steps - 1):
        state, m = train_step(state, next(it))
    jax.block_until_ready(m["loss"])
    end = time.perf_counter()
    return {
        "params": int(sum(x.size for x in jax.tree_util.tree_leaves(state.params))),
        "import_s": imported,
        "init_s": t - _T0 - imported,
        "first_step_s": first - t,
        "steps_s": end - first,
        "loss": float(m["loss"]),
    }


def long_train(steps):
    state = create_state(jax.random.key(0))
    it = train_batches()
    for i in range(steps):
        state, m = train_step(state, next(it))
        if i % 10 == 0 or i == steps - 1:
            el, ea = eval_step(state, EVAL)
            print(f"step {i:4d} loss {float(m['loss']):.4f} acc {float(m['accuracy']):.3f} "
                  f"ema-eval loss {float(el):.4f} acc {float(ea):.3f}", flush=True)


if __name__ == "__main__":
    if "--train" in sys.argv:
        long_train(int(sys.argv[sys.argv.index("--train") + 1]))
    else:
        print(json.dumps(cold_run()))
