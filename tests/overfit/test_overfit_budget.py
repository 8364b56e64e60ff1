"""The overfit sweep within doctor's plan: configurations within a flop budget, states within a memory budget."""

import numpy as np

from jaxsane._overfit.budget import LR_MULTIPLIERS, budget_configurations
from jaxsane._overfit.overfit import plan_overfit
from jaxsane._overfit.sweep import group_layout, memory_groups, state_bytes
from jaxsane.examples import load


def test_full_grid_when_it_fits_and_no_finding():
    chosen = budget_configurations(1e9, 7e9, sweeps_lr=True, baseline=True, examples=16, steps=300)
    assert (chosen.seeds, chosen.multipliers, chosen.finding) == (2, LR_MULTIPLIERS, None)


def test_drops_a_seed_then_the_lowest_rate_then_the_highest_and_says_so():
    one = 1e9
    assert budget_configurations(one, 4 * one, sweeps_lr=True, baseline=True, examples=4, steps=300)[:2] == (
        1,
        LR_MULTIPLIERS,
    )
    chosen = budget_configurations(one, 3 * one, sweeps_lr=True, baseline=True, examples=4, steps=300)
    assert chosen[:2] == (1, (1.0, 10.0))
    f = chosen.finding
    assert f.code == "overfit.budget" and f.severity == "info"
    assert "1 seed(s)" in f.message and "0.1x" in f.message and "overfit_seeds=2" in f.hint
    assert f.extra["lr_multipliers"] == [1.0, 10.0] and f.extra["budget_flops"] == 3 * one
    floor = budget_configurations(one, 0.0, sweeps_lr=True, baseline=True, examples=4, steps=300)
    assert floor[:2] == (1, (1.0,))  # never below one seed at the optimizer's own rate
    assert "10x" in floor.finding.message


def test_without_an_injectable_rate_only_seeds_are_dropped():
    assert budget_configurations(1e9, 1e12, sweeps_lr=False, baseline=False, examples=4, steps=10)[:2] == (2, (1.0,))
    chosen = budget_configurations(1e9, 1e9, sweeps_lr=False, baseline=False, examples=4, steps=10)
    assert chosen[:2] == (1, (1.0,)) and chosen.finding is not None


def test_memory_groups_cut_the_sweep_into_chunks_that_fit():
    assert memory_groups(2, 8, 100, None) == (2, 0)
    assert memory_groups(2, 8, 100, 800) == (2, 0)  # all eight states fit: side by side as before
    groups, parallel = memory_groups(2, 8, 100, 250)
    assert groups == 4 and parallel == 1  # four groups of two states; one runs at a time
    assert memory_groups(1, 3, 100, 10) == (3, 1)  # never less than one configuration at a time
    layout = group_layout(7, 7, groups, parallel)
    assert layout.parallel == 1 and layout.groups == 4


def test_chunked_sweep_gives_the_same_curves_as_the_side_by_side_one():
    exp = load("digits_optax")
    common = dict(seeds=3, steps=50, progress=False, early_exit=False)
    whole = plan_overfit(exp, **common).run()
    one = state_bytes(exp.init(__import__("jax").random.key(0)))
    chunked = plan_overfit(exp, **common, memory_bytes=one).run()
    assert chunked.groups == 4 > whole.groups  # one configuration per group, the baseline in its own
    np.testing.assert_allclose(chunked.losses, whole.losses, rtol=1e-5, atol=1e-6)
    assert [v for v in chunked.verdicts] == [v for v in whole.verdicts]


def test_budget_flops_reduces_the_configurations_with_a_finding():
    exp = load("digits_optax")
    result = plan_overfit(exp, seeds=None, steps=25, progress=False, budget_flops=1.0).run()
    real = [c for c in result.configs if not c.baseline]
    assert len(real) == 1 and real[0].seed == 0
    assert "overfit.budget" in result.codes
    roomy = plan_overfit(exp, seeds=None, steps=25, progress=False, budget_flops=1e15).run()
    assert len([c for c in roomy.configs if not c.baseline]) == 2 and "overfit.budget" not in roomy.codes  # 2 seeds
