"""The overfit sweep's time guard: a sweep whose steps cost more than their flops (a sequential loop, as in an RNN)
stops at its time limit and is then not judged, never an error; doctor derives the limit from the user's timed step."""

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsane
from jaxsane import overfit
from jaxsane._doctor.budget import sweep_seconds
from jaxsane._overfit import overfit as overfit_module
from jaxsane._overfit import verdict as verdict_module
from jaxsane._overfit.sweep_program import Carry, SweepSpec
from jaxsane._overfit.time_guard import Reach, within

HIDDEN, TIME = 16, 400  # a small RNN over a long sequence: each step is a loop of 400 dependent iterations


def _rnn(shuffled_labels: bool, lr: float = 1e-2, inject: bool = True):
    """An Elman RNN classifier in pure optax on 16 sequences of 400 steps; ``shuffled_labels`` plants the bug that
    makes the batch unfittable (labels permuted afresh at every step)."""
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=lr) if inject else optax.sgd(lr)
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(16, TIME, 1)).astype(np.float32), "y": rng.integers(0, 4, 16).astype(np.int32)}

    def init(key):
        k1, k2, k3 = jax.random.split(key, 3)
        params = {
            "wx": jax.random.normal(k1, (1, HIDDEN)),
            "wh": jax.random.normal(k2, (HIDDEN, HIDDEN)) / math.sqrt(HIDDEN) * 0.5,
            "wo": jax.random.normal(k3, (HIDDEN, 4)) / math.sqrt(HIDDEN),
        }
        return params, tx.init(params), jnp.zeros((), jnp.int32)

    def apply(params, x):
        def cell(h, xt):
            h = jnp.tanh(xt @ params["wx"] + h @ params["wh"])
            return h, None

        h, _ = jax.lax.scan(cell, jnp.zeros((x.shape[0], HIDDEN)), jnp.swapaxes(x, 0, 1))
        return h @ params["wo"]

    def loss(params, b):
        return optax.softmax_cross_entropy_with_integer_labels(apply(params, b["x"]), b["y"]).mean()

    @jax.jit
    def step(state, b):
        params, opt_state, count = state
        if shuffled_labels:
            perm = jax.random.permutation(jax.random.fold_in(jax.random.key(1), count), b["y"].shape[0])
            b = {"x": b["x"], "y": b["y"][perm]}
        value, grads = jax.value_and_grad(loss)(params, b)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, count + 1), {"loss": value}

    return jaxsane.Experiment(init=init, step=step, train=batch, loss=loss, apply=apply, name="rnn")


def _carry(chunks: int) -> Carry:
    return Carry(np.int32(chunks), None, None, None, None)


def test_slices_run_one_chunk_then_as_many_as_the_pace_fits_and_stop_at_the_deadline():
    asked = []

    def run(carry, limit, prepare):  # each chunk takes 20 ms
        done = 0 if carry is None else int(carry.chunks)
        asked.append((limit, prepare))
        time.sleep(0.02 * (limit - done))
        return _carry(limit)

    out, stopped = within(run, None, 100, True, time.perf_counter() + 0.2)
    assert stopped == "time" and 1 < int(out.chunks) < 100, asked
    assert asked[0] == (1, True) and all(not prepare for _, prepare in asked[1:]), "only the first slice prepares"
    out, stopped = within(run, None, 3, True, time.perf_counter() + 60)
    assert stopped == "" and int(out.chunks) == 3, "a sweep within its time runs all its chunks"
    out, stopped = within(run, None, 100, True, time.perf_counter() - 1)
    assert stopped == "time" and int(out.chunks) == 1, "at least one chunk runs, so every group has a curve"


