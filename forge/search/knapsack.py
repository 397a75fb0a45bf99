"""An exact multiple-choice knapsack: one option per group, total size within a budget, least total cost.

Sizes are exact integers (bytes), costs are floats. The solver is a dynamic programme over Pareto fronts:
after each group it keeps only the partial solutions that no other partial solution beats on both size and
cost (a dominated prefix can never complete into a better answer), drops those that cannot fit even with
the smallest options of the remaining groups, and those whose cost plus the cheapest remaining options
cannot beat a feasible answer already known. Every step is exact, so the answer is optimal; ties keep the
smaller total size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class Solution:
    choice: list[int]  # option index per group
    size: int
    cost: float
    states: int  # the largest Pareto front held (a measure of the work done)


def bounds(sizes: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The smallest and the largest total size reachable (one option per group)."""
    return sum(min(s) for s in sizes), sum(max(s) for s in sizes)


def solve(sizes: Sequence[Sequence[int]], costs: Sequence[Sequence[float]], budget: int) -> Solution | None:
    """Least-cost choice of one option per group with total size <= ``budget``; None when nothing fits."""
    if len(sizes) != len(costs) or any(len(s) != len(c) or not s for s, c in zip(sizes, costs, strict=True)):
        raise ValueError("every group needs at least one option and one cost per option")
    n = len(sizes)
    s_arr = [np.asarray(s, dtype=np.int64) for s in sizes]
    c_arr = [np.asarray(c, dtype=np.float64) for c in costs]
    min_rest = np.zeros(n + 1, dtype=np.int64)  # smallest size of groups i.. end
    cheap_rest = np.zeros(n + 1, dtype=np.float64)  # cheapest cost of groups i.. end (size ignored)
    for i in range(n - 1, -1, -1):
        min_rest[i] = min_rest[i + 1] + s_arr[i].min()
        cheap_rest[i] = cheap_rest[i + 1] + c_arr[i].min()
    if min_rest[0] > budget:
        return None
    incumbent = _greedy(s_arr, c_arr, budget)
    size = np.zeros(1, dtype=np.int64)
    cost = np.zeros(1, dtype=np.float64)
    trail: list[tuple[np.ndarray, np.ndarray]] = []  # per group: (parent index, option) of each kept state
    largest = 1
    for i in range(n):
        k = len(s_arr[i])
        new_size = (size[:, None] + s_arr[i][None, :]).reshape(-1)
        new_cost = (cost[:, None] + c_arr[i][None, :]).reshape(-1)
        parent = np.repeat(np.arange(len(size)), k)
        option = np.tile(np.arange(k), len(size))
        keep = new_size + min_rest[i + 1] <= budget
        keep &= new_cost + cheap_rest[i + 1] <= incumbent
        new_size, new_cost, parent, option = new_size[keep], new_cost[keep], parent[keep], option[keep]
        order = np.lexsort((new_cost, new_size))  # by size, then cost
        new_size, new_cost, parent, option = new_size[order], new_cost[order], parent[order], option[order]
        # Pareto front: a state survives when it is strictly cheaper than every smaller-or-equal one
        best_before = np.minimum.accumulate(new_cost)
        front = np.ones(len(new_cost), dtype=bool)
        front[1:] = new_cost[1:] < best_before[:-1]
        size, cost = new_size[front], new_cost[front]
        trail.append((parent[front], option[front]))
        largest = max(largest, len(size))
    if not len(size):  # only when float rounding of the bound dropped the incumbent itself
        return _greedy_solution(s_arr, c_arr, budget, largest)
    best = int(np.argmin(cost))  # the front is sorted by size: argmin takes the smallest of equal costs
    choice = [0] * n
    idx = best
    for i in range(n - 1, -1, -1):
        parent, option = trail[i]
        choice[i] = int(option[idx])
        idx = int(parent[idx])
    return Solution(choice, int(size[best]), float(cost[best]), largest)


def _greedy(s_arr: list[np.ndarray], c_arr: list[np.ndarray], budget: int) -> float:
    """The cost of some feasible answer (an upper bound for pruning): start from the smallest options, then
    take the upgrades with the best cost reduction per byte while they fit. Infinite when none is found."""
    sol = _greedy_choice(s_arr, c_arr, budget)
    if sol is None:
        return float("inf")
    return float(sum(c_arr[i][j] for i, j in enumerate(sol))) * (1 + 1e-12) + 1e-300


def _greedy_choice(s_arr: list[np.ndarray], c_arr: list[np.ndarray], budget: int) -> list[int] | None:
    choice = [int(np.lexsort((c, s))[0]) for s, c in zip(s_arr, c_arr, strict=True)]
    total = sum(int(s_arr[i][j]) for i, j in enumerate(choice))
    if total > budget:
        return None
    while True:
        best, best_gain = None, 0.0
        for i, (s, c) in enumerate(zip(s_arr, c_arr, strict=True)):
            j = choice[i]
            extra = s - s[j]
            gain = c[j] - c
            ok = (gain > 0) & (total + extra <= budget)
            if not ok.any():
                continue
            ratio = np.where(ok, gain / np.maximum(extra, 1), -np.inf)
            k = int(np.argmax(ratio))
            if ratio[k] > best_gain:
                best, best_gain = (i, k), float(ratio[k])
        if best is None:
            return choice
        i, k = best
        total += int(s_arr[i][k] - s_arr[i][choice[i]])
        choice[i] = k


def _greedy_solution(s_arr: list[np.ndarray], c_arr: list[np.ndarray], budget: int, largest: int) -> Solution:
    choice = _greedy_choice(s_arr, c_arr, budget)
    assert choice is not None
    size = sum(int(s_arr[i][j]) for i, j in enumerate(choice))
    return Solution(choice, size, float(sum(c_arr[i][j] for i, j in enumerate(choice))), largest)
