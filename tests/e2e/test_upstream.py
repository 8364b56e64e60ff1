"""The doctor on official Flax examples, read from the flax sdist at test time (never copied here).

The examples' model files are imported as they are; from their training scripts (which import absl,
clu and tensorflow) only the loss and step functions are taken, by name, from the file's syntax tree,
and wired up the way a user wraps them: ``functools.partial`` for the extra step arguments and synthetic
data of the example's own shapes. A one-line fault is planted by editing that source text before it runs.

The sdist comes from the package registry (``pip download --no-binary :all: flax==<installed>``) into a
cache directory (``$JAXSANE_FLAX_SDIST`` points at an unpacked one); without a registry the tests skip.
"""

import ast
import functools
import importlib.util
import os
import random
import subprocess
import sys
import tarfile
import types
from pathlib import Path

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training import train_state

import jaxsane

pytestmark = [pytest.mark.slow, pytest.mark.network, pytest.mark.subprocess]

CACHE = Path(os.environ.get("JAXSANE_TEST_CACHE", Path.home() / ".cache" / "jaxsane-tests"))


@pytest.fixture(scope="module")
def examples() -> Path:
    given = os.environ.get("JAXSANE_FLAX_SDIST")
    root = Path(given) if given else CACHE / f"flax-{flax.__version__}"
    if not (root / "examples").is_dir():
        CACHE.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
                               ":all:", f"flax=={flax.__version__}", "-d", str(CACHE)],
                              capture_output=True, text=True, timeout=300)
        archive = CACHE / f"flax-{flax.__version__}.tar.gz"
        if proc.returncode != 0 or not archive.exists():
            pytest.skip(f"the flax sdist could not be downloaded: {proc.stderr.strip()[-300:]}")
        with tarfile.open(archive) as tar:
            tar.extractall(CACHE, filter="data")
    return root / "examples"


def import_file(path: Path, name: str) -> types.ModuleType:
    """Import an example's module file as it is (its directory first on sys.path, as the example runs)."""
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(path.parent))


def functions_from(path: Path, names: list[str], namespace: dict, fault: tuple[str, str] | None = None) -> dict:
    """The named top-level functions of a source file, executed in ``namespace`` (the file's own imports are
    not run). ``fault=(old, new)`` replaces one line's text first, and must match exactly once."""
    source = path.read_text()
    if fault is not None:
        assert source.count(fault[0]) == 1, f"the planted fault must match once in {path.name}: {fault[0]!r}"
        source = source.replace(*fault)
    tree = ast.parse(source, filename=str(path))
    wanted = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert {n.name for n in wanted} == set(names), f"{path.name} no longer defines {set(names)}"
    code = compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec")
    exec(code, namespace)  # noqa: S102 - the flax project's own example code, read from its sdist
    return namespace


def errors(diagnosis) -> list:
    return [f for f in diagnosis if f.severity == "error"]


def not_run(diagnosis) -> list:
    return [s for s in diagnosis.stages if s["status"] in ("crashed", "failed", "skipped")]


# ----------------------------------------------------------------------------- seq2seq (an LSTM encoder-decoder)

