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

import numpy as np

from litellm_pipeline.registry import register
from litellm_pipeline.registry.types import Problem, Solution, _norm


@register("budget_solver", "exact")
class ExactSolver:
    """Optimal: extend every kept partial solution by every option of the next layer, drop those that can no
    longer fit (even with the cheapest options for the remaining layers) and those another partial solution
    dominates (no more costly in every limited constraint and at least as valuable). Vectorised with numpy; a
    choice is read back through parent links at the end.

    Only constraints with a limit take part in dominance (an unlimited cost cannot make a plan infeasible), so a
    budget with one limit keeps a one-dimensional staircase, filtered by a sort. Where more partial solutions
    than ``max_states`` survive (many layers with distinct costs under several limits), they are thinned to the
    most valuable one per cell of a grid over the limited costs; the result is then feasible but may fall short
    of the optimum by what one cell's width of cost buys (never below the greedy solution, which is also
    computed then), and ``Solution.exact`` says so."""

    def __init__(self, max_states: int = 1024):
        if max_states < 1:
            raise ValueError(f"max_states: must be >= 1 (got {max_states})")
        self.max_states = max_states

    def solve(self, problem: Problem) -> Solution | None:
        n, m = len(problem.layers), len(problem.limits)
        active = [j for j, lim in enumerate(problem.limits) if lim is not None]
        lim = np.array([np.inf if x is None else x * (1 + 1e-12) for x in problem.limits])
        opt_costs = [np.array([o.costs for o in opts], dtype=float).reshape(len(opts), m) for opts in problem.layers]
        opt_values = [np.array([o.value for o in opts]) for opts in problem.layers]
        # the least each remaining suffix of layers can add, per constraint, for pruning
        tail = np.zeros((n + 1, m))
        for i in range(n - 1, -1, -1):
            tail[i] = tail[i + 1] + opt_costs[i].min(axis=0)
        costs = np.array([problem.base()], dtype=float).reshape(1, m)
        values = np.zeros(1)
        links: list[tuple[np.ndarray, np.ndarray]] = []  # per layer: (parent state, option) of each kept state
        exact = True
        for i in range(n):
            k = len(opt_values[i])
            c = (costs[:, None, :] + opt_costs[i][None, :, :]).reshape(-1, m)
            v = (values[:, None] + opt_values[i][None, :]).reshape(-1)
            parent = np.repeat(np.arange(len(values)), k)
            option = np.tile(np.arange(k), len(values))
            ok = (c + tail[i + 1] <= lim).all(axis=1)
            if not ok.any():
                return None
            c, v, parent, option = c[ok], v[ok], parent[ok], option[ok]
            order = np.lexsort((option, parent, *c.T[::-1], -v))  # value first, then costs: deterministic
            c, v, parent, option = c[order], v[order], parent[order], option[order]
            if len(active) > 1 and len(v) > self.max_states:  # thin before the quadratic filter
                keep = _thin(c[:, active], self.max_states)
                c, v, parent, option = c[keep], v[keep], parent[keep], option[keep]
                exact = False
            keep = _pareto(c[:, active], v)
            c, v, parent, option = c[keep], v[keep], parent[keep], option[keep]
            if len(v) > self.max_states:
                keep = np.sort(_thin(c[:, active], self.max_states))
                c, v, parent, option = c[keep], v[keep], parent[keep], option[keep]
                exact = False
            costs, values = c, v
            links.append((parent, option))
        best = 0  # states stay sorted by value descending, then costs
        choice = []
        for parent, option in reversed(links):
            choice.append(int(option[best]))
            best = int(parent[best])
        sol = Solution(tuple(reversed(choice)), tuple(float(x) for x in costs[0]), float(values[0]), exact)
        if not exact:
            greedy = GreedySolver().solve(problem)
            if greedy is not None and greedy.value > sol.value:
                return Solution(greedy.choice, greedy.costs, greedy.value, False)
        return sol


def _pareto(c: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Indices (in the given order: value descending, then costs) of the states no other state dominates over
    the cost columns ``c``; of equal states the first is kept."""
    if c.shape[1] == 0:  # nothing limited: only the value counts
        return np.arange(1)
    if c.shape[1] == 1:  # a staircase: by cost, keep each state more valuable than every cheaper one
        by_cost = np.argsort(c[:, 0], kind="stable")  # equal costs keep the value order
        vs = v[by_cost]
        before = np.maximum.accumulate(np.concatenate(([-np.inf], vs[:-1])))
        return np.sort(by_cost[vs > before])
    keep = np.ones(len(v), dtype=bool)
    for lo in range(0, len(v), 256):  # blockwise: an earlier state (more valuable) no costlier anywhere
        hi = min(len(v), lo + 256)
        le = (c[None, :hi, :] <= c[lo:hi, None, :]).all(axis=2)
        le &= np.tri(hi - lo, hi, lo - 1, dtype=bool)  # strictly earlier in the order only
        keep[lo:hi] &= ~le.any(axis=1)
    return np.flatnonzero(keep)


def _thin(c: np.ndarray, max_states: int) -> np.ndarray:
    """Indices of at most ~``max_states`` states: the first (most valuable) in each cell of a grid over ``c``."""
    per_dim = max(1, int(max_states ** (1.0 / max(1, c.shape[1]))))
    lo = c.min(axis=0)
    width = np.maximum((c.max(axis=0) - lo) / per_dim, 1e-300)
    cells = np.minimum(((c - lo) / width).astype(np.int64), per_dim - 1)
    _, first = np.unique(cells, axis=0, return_index=True)
    return np.sort(first)


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
