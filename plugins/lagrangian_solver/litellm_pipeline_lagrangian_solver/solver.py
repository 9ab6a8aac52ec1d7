"""lagrangian: a budget solver by Lagrangian relaxation, with a repair step and a proof of optimality when it has one.

The problem (``litellm_pipeline/budget/solvers.py``) is a multiple-choice knapsack: one option per layer, the summed
costs within every limit, the summed value maximal. Relaxing the limits with multipliers ``lam >= 0`` (one per
limited cost, costs scaled by their limits) splits it into one independent choice per layer:

    L(lam) = sum over layers of max_o (value_o - lam . cost_o) + lam . (1 - base)

Every ``L(lam)`` is an upper bound on the optimum, and the layer-wise choice that attains it is a candidate. The
multipliers follow projected subgradient steps with Polyak's step size towards the best value found so far. Each
candidate is made feasible (downgrade the layer that gives back the most excess per value lost) and then filled
(upgrade while it fits, best value per added cost first); the greedy solver's answer is a candidate too, so the
result is never below ``greedy``. Work per problem is ``iterations x layers x options``, whatever the number of
limits, where the exact solver's Pareto sets can grow with every limit.

``Solution.exact`` is True only when the best value found meets the smallest upper bound (the relaxation had no
gap): then it is provably optimal.
"""

from __future__ import annotations

from litellm_pipeline.budget.solvers import GreedySolver
from litellm_pipeline.registry.types import Problem, Solution

_GAP = 1e-9


class LagrangianSolver:
    """Lagrangian relaxation + repair + greedy fill; ``iterations`` subgradient steps at most."""

    def __init__(self, iterations: int = 60):
        if iterations < 1:
            raise ValueError(f"iterations: must be >= 1 (got {iterations})")
        self.iterations = iterations

    def solve(self, problem: Problem) -> Solution | None:
        best = GreedySolver().solve(problem)  # feasible whenever the cheapest choice fits, else None
        if best is None:
            return None
        active = [j for j, lim in enumerate(problem.limits) if lim is not None]
        if not active:  # nothing limited: every layer takes its most valuable option
            choice = tuple(max(range(len(o)), key=lambda i: (o[i].value, -i)) for o in problem.layers)
            return _with_exact(problem.evaluate(choice), True)
        scale = [1.0 / problem.limits[j] if problem.limits[j] > 0 else 1.0 for j in active]
        rhs = [problem.limits[j] * s - problem.base()[j] * s for j, s in zip(active, scale)]
        costs = [[[o.costs[j] * s for j, s in zip(active, scale)] for o in opts] for opts in problem.layers]
        lam = [0.0] * len(active)
        bound = float("inf")
        tried: set[tuple[int, ...]] = set()
        for _ in range(self.iterations):
            choice, dual = _relaxed(problem, costs, lam, rhs)
            bound = min(bound, dual)
            if choice not in tried:
                tried.add(choice)
                cand = _fill(problem, _repair(problem, list(choice)))
                if cand is not None and cand.value > best.value + 1e-12:
                    best = cand
            if bound - best.value <= _GAP * max(1.0, abs(best.value)):
                break  # no gap left: optimal
            used = [sum(costs[li][i][j] for li, i in enumerate(choice)) for j in range(len(active))]
            grad = [u - r for u, r in zip(used, rhs)]  # > 0: the relaxed choice overspends that limit
            norm = sum(g * g for g in grad)
            if norm == 0.0:
                break
            step = (dual - best.value) / norm  # Polyak: aim the bound at the best value found
            lam = [max(0.0, lam_j + step * g) for lam_j, g in zip(lam, grad)]
        exact = bound - best.value <= _GAP * max(1.0, abs(best.value))
        return _with_exact(best, exact)


def _with_exact(s: Solution, exact: bool) -> Solution:
    return Solution(s.choice, s.costs, s.value, exact)


def _relaxed(problem: Problem, costs, lam: list[float], rhs: list[float]) -> tuple[tuple[int, ...], float]:
    """The layer-wise maximiser of the Lagrangian at ``lam`` (ties: the cheaper, then lower index) and L(lam)."""
    choice, total = [], sum(l_j * r for l_j, r in zip(lam, rhs))
    for opts, layer_costs in zip(problem.layers, costs):
        scored = [(o.value - sum(l_j * c for l_j, c in zip(lam, cs)), -sum(cs), -i)
                  for i, (o, cs) in enumerate(zip(opts, layer_costs))]
        top = max(scored)
        choice.append(-top[2])
        total += top[0]
    return tuple(choice), total


def _scales(problem: Problem) -> tuple[float, ...]:
    """Per cost, one over its limit (so costs of different units add up), or over the dearest total if unlimited."""
    out = []
    for j, lim in enumerate(problem.limits):
        top = lim if lim is not None and lim > 0 else sum(max(o.costs[j] for o in opts) for opts in problem.layers)
        out.append(1.0 / top if top > 0 else 0.0)
    return tuple(out)


def _excess(problem: Problem, costs: tuple[float, ...], scale: tuple[float, ...]) -> float:
    return sum(max(0.0, c - lim) * s for c, lim, s in zip(costs, problem.limits, scale) if lim is not None)


def _repair(problem: Problem, choice: list[int]) -> list[int] | None:
    """Downgrade layers until the choice fits: each time the option that removes the most scaled excess per unit
    of value lost. None if no downgrade helps (the caller then has greedy's answer)."""
    scale = _scales(problem)
    sol = problem.evaluate(tuple(choice))
    while not problem.fits(sol.costs):
        over = _excess(problem, sol.costs, scale)
        pick = None
        for li, opts in enumerate(problem.layers):
            cur = opts[choice[li]]
            for oi, o in enumerate(opts):
                new = tuple(c - a + b for c, a, b in zip(sol.costs, cur.costs, o.costs))
                gain = over - _excess(problem, new, scale)
                if gain <= 1e-12 * max(1.0, over):  # rounding noise: swapping equal costs must not loop forever
                    continue
                ratio = (cur.value - o.value) / gain
                if pick is None or ratio < pick[0]:
                    pick = (ratio, li, oi)
        if pick is None:
            return None
        choice[pick[1]] = pick[2]
        sol = problem.evaluate(tuple(choice))
    return choice


def _fill(problem: Problem, choice: list[int] | None) -> Solution | None:
    """Upgrade a fitting choice while some upgrade raises the value and still fits (best value per added cost)."""
    if choice is None:
        return None
    scale = _scales(problem)
    sol = problem.evaluate(tuple(choice))
    while True:
        pick = None
        for li, opts in enumerate(problem.layers):
            cur = opts[choice[li]]
            for oi, o in enumerate(opts):
                gain = o.value - cur.value
                if gain <= 0:
                    continue
                new = tuple(c - a + b for c, a, b in zip(sol.costs, cur.costs, o.costs))
                if not problem.fits(new):
                    continue
                added = sum(max(0.0, b - a) * s for a, b, s in zip(cur.costs, o.costs, scale))
                ratio = gain / max(added, 1e-12)
                if pick is None or ratio > pick[0]:
                    pick = (ratio, li, oi)
        if pick is None:
            return sol
        choice[pick[1]] = pick[2]
        sol = problem.evaluate(tuple(choice))
