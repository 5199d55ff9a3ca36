"""The mixed-precision allocator (pipeline/quant/mix/alloc.py): its optimum equals brute force."""
from __future__ import annotations

import itertools
import random

import pytest

from pipeline.quant.mix.alloc import allocate


def brute_force(cost, value, budget):
    best = None
    for choice in itertools.product(*[range(len(c)) for c in cost]):
        c = sum(cost[u][j] for u, j in enumerate(choice))
        if c <= budget:
            v = sum(value[u][j] for u, j in enumerate(choice))
            best = v if best is None else min(best, v)
    return best


@pytest.mark.parametrize("seed", range(60))
def test_the_dp_optimum_equals_brute_force(seed):
    rng = random.Random(seed)
    units, cands = rng.randint(1, 6), rng.randint(1, 4)
    cost = [[rng.randint(1, 40) * rng.choice([1, 3]) for _ in range(cands)] for _ in range(units)]
    value = [[rng.random() for _ in range(cands)] for _ in range(units)]
    lo, hi = sum(min(c) for c in cost), sum(max(c) for c in cost)
    budget = rng.randint(lo, hi)
    a = allocate(cost, value, budget)
    assert a.exact and a.cost <= budget
    assert a.value == pytest.approx(brute_force(cost, value, budget), abs=1e-12)
    assert a.value == pytest.approx(sum(value[u][j] for u, j in enumerate(a.choice)))


def test_a_coarse_table_keeps_the_budget_and_is_never_better_than_the_optimum():
    rng = random.Random(7)
    cost = [[rng.randint(1000, 9000) for _ in range(3)] for _ in range(5)]
    value = [[rng.random() for _ in range(3)] for _ in range(5)]
    budget = sum(sorted(c)[1] for c in cost) + 17
    a = allocate(cost, value, budget, max_cells=50)
    assert not a.exact and a.resolution_bytes > 1 and a.cost <= budget
    assert a.value >= brute_force(cost, value, budget) - 1e-12


def test_a_budget_below_the_cheapest_allocation_is_refused():
    with pytest.raises(ValueError, match="below the cheapest allocation"):
        allocate([[5, 9], [4, 8]], [[1.0, 0.0], [1.0, 0.0]], 8)


def test_more_budget_buys_the_better_choices():
    cost, value = [[1, 2], [1, 2]], [[1.0, 0.0], [5.0, 0.0]]
    assert allocate(cost, value, 2).choice == [0, 0]
    assert allocate(cost, value, 3).choice == [0, 1]  # the unit that gains most gets the extra byte
    assert allocate(cost, value, 4).choice == [1, 1]