def seq2seq_experiment(examples: Path, fault: tuple[str, str] | None = None) -> jaxsane.Experiment:
    folder = examples / "seq2seq"
    pipeline = import_file(folder / "input_pipeline.py", "input_pipeline")
    models = import_file(folder / "models.py", "models")
    ns = {"jax": jax, "jnp": jnp, "nn": nn, "optax": optax, "train_state": train_state, "models": models,
          "mask_sequences": pipeline.mask_sequences, "get_sequence_lengths": pipeline.get_sequence_lengths,
          "Array": jax.Array, "PRNGKey": jax.Array, "Any": object}
    ns = functions_from(folder / "train.py", ["cross_entropy_loss", "compute_metrics", "train_step"], ns, fault)
    ctable = pipeline.CharacterTable("0123456789+= ")
    random.seed(0)
    batches = [ctable.get_batch(32) for _ in range(4)]
    model = models.Seq2seq(teacher_force=False, hidden_size=64, eos_id=ctable.eos_id, vocab_size=ctable.vocab_size)

    def init(key):
        k1, k2 = jax.random.split(key)
        params = model.init({"params": k1, "lstm": k2}, jnp.ones(ctable.encoder_input_shape, jnp.float32),
                            jnp.ones(ctable.decoder_input_shape, jnp.float32))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(3e-3))

    def loss(params, batch):  # what the example's loss_fn computes, with a fixed decoding key
        labels = batch["answer"][:, 1:]
        logits, _ = model.apply({"params": params}, batch["query"], batch["answer"],
                                rngs={"lstm": jax.random.key(0)})
        return ns["cross_entropy_loss"](logits, labels, pipeline.get_sequence_lengths(labels, ctable.eos_id))

    step = functools.partial(ns["train_step"], lstm_rng=jax.random.key(1), eos_id=ctable.eos_id)
    return jaxsane.Experiment(init=init, step=step, train=batches, loss=loss,
                              inputs=lambda b: b["query"], labels=lambda b: b["answer"], name="flax seq2seq")


@pytest.mark.timeout(1200)
def test_flax_seq2seq_lstm_is_healthy(examples):
    d = jaxsane.doctor(seq2seq_experiment(examples), progress=False, overfit_steps=200, run_steps=20)
    assert not errors(d) and not not_run(d), d


@pytest.mark.timeout(1200)
def test_flax_seq2seq_with_the_update_dropped_fails(examples):
    fault = ("  state = state.apply_gradients(grads=grads)\n", "  state = state.replace(step=state.step + 1)\n")
    d = jaxsane.doctor(seq2seq_experiment(examples, fault), stages=["step"], progress=False)
    assert "step.no_update" in [f.code for f in errors(d)], d


# ----------------------------------------------------------------------------- VAE (a KL term: its loss has a floor)

def vae_experiment(examples: Path, fault: tuple[str, str] | None = None) -> jaxsane.Experiment:
    folder = examples / "vae"
    models = import_file(folder / "models.py", "models")
    ns = {"jax": jax, "jnp": jnp, "nn": nn, "models": models}
    ns = functions_from(folder / "train.py", ["kl_divergence", "binary_cross_entropy_with_logits", "train_step"],
                        ns, fault)
    rng = np.random.default_rng(0)
    prototypes = (rng.random((4, 784)) < 0.3)
    images = [prototypes[rng.integers(0, 4, 32)] ^ (rng.random((32, 784)) < 0.05) for _ in range(4)]
    images = [x.astype(np.float32) for x in images]
    latents = 8

    def init(key):
        k1, k2 = jax.random.split(key)
        params = models.model(latents).init(k1, jnp.ones((1, 784), jnp.float32), k2)["params"]
        return train_state.TrainState.create(apply_fn=models.model(latents).apply, params=params,
                                             tx=optax.adam(1e-3))

    def loss(params, batch):  # the example's loss_fn, with a fixed sampling key
        recon, mean, logvar = models.model(latents).apply({"params": params}, batch, jax.random.key(0))
        return ns["binary_cross_entropy_with_logits"](recon, batch).mean() + ns["kl_divergence"](mean, logvar).mean()

    step = functools.partial(ns["train_step"], z_rng=jax.random.key(1), latents=latents)
    return jaxsane.Experiment(init=init, step=jax.jit(step), train=images, loss=loss, inputs=lambda b: b,
                              labels=lambda b: b, name="flax vae")


@pytest.mark.timeout(1200)
def test_flax_vae_is_healthy(examples):
    d = jaxsane.doctor(vae_experiment(examples), progress=False, overfit_steps=200, run_steps=20)
    assert not errors(d) and not not_run(d), d