def test_the_first_chunks_one_off_costs_do_not_count_against_the_deadline():
    """The first chunk (the program's first run, the states prepared) can cost many chunks' time: a 12M-parameter
    MLP's took 1 s and its next 56 chunks 0.5 s. It neither spends the time limit nor sets the pace."""

    def run(carry, limit, prepare):  # the first chunk takes 0.3 s, every later one 10 ms
        done = 0 if carry is None else int(carry.chunks)
        time.sleep((0.3 if done == 0 else 0.0) + 0.01 * (limit - done - (done == 0)))
        return _carry(limit)

    out, stopped = within(run, None, 100, True, time.perf_counter() + 0.25)
    assert stopped == "time" and int(out.chunks) > 10, int(out.chunks)


def test_a_program_that_exits_early_is_not_cut():
    def run(carry, limit, prepare):  # every configuration fits within the 2nd chunk: the program stops there
        return _carry(min(limit, 2))

    out, stopped = within(run, None, 100, True, time.perf_counter() + 60)
    assert stopped == "" and int(out.chunks) == 2


CHUNK, TOTAL = 5, 300


def _spec(accuracy: bool = False) -> SweepSpec:
    measure = (lambda states, batch: 0.0) if accuracy else None
    return SweepSpec(step=None, prepare=None, accuracy=measure, chunk=CHUNK, n_chunks=TOTAL // CHUNK, target=0.01,
                     target_accuracy=1.0)  # fmt: skip


def _curve_run(curve, accuracy=None, seconds_per_chunk=0.01):
    """A group's run on a fixed loss curve (``curve(step) -> loss``), each chunk taking ``seconds_per_chunk``."""

    def run(carry, limit, prepare):
        done = 0 if carry is None else int(carry.chunks)
        time.sleep(seconds_per_chunk * (limit - done))
        losses = np.full((1, TOTAL), np.nan, np.float32)
        losses[0, : limit * CHUNK] = [curve(i) for i in range(limit * CHUNK)]
        reached = np.nonzero(losses[0, : limit * CHUNK] <= 0.01 * losses[0, 0])[0]
        acc = np.asarray([0.0 if accuracy is None else accuracy(limit * CHUNK)], np.float32)
        reached_at = np.asarray([reached[0] if len(reached) else -1], np.int32)
        return Carry(np.int32(limit), None, losses, acc, reached_at)

    return run


def _plateau(i):  # a 7M LSTM LM's 2 sequences: a steep start, then a plateau that falls 0.014 a step
    return 5.3 - 0.014 * i if i >= 15 else 8.3 - 0.2 * i


def test_a_sweep_the_deadline_cuts_stops_once_its_target_is_out_of_reach_at_its_pace():
    """A curve that at its latest pace needs many times the steps its time allows stops early (the same verdict,
    not judged, seconds sooner); one still falling fast enough runs until the deadline."""
    real = np.asarray([True])
    out, why = within(_curve_run(_plateau), None, TOTAL // CHUNK, True, time.perf_counter() + 0.3,
                       Reach(_spec(), real, lambda: 1.0))  # fmt: skip
    assert why == "reach" and 3 <= int(out.chunks) <= 15, (why, int(out.chunks))  # the time allows ~30

    def steep(i):  # falls to its target (1% of its start) at step 99, within the ~150 steps its time allows
        return max(8.0 - 0.08 * i, 0.05)

    out, why = within(_curve_run(steep), None, TOTAL // CHUNK, True, time.perf_counter() + 0.3,
                       Reach(_spec(), real, lambda: 1.0))  # fmt: skip
    assert why == "time" and int(out.reached_at[0]) == 99, (why, int(out.chunks))


def test_a_flat_curve_with_time_for_all_its_steps_is_never_stopped_by_its_reach():
    """The reach test only shortens a sweep the deadline would cut anyway: a model that cannot fit, given time for
    all its steps, runs them all and is judged (the overfit.failed error stays an error)."""
    flat = _curve_run(lambda i: 2.3, seconds_per_chunk=0.001)
    out, why = within(flat, None, 12, True, time.perf_counter() + 30, Reach(_spec(), np.asarray([True]), lambda: 1.0))
    assert why == "" and int(out.chunks) == 12


