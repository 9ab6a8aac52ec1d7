"""Budget solvers (registry kind ``budget_solver``): pick one option per layer that fits every limit.

The problem is a multiple-choice knapsack with several constraints: each decoder layer offers options (an
expert count with its costs — end-to-end ms, inter-token ms, money — and its value), the sums of each cost
must stay within its limit, and the summed value is maximised. Options are assumed monotone: a layer's
cheapest option is the cheapest in every cost (true of the cost model, where more experts cost more of all).

* ``exact`` — dynamic programming over the Pareto set of partial solutions: optimal.
* ``greedy`` — from the cheapest choice in every layer, upgrade the layer with the best value per unit of
  normalised cost while everything still fits: fast, never infeasible when the cheapest choice fits.

A solver is a class with ``solve(problem) -> Solution | None`` (None: not even the cheapest choice fits).
"""

from __future__ import annotations

from dataclasses import dataclass

from litellm_pipeline.registry import register


@dataclass(frozen=True)
class Option:
    k: int  # the expert count this option stands for
    costs: tuple[float, ...]  # one per constraint of the problem
    value: float


@dataclass(frozen=True)
class Problem:
    layers: tuple[tuple[Option, ...], ...]  # the options of each layer
    limits: tuple[float | None, ...]  # per constraint: the most the summed costs may be (None: no limit)
    base_costs: tuple[float, ...] = ()  # costs outside the layers, counted against the limits

    def __post_init__(self) -> None:
        n = len(self.limits)
        if any(not opts for opts in self.layers):
            raise ValueError("every layer needs at least one option")
        if any(len(o.costs) != n for opts in self.layers for o in opts):
            raise ValueError(f"every option needs {n} costs, one per limit")
        if self.base_costs and len(self.base_costs) != n:
            raise ValueError(f"base_costs needs {n} entries, one per limit")

    def base(self) -> tuple[float, ...]:
        return self.base_costs or (0.0,) * len(self.limits)

    def fits(self, costs: tuple[float, ...]) -> bool:
        return all(lim is None or c <= lim * (1 + 1e-12) for c, lim in zip(costs, self.limits))

    def evaluate(self, choice: tuple[int, ...]) -> Solution:
        costs = list(self.base())
        value = 0.0
        for opts, i in zip(self.layers, choice):
            o = opts[i]
            costs = [c + d for c, d in zip(costs, o.costs)]
            value += o.value
        return Solution(tuple(choice), tuple(costs), value)

    def cheapest(self) -> Solution:
        """The cheapest option in every layer (by the sum of its costs scaled by the limits)."""
        scale = self._scales()
        choice = tuple(min(range(len(opts)), key=lambda i: (_norm(opts[i].costs, scale), -opts[i].value))
                       for opts in self.layers)
        return self.evaluate(choice)

    def _scales(self) -> tuple[float, ...]:
        out = []
        for j, lim in enumerate(self.limits):
            if lim is not None and lim > 0:
                out.append(1.0 / lim)
            else:
                top = sum(max(o.costs[j] for o in opts) for opts in self.layers)
                out.append(1.0 / top if top > 0 else 0.0)
        return tuple(out)


@dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]  # per layer: the index of the chosen option
    costs: tuple[float, ...]
    value: float

    def ks(self, problem: Problem) -> tuple[int, ...]:
        return tuple(opts[i].k for opts, i in zip(problem.layers, self.choice))


def _norm(costs: tuple[float, ...], scale: tuple[float, ...]) -> float:
    return sum(c * s for c, s in zip(costs, scale))


@register("budget_solver", "exact")
class ExactSolver:
    """Optimal: extend every kept partial solution by every option of the next layer, drop those that can no
    longer fit (even with the cheapest options for the remaining layers) and those another partial solution
    dominates (no more costly in every constraint and at least as valuable)."""

    def __init__(self, max_states: int = 200_000):
        self.max_states = max_states

    def solve(self, problem: Problem) -> Solution | None:
        n = len(problem.layers)
        # the least each remaining suffix of layers can add, per constraint, for pruning
        tail = [[0.0] * len(problem.limits) for _ in range(n + 1)]
        for i in range(n - 1, -1, -1):
            tail[i] = [t + min(o.costs[j] for o in problem.layers[i]) for j, t in enumerate(tail[i + 1])]
        states: list[tuple[tuple[float, ...], float, tuple[int, ...]]] = [(problem.base(), 0.0, ())]
        for i, opts in enumerate(problem.layers):
            grown = []
            for costs, value, choice in states:
                for oi, o in enumerate(opts):
                    c = tuple(a + b for a, b in zip(costs, o.costs))
                    if problem.fits(tuple(a + b for a, b in zip(c, tail[i + 1]))):
                        grown.append((c, value + o.value, choice + (oi,)))
            states = _pareto(grown)
            if not states:
                return None
            if len(states) > self.max_states:
                raise RuntimeError(
                    f"budget_solver exact: {len(states)} partial solutions after layer {i} (max_states "
                    f"{self.max_states}); use budget.solver=greedy for a problem this size"
                )
        costs, value, choice = max(states, key=lambda s: (s[1], [-c for c in s[0]]))
        return Solution(choice, costs, value)


def _pareto(states):
    """The states no other state dominates; of equal ones the first is kept (deterministic)."""
    # by value descending: a state can only be dominated by one that comes before it
    states = sorted(states, key=lambda s: (-s[1], s[0], s[2]))
    kept: list = []
    for s in states:
        if not any(k[1] >= s[1] and all(a <= b for a, b in zip(k[0], s[0])) for k in kept):
            kept.append(s)
    return kept


@register("budget_solver", "greedy")
class GreedySolver:
    """Start from the cheapest option in every layer; while some upgrade of one layer raises the value and
    still fits, take the one with the most value per unit of added normalised cost (ties: the lower layer)."""

    def solve(self, problem: Problem) -> Solution | None:
        current = problem.cheapest()
        if not problem.fits(current.costs):
            return None
        scale = problem._scales()
        choice = list(current.choice)
        costs, value = list(current.costs), current.value
        while True:
            best = None
            for li, opts in enumerate(problem.layers):
                cur = opts[choice[li]]
                for oi, o in enumerate(opts):
                    gain = o.value - cur.value
                    if gain <= 0:
                        continue
                    delta = [a - b for a, b in zip(o.costs, cur.costs)]
                    new = tuple(c + d for c, d in zip(costs, delta))
                    if not problem.fits(new):
                        continue
                    ratio = gain / max(_norm(tuple(delta), scale), 1e-12)
                    if best is None or ratio > best[0]:
                        best = (ratio, li, oi, new, gain)
            if best is None:
                return Solution(tuple(choice), tuple(costs), value)
            _, li, oi, new, gain = best
            choice[li] = oi
            costs, value = list(new), value + gain
