"""The allocation of a mixed-precision variant: a multiple-choice knapsack solved exactly by dynamic programming.

    minimise  sum_u value[u][c_u]   subject to  sum_u cost[u][c_u] <= budget,  one choice c_u per unit u

Costs are bytes (integers). The table has one cell per budget unit: the costs' greatest common divisor when that
gives at most MAX_CELLS cells (the optimum is then exact), else ceil(budget / MAX_CELLS) bytes with every cost
rounded *up* to it (exact for the rounded costs; the true budget still holds; `resolution_bytes` says which).
Torch-free (numpy only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MAX_CELLS = 200_000


@dataclass(frozen=True)
class Allocation:
    choice: list[int]  # per unit, the index of its chosen candidate
    cost: int  # bytes, the true costs summed
    value: float  # the predicted quality cost, summed
    resolution_bytes: int  # the DP's cost unit (1 cell)
    exact: bool  # resolution is the costs' gcd: optimal for the true costs


def allocate(cost: list[list[int]], value: list[list[float]], budget: int, max_cells: int = MAX_CELLS) -> Allocation:
    """The choice per unit that minimises the summed value within the budget (see the module docstring).
    ValueError when even the cheapest choice of every unit exceeds the budget."""
    if not cost or len(cost) != len(value) or any(len(c) != len(v) or not c for c, v in zip(cost, value, strict=True)):
        raise ValueError("cost and value need one non-empty, equally long candidate list per unit")
    cheapest = sum(min(c) for c in cost)
    if cheapest > budget:
        raise ValueError(f"budget {budget} bytes is below the cheapest allocation ({cheapest} bytes)")
    g = math.gcd(*[x for c in cost for x in c], budget) or 1
    exact = budget // g <= max_cells
    unit = g if exact else -(-budget // max_cells)
    cap = budget // unit
    dp = np.zeros(cap + 1)  # dp[b]: least summed value of the units so far within b cells
    picks = []
    for c_u, v_u in zip(cost, value, strict=True):
        new, pick = np.full(cap + 1, np.inf), np.full(cap + 1, -1, dtype=np.int32)
        for j, (c, v) in enumerate(zip(c_u, v_u, strict=True)):
            w = -(-c // unit)
            if w > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[w:] = dp[: cap + 1 - w] + v
            better = cand < new
            new[better], pick[better] = cand[better], j
        dp = new
        picks.append(pick)
    if not np.isfinite(dp[cap]):
        raise ValueError(f"no allocation fits {budget} bytes at a resolution of {unit} bytes")
    choice, b = [], cap
    for u in range(len(cost) - 1, -1, -1):
        j = int(picks[u][b])
        choice.append(j)
        b -= -(-cost[u][j] // unit)
    choice.reverse()
    return Allocation(choice, sum(c[j] for c, j in zip(cost, choice, strict=True)),
                      float(sum(v[j] for v, j in zip(value, choice, strict=True))), unit, exact)