def test_reach_counts_a_fit_already_made_and_an_accuracy_rising_to_its_target():
    reach = Reach(_spec(accuracy=True), np.asarray([True]), lambda: 1.0)
    run = _curve_run(_plateau, accuracy=lambda steps: min(1.0, 0.04 * steps))  # 100% accuracy at step 25
    carry = run(None, 4, True)
    assert not reach(carry, 2), "no accuracy rise measured yet: the loss alone would say out of reach"
    assert reach(run(carry, 5, False), 2) is False, "the accuracy rises 0.04 a step: its target is 5 steps away"
    fitted = Carry(np.int32(6), None, np.ones((1, TOTAL), np.float32), np.zeros(1, np.float32), np.asarray([12]))
    assert not Reach(_spec(), np.asarray([True]), lambda: 1.0)(fitted, 1), "a configuration that fit is in reach"
    diverged = Carry(np.int32(6), None, np.full((1, TOTAL), np.nan, np.float32), np.zeros(1, np.float32),
                     np.asarray([-1]))  # fmt: skip
    assert Reach(_spec(), np.asarray([True]), lambda: 1.0)(diverged, 50), "a curve gone NaN reaches nothing"


@pytest.mark.slow
def test_a_sweep_cut_by_its_time_limit_is_not_judged_but_the_same_fault_is_an_error_with_time():
    exp = _rnn(shuffled_labels=True)
    full = overfit(exp, seeds=1, steps=100, chunk=10, progress=False)
    assert "overfit.failed" in full.codes and not full.ok, full.table()  # the planted bug, given its steps
    cut = overfit(exp, seeds=1, steps=2000, chunk=10, progress=False, time_limit=0.5)
    assert cut.time_cut == 0.5 and cut.steps_run < 2000, cut.table()
    assert cut.ok and "overfit.budget" in cut.codes and "doctor.skipped" in cut.codes, cut.findings
    budget = next(f for f in cut.findings if f.code == "overfit.budget" and "time limit" in f.message)
    assert budget.severity == "info" and budget.extra["steps_run"] == cut.steps_run
    assert cut.losses.shape[1] == cut.steps_run and np.all(np.isfinite(cut.losses))


@pytest.mark.slow
def test_a_healthy_sweep_within_its_time_limit_is_judged_as_before():
    exp = _rnn(shuffled_labels=False, lr=3e-2)
    result = overfit(exp, seeds=1, steps=300, chunk=10, progress=False, time_limit=600)
    assert result.time_cut is None and result.ok and "overfit.best" in result.codes, result.table()
    assert not any(f.code == "overfit.budget" for f in result.findings)


def test_no_time_left_for_the_scaled_update_retry_is_not_judged(monkeypatch):
    """A rate that cannot be set and fits nothing is retried with scaled updates only in the time the first sweep
    left; with none left the own-rate curve is not judged (the retry is never run)."""
    monkeypatch.setattr(overfit_module, "_time_left", lambda limit, first: -1.0)
    retried = []
    real_plan = overfit_module.plan_overfit

    def spy(*args, **kwargs):
        if kwargs.get("update_scales") is not None:  # the retry's plan (the first sweep's has none)
            retried.append(kwargs["update_scales"])
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(overfit_module, "plan_overfit", spy)
    exp = _rnn(shuffled_labels=False, lr=1e-6, inject=False)  # plain SGD at 1e-6: nothing fits at its own rate
    result = overfit(exp, seeds=1, steps=20, chunk=10, progress=False, baseline=False, time_limit=30)
    assert result.ok and "overfit.update_scaled" not in result.codes, result.findings
    budget = next(f for f in result.findings if f.code == "overfit.budget")
    assert "retry with larger updates" in budget.message and "doctor.skipped" in result.codes
    assert retried == [], "no retry ran"


