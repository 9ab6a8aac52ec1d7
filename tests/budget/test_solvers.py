"""Budget solvers: exact against brute force, greedy never infeasible, both on constructed cases."""

from __future__ import annotations

import random

import pytest

from litellm_pipeline import registry
from litellm_pipeline.budget.solvers import ExactSolver, GreedySolver
from litellm_pipeline.registry.types import Option, Problem
from litellm_pipeline.testing.budget_solver import brute_force, monotone_problem


def test_solvers_are_registered():
    assert registry.get("budget_solver", "exact") is ExactSolver
    assert registry.get("budget_solver", "greedy") is GreedySolver


@pytest.mark.parametrize("seed", range(60))
def test_exact_matches_brute_force_and_greedy_stays_feasible(seed):
    rng = random.Random(seed)
    p = monotone_problem(rng, layers=rng.randint(1, 5), options=rng.randint(1, 4), constraints=rng.randint(1, 3),
                         tight=rng.uniform(-0.1, 1.1))
    want = brute_force(p)
    got = ExactSolver().solve(p)
    greedy = GreedySolver().solve(p)
    if want is None:
        assert got is None and greedy is None
        return
    assert got is not None and p.fits(got.costs)
    assert got.value == pytest.approx(want.value, abs=1e-9)
    assert p.evaluate(got.choice).costs == pytest.approx(got.costs)
    # greedy: feasible whenever anything is, never better than the optimum
    assert greedy is not None and p.fits(greedy.costs) and greedy.value <= want.value + 1e-9


def test_constructed_case_where_greedy_is_not_optimal_but_exact_is():
    # layer 0's upgrade has the best value per cost, but once taken the budget no longer fits layer 1's
    # larger and more valuable one
    free = Option(1, (0.0,), 0.0)
    p = Problem(((free, Option(2, (1.0,), 1.5)), (free, Option(2, (2.0,), 2.8))), (2.0,))
    g, e = GreedySolver().solve(p), ExactSolver().solve(p)
    assert g.choice == (1, 0) and g.value == pytest.approx(1.5)
    assert e.choice == (0, 1) and e.value == pytest.approx(2.8) and e == brute_force(p)
    assert e.ks(p) == (1, 2)


def test_base_costs_count_against_the_limits():
    layer = (Option(1, (1.0, 0.1), 0.0), Option(4, (3.0, 0.4), 1.0))
    assert ExactSolver().solve(Problem((layer,), (3.5, None))).choice == (1,)
    assert ExactSolver().solve(Problem((layer,), (3.5, None), (1.0, 0.0))).choice == (0,)
    assert ExactSolver().solve(Problem((layer,), (1.5, None), (1.0, 0.0))) is None
    assert GreedySolver().solve(Problem((layer,), (1.5, None), (1.0, 0.0))) is None


def test_ties_are_deterministic():
    layer = (Option(1, (1.0,), 1.0), Option(2, (1.0,), 1.0))
    p = Problem((layer, layer), (None,))
    assert {ExactSolver().solve(p).choice for _ in range(5)} == {ExactSolver().solve(p).choice}
    assert GreedySolver().solve(p).choice == (0, 0)  # no upgrade raises the value


def test_bad_problems_are_refused():
    with pytest.raises(ValueError, match="at least one option"):
        Problem(((),), (1.0,))
    with pytest.raises(ValueError, match="needs 2 costs"):
        Problem(((Option(1, (1.0,), 0.0),),), (1.0, 2.0))


def test_exact_thins_a_state_explosion_and_says_so():
    rng = random.Random(3)
    p = monotone_problem(rng, layers=8, options=4, constraints=3, tight=0.6)
    p = Problem(p.layers, tuple(lim if lim is not None else 10.0 for lim in p.limits))  # three limits set
    want = brute_force(p)
    full = ExactSolver().solve(p)
    assert full.exact and full.value == pytest.approx(want.value, abs=1e-9)
    thin = ExactSolver(max_states=8).solve(p)
    assert not thin.exact and p.fits(thin.costs) and thin.value <= want.value + 1e-9
    assert p.evaluate(thin.choice).costs == pytest.approx(thin.costs)
    with pytest.raises(ValueError, match="max_states"):
        ExactSolver(max_states=0)


def test_exact_on_many_identical_layers_is_optimal():
    """32 MoE layers with the same options (the analytic cost model's case): the optimum is a count of layers
    per option, so it can be checked over those counts instead of 4**32 choices."""
    opts = tuple(Option(k, (0.1 * k, 0.01 * k, 0.002 * k), v) for k, v in ((1, -0.02), (2, 0.0), (4, 0.001),
                                                                            (8, 0.0015)))
    layers = 32
    for limit in (3.3, 5.0, 9.7, 20.0):
        p = Problem((opts,) * layers, (limit, None, None))
        got = ExactSolver().solve(p)
        best = max(
            (sum(n * o.value for n, o in zip(ns, opts)), ns)
            for ns in _counts(layers, len(opts))
            if sum(n * o.costs[0] for n, o in zip(ns, opts)) <= limit * (1 + 1e-12)
        )
        assert got.exact and got.value == pytest.approx(best[0], abs=1e-12) and p.fits(got.costs)
    # no limit at all: every layer takes its most valuable option
    assert ExactSolver().solve(Problem((opts,) * layers, (None, None, None))).choice == (3,) * layers


def test_exact_with_distinct_layers_and_one_limit_keeps_a_staircase():
    rng = random.Random(11)
    p = monotone_problem(rng, layers=24, options=4, constraints=1, tight=0.5)
    p = Problem(p.layers, (p.limits[0] or sum(min(o.costs[0] for o in opts) for opts in p.layers) * 1.5,))
    got = ExactSolver().solve(p)
    greedy = GreedySolver().solve(p)
    assert got.exact and p.fits(got.costs) and got.value >= greedy.value - 1e-12


def _counts(total: int, parts: int):
    if parts == 1:
        yield (total,)
        return
    for n in range(total + 1):
        for rest in _counts(total - n, parts - 1):
            yield (n, *rest)
