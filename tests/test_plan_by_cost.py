"""The plan priced by the rollout's cost is the cheapest non-decreasing schedule whose tails reach the
threshold: checked against a brute force over every non-decreasing assignment of the candidate budgets
and dense, for step costs that do not grow with the budget; where they do, it is the plain plan."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from sparrow.stages.core.schedule import DENSE, TailProfile, plan

STARTS = np.array([0, 64, 128, 256])
CANDIDATES = np.array([48, 64, 128, 256])  # each bin's end is a candidate, so every candidate is an option


def brute_force(tail: np.ndarray, threshold: float, cost: np.ndarray) -> float:
    """The least total cost over every non-decreasing choice of a candidate or dense per bin."""
    options = [*CANDIDATES, DENSE]
    best = np.inf
    for choice in itertools.product(range(len(options)), repeat=len(STARTS)):
        if list(choice) != sorted(choice):
            continue
        if any(k < len(CANDIDATES) and tail[i, k] < threshold for i, k in enumerate(choice)):
            continue
        best = min(best, sum(cost[i, k] for i, k in enumerate(choice)))
    return best


def planned_cost(budgets: tuple[int, ...], cost: np.ndarray) -> float:
    columns = [len(CANDIDATES) if b == 0 else int(np.searchsorted(CANDIDATES, b)) for b in budgets]
    return sum(cost[i, k] for i, k in enumerate(columns))


@pytest.mark.parametrize("seed", range(20))
def test_the_priced_plan_is_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    tail = np.sort(rng.uniform(0.3, 1.0, (len(STARTS), len(CANDIDATES))), axis=1)
    tail[:, 0] = 0.95  # the smallest candidate reaches the threshold somewhere: the plain plan takes it
    cost = rng.uniform(1.0, 2.0, (len(STARTS), len(CANDIDATES) + 1))  # [bin, candidate | dense]
    profile = TailProfile(STARTS, 64, CANDIDATES, tail, 0.05, "synthetic")
    priced = plan(profile, 0.6, lambda i, budgets: cost[i, [len(CANDIDATES) if b == 0 else
                                                               int(np.searchsorted(CANDIDATES, b))
                                                               for b in budgets]])
    budgets = priced.schedule.budgets
    assert list(map(lambda b: b or DENSE, budgets)) == sorted(b or DENSE for b in budgets)
    assert planned_cost(budgets, cost) == pytest.approx(brute_force(tail, 0.6, cost))


def test_where_cost_grows_with_the_budget_the_priced_plan_is_the_plain_one():
    rng = np.random.default_rng(0)
    tail = np.sort(rng.uniform(0.3, 1.0, (len(STARTS), len(CANDIDATES))), axis=1)
    growing = np.tile(np.arange(1.0, len(CANDIDATES) + 2), (len(STARTS), 1))
    profile = TailProfile(STARTS, 64, CANDIDATES, tail, 0.05, "synthetic")
    for threshold in (0.4, 0.6, 0.8):
        plain = plan(profile, threshold)
        priced = plan(profile, threshold, lambda i, budgets: growing[i, [len(CANDIDATES) if b == 0 else
                                                                         int(np.searchsorted(CANDIDATES, b))
                                                                         for b in budgets]])
        assert priced.schedule == plain.schedule and priced.notes == plain.notes


def test_a_budget_that_costs_more_than_dense_makes_the_bin_dense_and_says_so():
    tail = np.full((len(STARTS), len(CANDIDATES)), 0.99)
    dear = np.ones((len(STARTS), len(CANDIDATES) + 1))
    dear[:, :-1] = 2.0  # every sparse budget's steps cost twice dense ones
    profile = TailProfile(STARTS, 64, CANDIDATES, tail, 0.05, "synthetic")
    priced = plan(profile, 0.5, lambda i, budgets: dear[i, [len(CANDIDATES) if b == 0 else
                                                            int(np.searchsorted(CANDIDATES, b))
                                                            for b in budgets]])
    assert priced.schedule.budgets == (0, 0, 0, 0)
    assert plan(profile, 0.5).schedule.budgets == (48, 48, 48, 48)
    assert any("above dense ones, so they are dense" in n for n in priced.notes)
