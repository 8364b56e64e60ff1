"""A two-tower retrieval model: user / item ID embeddings (500k x 32 each) + MLP towers, in-batch softmax."""

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

import jaxsane  # noqa: E402

NUM_USERS = 500_000
NUM_ITEMS = 500_000
EMBED_DIM = 32
NUM_CLUSTERS = 100
BATCH = 256
TEMPERATURE = 0.1


# ----------------------------------------------------------------------------- model


class Tower(nn.Module):
    vocab: int
    dim: int = EMBED_DIM
    hidden: int = 128
    out: int = 64

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(self.vocab, self.dim, embedding_init=nn.initializers.normal(0.05), name="embedding")(ids)
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.Dense(self.out)(x)
        return x / jnp.linalg.norm(x, axis=-1, keepdims=True).clip(1e-6)  # L2-normalized (cosine scores)


class TwoTower(nn.Module):
    def setup(self):
        self.user_tower = Tower(NUM_USERS)
        self.item_tower = Tower(NUM_ITEMS)

    def __call__(self, user, item):
        return self.user_tower(user), self.item_tower(item)


model = TwoTower()


# ----------------------------------------------------------------------------- data
# Implicit feedback: a user (Zipf-popular) interacts with an item of its own cluster (Zipf-popular within it).


def sample_pairs(rng, n):
    user = (rng.zipf(1.3, n) - 1) % NUM_USERS
    cluster = user % NUM_CLUSTERS
    rank = (rng.zipf(1.3, n) - 1) % (NUM_ITEMS // NUM_CLUSTERS)
    item = cluster + NUM_CLUSTERS * rank
    return {"user": user.astype(np.int32), "item": item.astype(np.int32)}


def train_batches(seed=0):
    rng = np.random.default_rng(seed)
    while True:
        yield sample_pairs(rng, BATCH)


eval_batch = sample_pairs(np.random.default_rng(10_000), BATCH)


# ----------------------------------------------------------------------------- training


@jax.jit
def init(key):
    params = model.init(key, jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(3e-3))


def apply(params, inputs):
    """Score of each (user, item) pair: the dot product of the two towers' embeddings."""
    u, v = model.apply({"params": params}, inputs["user"], inputs["item"])
    return jnp.sum(u * v, axis=-1) / TEMPERATURE


def loss_fn(params, batch):
    """In-batch softmax: each user's positive item against the batch's other items."""
    u, v = model.apply({"params": params}, batch["user"], batch["item"])
    logits = u @ v.T / TEMPERATURE
    labels = jnp.arange(logits.shape[0])
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@jax.jit
def train_step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": loss}


experiment = jaxsane.Experiment(
    init=init,
    step=train_step,
    train=train_batches,
    eval=eval_batch,
    loss=loss_fn,
    apply=apply,
    inputs=lambda b: {"user": b["user"], "item": b["item"]},
    name="recsys_two_tower",
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
        "program": "recsys_two_tower",
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