def test_doctors_sweep_limit_on_a_small_step_is_twenty_timed_user_steps_at_least_thirty_seconds_or_the_option():
    small = {"plan": {"large": False}}
    assert sweep_seconds(None, {**small, "user_seconds": {"step": 0.8, "init": 5.0, "first_step": 9.0}}) == 30.0
    assert sweep_seconds(None, {**small, "user_seconds": {"step": 2.5}}) == 50.0
    assert sweep_seconds(None, {"user_seconds": {"step": None}}) is None and sweep_seconds(None, {}) is None
    assert sweep_seconds(120, {"user_seconds": {"step": 2.5}}) == 120.0
    assert sweep_seconds(0, {"user_seconds": {"step": 2.5}}) is None, "0: no limit"


def test_doctors_sweep_limit_on_a_large_step_is_a_share_of_the_users_own_cold_run():
    """A large step's sweep gets 0.4 of what the user's own cold run costs (init, first step, 30 steps): a
    loop-bound model whose sweep needs 300 steps is not judged rather than tripling doctor's time."""
    large = {"plan": {"large": True}}
    lstm = {**large, "user_seconds": {"init": 2.4, "first_step": 1.9, "step": 0.38}}  # a 7M LSTM LM, 2 CPU cores
    assert sweep_seconds(None, lstm) == pytest.approx(0.4 * (2.4 + 1.9 + 30 * 0.38))
    slow_step = {**large, "user_seconds": {"init": 10.0, "first_step": 20.0, "step": 2.0}}
    assert sweep_seconds(None, slow_step) == pytest.approx(36.0)
    assert sweep_seconds(None, lstm, lambda: 0.3) == pytest.approx(0.4 * (2.4 + 1.9 + 30 * 0.3)), "timed again: faster"
    assert sweep_seconds(None, lstm, lambda: 0.9) == sweep_seconds(None, lstm), "the faster of the two timings"
    assert sweep_seconds(None, lstm, lambda: None) == sweep_seconds(None, lstm), "a retiming that compiled: unused"
    assert sweep_seconds(0, lstm) is None and sweep_seconds(None, {**large, "user_seconds": {}}) is None
    fast = {**large, "user_seconds": {"init": 1.1, "first_step": 0.7, "step": 0.08}}  # a 12M MLP on 2 cores
    assert sweep_seconds(None, fast) == 5.0, "at least 5 s: below that the host's pace is noise"


@pytest.mark.slow
def test_a_cut_curve_that_reads_as_a_floor_is_not_judged(monkeypatch):
    """A curve cut short that did not reach the target is no evidence of a floor either: a loss still falling
    steadily after a steep start reads as flat in its last tenth. Forced here: every unreached curve reads as a
    floor, and the cut sweep must still say it is not judged instead of reporting a floor."""
    monkeypatch.setattr(verdict_module, "curve_verdict", lambda losses, reached: "fits" if reached else "floor")
    exp, slow = _rnn(shuffled_labels=False), {"learning_rates": [1e-4], "seeds": 1, "baseline": False}
    cut = overfit(exp, steps=2000, chunk=10, progress=False, time_limit=0.5, **slow)
    assert cut.time_cut == 0.5 and not cut.reached.any(), cut.table()
    assert "doctor.skipped" in cut.codes and "overfit.budget" in cut.codes, cut.findings
    assert "overfit.floor" not in cut.codes and "overfit.best" not in cut.codes, cut.findings
    whole = overfit(exp, steps=20, chunk=10, progress=False, **slow)
    assert "overfit.floor" in whole.codes and "doctor.skipped" not in whole.codes, "uncut, the same verdict is judged"


def test_overfit_rejects_a_time_limit_that_is_not_positive():
    with pytest.raises(jaxsane.ArgumentError, match="time_limit"):
        overfit(_rnn(False), time_limit=0, progress=False)
