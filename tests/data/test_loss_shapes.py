"""data.shape for predictions (B, 1) against labels (B,): decided by the loss. A loss that reshapes its
labels first pairs each prediction with its own label (no finding); one that broadcasts to (B, B) is found."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxsane
from jaxsane._checks.batch import loss_pairs_labels

rng = np.random.default_rng(0)
X = rng.normal(size=(64, 5)).astype(np.float32)
Y = (X @ rng.normal(size=5)).astype(np.float32)  # (B,) targets
PARAMS = {"w": jnp.zeros((5, 1)), "b": jnp.zeros((1,))}


def apply(p, x):
    return x @ p["w"] + p["b"]  # (B, 1) predictions


def reshaping_loss(p, batch):
    return jnp.mean((apply(p, batch["x"]) - batch["y"].reshape(-1, 1)) ** 2)  # explicit (B,) -> (B, 1)


def broadcasting_loss(p, batch):
    return jnp.mean((apply(p, batch["x"]) - batch["y"]) ** 2)  # BUG: (B, 1) - (B,) -> (B, B)


def _experiment(loss):
    tx = optax.sgd(0.01)

    def step(state, batch):
        p, s = state
        u, s = tx.update(jax.grad(loss)(p, batch), s, p)
        return (optax.apply_updates(p, u), s), {"loss": loss(p, batch)}

    return jaxsane.Experiment(init=lambda key: (PARAMS, tx.init(PARAMS)), step=jax.jit(step),
                              train={"x": X, "y": Y}, loss=loss, apply=apply)


def test_the_loss_decides_whether_shapes_broadcast():
    batch = {"x": X, "y": Y}
    assert loss_pairs_labels(reshaping_loss, PARAMS, batch, batch["y"]) is True
    assert loss_pairs_labels(broadcasting_loss, PARAMS, batch, batch["y"]) is False
    same = {"x": X, "y": np.ones_like(Y)}
    assert loss_pairs_labels(reshaping_loss, PARAMS, same, same["y"]) is None  # rolling cannot tell


def test_doctor_reports_only_the_loss_that_really_broadcasts():
    assert "broadcast" in jaxsane.check_data({"x": X, "y": Y}, apply=apply, params=PARAMS).by_code("data.shape")[0].message
    clean = jaxsane.doctor(_experiment(reshaping_loss), stages=["data"], progress=False)
    assert "data.shape" not in clean.codes, clean
    buggy = jaxsane.doctor(_experiment(broadcasting_loss), stages=["data"], progress=False)
    assert "data.shape" in buggy.codes, buggy


def test_a_missing_label_key_is_explained_with_the_callable_the_experiment_takes():
    import dataclasses
    from jaxsane.examples import load
    exp = load("digits_nnx")
    bad = dataclasses.replace(exp, train={"x": exp.train.x, "answer": exp.train.y}, eval=None)
    [f] = jaxsane.doctor(bad, stages=["data"], progress=False).by_code("doctor.skipped")
    assert "Experiment(labels=lambda batch: batch['answer'])" in f.message, f.message
    assert "labels='your_key'" not in f.message


def test_an_alignment_loss_takes_frames_against_a_shorter_label_sequence():
    """CTC: logits per frame [B, T, K] against label ids [B, L], L < T, which the loss aligns itself: no
    elementwise comparison, so no data.shape; a loss that compares them elementwise cannot run: the error."""
    B, T, L, K = 4, 12, 5, 6
    x = rng.normal(size=(B, T, 3)).astype(np.float32)
    labels = rng.integers(1, K, (B, L)).astype(np.int32)
    w = {"w": jnp.asarray(rng.normal(size=(3, K)).astype(np.float32))}
    ctc_apply = lambda p, x: x @ p["w"]  # noqa: E731

    def ctc(p, b):
        logits = ctc_apply(p, b["x"])
        return optax.ctc_loss(logits, jnp.zeros(logits.shape[:2]), b["y"], jnp.zeros(b["y"].shape)).mean()

    def elementwise(p, b):  # BUG: frames compared with labels position by position
        return jnp.mean((ctc_apply(p, b["x"]).argmax(-1) - b["y"]) ** 2)

    def experiment(loss):
        tx = optax.sgd(0.01)

        def step(state, batch):
            p, s = state
            u, s = tx.update(jax.grad(loss)(p, batch), s, p)
            return (optax.apply_updates(p, u), s), {}

        return jaxsane.Experiment(init=lambda key: (w, tx.init(w)), step=step, train={"x": x, "y": labels},
                                  loss=loss, apply=ctc_apply)

    clean = jaxsane.doctor(experiment(ctc), stages=["data"], progress=False)
    assert "data.shape" not in clean.codes, clean
    buggy = jaxsane.doctor(experiment(elementwise), stages=["data"], progress=False)
    assert "cannot be compared" in buggy.by_code("data.shape")[0].message, buggy
