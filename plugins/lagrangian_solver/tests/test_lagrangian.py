"""lagrangian: the conformance kit (with honest exactness claims), against greedy and exact, and in the engine."""

from __future__ import annotations

import random

import pytest

plugin = pytest.importorskip(
    "litellm_pipeline_lagrangian_solver", reason="plugin not installed: pip install -e plugins/lagrangian_solver"
)

from litellm_pipeline import SamplingParams, registry  # noqa: E402
from litellm_pipeline.budget.solvers import ExactSolver, GreedySolver  # noqa: E402
from litellm_pipeline.registry.types import Option, Problem  # noqa: E402
from litellm_pipeline.testing import check_budget_solver  # noqa: E402
from litellm_pipeline.testing._support import assert_drained, build_llm  # noqa: E402
from litellm_pipeline.testing.budget_solver import brute_force, monotone_problem  # noqa: E402

Solver = plugin.LagrangianSolver


def test_registered_through_its_entry_point():
    assert "lagrangian" in registry.names("budget_solver")
    assert registry.get("budget_solver", "lagrangian") is Solver


def test_passes_the_conformance_kit_and_its_exact_flag_is_a_proof():
    # optimal=True: every solution not flagged exact=False must be the brute-force optimum
    assert check_budget_solver(Solver, optimal=True) > 100


def test_never_below_greedy_and_mostly_optimal():
    rng = random.Random(5)
    optimal = exact = 0
    for _ in range(200):
        p = monotone_problem(rng, rng.randint(1, 6), rng.randint(1, 4), rng.randint(1, 3), rng.uniform(0.0, 1.0))
        got, best, greedy = Solver().solve(p), brute_force(p), GreedySolver().solve(p)
        assert (got is None) == (best is None) == (greedy is None)
        if got is None:
            continue
        assert got.value >= greedy.value - 1e-12
        optimal += abs(got.value - best.value) <= 1e-9
        exact += got.exact
    assert optimal >= 190 and exact >= 40, (optimal, exact)  # 195 and 56 with these seeds


def test_escapes_the_greedy_trap_but_claims_no_proof_across_a_gap():
    free = Option(1, (0.0,), 0.0)
    p = Problem(((free, Option(2, (1.0,), 1.5)), (free, Option(2, (2.0,), 2.8))), (2.0,))
    assert GreedySolver().solve(p).value == pytest.approx(1.5)
    got = Solver().solve(p)
    assert got.choice == (0, 1) and got.value == pytest.approx(2.8)
    # the best bound is L(2.8) = 0.1 + 0 + 2.8 = 2.9 > 2.8: optimal, but the relaxation cannot prove it
    assert not got.exact
    one = Problem(((free, Option(2, (1.0,), 1.5)),), (2.0,))  # no gap: the bound meets the value
    assert Solver().solve(one).exact


def test_many_layers_and_limits_beat_the_thinned_exact_solver():
    """48 layers under three limits: the exact solver has to thin its Pareto sets there (exact=False); the
    relaxation needs no states and finds a better plan than both."""
    rng = random.Random(1)
    p = monotone_problem(rng, 48, 4, 3, 0.5)
    lows = [sum(min(o.costs[j] for o in opts) for opts in p.layers) for j in range(3)]
    p = Problem(p.layers, tuple(lo * 1.6 for lo in lows))
    got, thinned, greedy = Solver().solve(p), ExactSolver().solve(p), GreedySolver().solve(p)
    assert p.fits(got.costs) and not thinned.exact
    assert got.value > thinned.value > greedy.value


def test_bad_iterations_are_refused():
    with pytest.raises(ValueError, match="iterations"):
        Solver(iterations=0)


def test_plans_requests_as_well_as_the_exact_solver():
    """deep mode on the demo model: under the same monetary budgets both solvers reach the same predicted quality."""
    params = SamplingParams(temperature=0.0, max_tokens=6)
    plans = {}
    for solver in ("exact", "lagrangian"):
        llm = build_llm([f"budget.solver={solver}", "pipeline.stages.select_tier.params.mode=deep"])
        full = llm.generate("12+345=", params, tier="max")[0].cost.predicted_monetary
        plans[solver] = [llm.generate("12+345=", params, budget={"monetary_cost_units": full * s})[0].cost
                         for s in (0.9, 0.6, 0.4)]
        assert_drained(llm, solver)
    # the demo model's layers cost the same, so equally good plans may put the experts in different layers
    for lag, ex in zip(plans["lagrangian"], plans["exact"]):
        assert lag.predicted_quality == pytest.approx(ex.predicted_quality, abs=1e-12)
        assert sorted(lag.experts_per_layer) == sorted(ex.experts_per_layer)
    assert len({c.experts_per_layer for c in plans["exact"]}) > 1  # the budgets really made different plans
