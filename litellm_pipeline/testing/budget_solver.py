"""check_budget_solver: a ``budget_solver`` class against brute force on small multiple-choice problems.

The contract (``litellm_pipeline/budget/solvers.py``): a class built with no arguments whose ``solve(problem)`` takes
a :class:`~litellm_pipeline.budget.solvers.Problem` (per layer a tuple of ``Option(k, costs, value)``, one limit per
cost, None meaning unlimited, optional ``base_costs`` counted against the limits) and returns a ``Solution(choice,
costs, value)`` with one option index per layer, or None. What must hold, for problems whose options are monotone
(a layer's cheapest option is cheapest in every cost, as the cost model's expert counts are):

* None only when no choice fits; otherwise a choice that fits every limit (never infeasible when one exists);
* ``costs`` and ``value`` are what ``problem.evaluate(choice)`` says;
* the value is never above the optimum (a solver that claims more has mis-added), and an optimal solver reaches it;
* the same problem gives the same choice every time (requests must be reproducible).
"""

from __future__ import annotations

import itertools
import random
from typing import Iterator

from litellm_pipeline.registry.types import Option, Problem, Solution
from litellm_pipeline.testing._support import describe, resolve

_EPS = 1e-9


def brute_force(problem: Problem) -> Solution | None:
    """The optimum by enumeration (the most valuable fitting choice; ties: the first in index order)."""
    best = None
    for choice in itertools.product(*(range(len(opts)) for opts in problem.layers)):
        s = problem.evaluate(choice)
        if problem.fits(s.costs) and (best is None or s.value > best.value + 1e-12):
            best = s
    return best


def monotone_problem(rng: random.Random, layers: int, options: int, constraints: int, tight: float,
                     base: bool = False) -> Problem:
    """Each layer's options cost more in every constraint the more value they give (like expert counts);
    ``tight`` places each limit between the cheapest (0) and the dearest (1) total; some limits are None."""
    out = []
    for _ in range(layers):
        costs = [sorted(rng.uniform(0.1, 5.0) for _ in range(options)) for _ in range(constraints)]
        values = sorted(rng.uniform(-1.0, 1.0) for _ in range(options))
        out.append(tuple(Option(i + 1, tuple(c[i] for c in costs), values[i]) for i in range(options)))
    base_costs = tuple(rng.uniform(0.0, 2.0) for _ in range(constraints)) if base else ()
    offset = base_costs or (0.0,) * constraints
    lows = [offset[j] + sum(min(o.costs[j] for o in opts) for opts in out) for j in range(constraints)]
    highs = [offset[j] + sum(max(o.costs[j] for o in opts) for opts in out) for j in range(constraints)]
    limits = tuple(lo + tight * (hi - lo) if rng.random() < 0.8 else None for lo, hi in zip(lows, highs))
    return Problem(tuple(out), limits, base_costs)


def constructed_problems() -> Iterator[tuple[str, Problem]]:
    """Edge cases with known answers: nothing fits, exactly fits, a greedy trap, no limits, ties, base costs."""
    free = Option(1, (0.0,), 0.0)
    yield "greedy trap", Problem(((free, Option(2, (1.0,), 1.5)), (free, Option(2, (2.0,), 2.8))), (2.0,))
    layer = (Option(1, (1.0, 0.1), 0.0), Option(4, (3.0, 0.4), 1.0))
    yield "one layer, room for the dearest", Problem((layer,), (3.5, None))
    yield "base costs leave room for the cheapest only", Problem((layer,), (3.5, None), (1.0, 0.0))
    yield "base costs leave no room", Problem((layer,), (1.5, None), (1.0, 0.0))
    yield "the cheapest choice exactly at the limit", Problem((layer, layer), (2.0, 0.2))
    yield "nothing fits", Problem((layer, layer), (1.9, None))
    opts = tuple(Option(k, (0.1 * k, 0.01 * k), v) for k, v in ((1, -0.02), (2, 0.0), (4, 0.001), (8, 0.0015)))
    yield "no limits: every layer its most valuable option", Problem((opts,) * 6, (None, None))
    yield "identical layers under one limit", Problem((opts,) * 6, (2.3, None))
    tie = (Option(1, (1.0,), 1.0), Option(2, (1.0,), 1.0))
    yield "equal options", Problem((tie, tie), (None,))
    yield "a single option per layer", Problem(((Option(2, (1.0, 1.0), 0.3),),) * 3, (3.0, 3.0))
    neg = (Option(1, (0.5,), -1.0), Option(2, (1.0,), -0.5), Option(4, (2.0,), -0.1))
    yield "negative values", Problem((neg, neg, neg), (3.5,))


def _check_one(solver, name: str, label: str, problem: Problem, optimal: bool) -> None:
    want = brute_force(problem)
    got = solver.solve(problem)
    where = f"budget_solver {name} on {label} (limits {problem.limits}, {len(problem.layers)} layers)"
    if want is None:
        assert got is None, f"{where}: nothing fits, but it returned {got}"
        return
    assert got is not None, f"{where}: returned None although {want.choice} fits (value {want.value:.6g})"
    assert isinstance(got, Solution), f"{where}: must return a Solution, got {type(got).__name__}"
    choice = tuple(got.choice)
    assert len(choice) == len(problem.layers) and all(
        isinstance(i, int) and 0 <= i < len(opts) for i, opts in zip(choice, problem.layers)
    ), f"{where}: choice {got.choice} is not one option index per layer"
    real = problem.evaluate(choice)
    assert problem.fits(real.costs), f"{where}: choice {choice} costs {real.costs}, over the limits {problem.limits}"
    assert all(abs(a - b) <= _EPS * max(1.0, abs(b)) for a, b in zip(got.costs, real.costs)) and len(got.costs) == len(
        real.costs), f"{where}: reports costs {got.costs} but problem.evaluate({choice}) gives {real.costs}"
    assert abs(got.value - real.value) <= _EPS * max(1.0, abs(real.value)), (
        f"{where}: reports value {got.value} but problem.evaluate({choice}) gives {real.value}"
    )
    assert got.value <= want.value + _EPS, (
        f"{where}: value {got.value} is above the optimum {want.value} ({want.choice})"
    )
    if optimal and getattr(got, "exact", True):
        assert got.value >= want.value - _EPS, (
            f"{where}: value {got.value} ({choice}) is below the optimum {want.value} ({want.choice}), and the "
            "solution claims to be exact"
        )
    again = solver.solve(problem)
    assert again is not None and tuple(again.choice) == choice, (
        f"{where}: solving the same problem again chose {None if again is None else again.choice}, first {choice}"
    )


def _in_engine(impl, name: str) -> None:
    """The demo model's balanced mode solves every request's budget with this solver; the plan must fit it."""
    from litellm_pipeline.sampling import SamplingParams
    from litellm_pipeline.testing._support import assert_drained, build_llm, config_name

    with config_name("budget_solver", impl) as cfg:
        llm = build_llm([f"budget.solver={cfg}", "pipeline.stages.select_tier.params.mode=balanced"])
        params = SamplingParams(temperature=0.0, max_tokens=6)
        full = llm.generate("12+345=", params, tier="max")[0].cost
        for share in (1.0, 0.6, 0.3):
            budget = {"monetary_cost_units": full.predicted_monetary * share}
            out = llm.generate("12+345=", params, budget=budget)[0]
            assert out.cost is not None and out.cost.feasible, (
                f"budget_solver {name} in the engine: no feasible TierSet for {budget}, although the cheapest fits"
            )
            assert out.cost.predicted_monetary <= budget["monetary_cost_units"] * (1 + 1e-9), (
                f"budget_solver {name} in the engine: planned {out.cost.predicted_monetary} monetary units for a "
                f"budget of {budget['monetary_cost_units']}"
            )
        assert_drained(llm, f"budget_solver {name}")


def check_budget_solver(impl: str | type, *, optimal: bool = False, random_cases: int = 150, engine: bool = True,
                        seed: int = 0) -> int:
    """Check a ``budget_solver`` class (a registry name or the class) against :func:`brute_force`.

    Runs the constructed cases of :func:`constructed_problems` and ``random_cases`` random monotone problems (1-5
    layers, 1-4 options, 1-3 constraints, limits from below the cheapest to above the dearest total, some
    unlimited, some with base costs). ``optimal=True`` also demands the optimum wherever the solution does not
    say ``exact=False``. With ``engine=True`` the demo model's ``balanced`` mode plans requests with it under
    monetary budgets. Returns the number of problems checked.
    """
    cls = resolve("budget_solver", impl)
    name = impl if isinstance(impl, str) else describe(impl)
    solver = cls()
    n = 0
    for label, problem in constructed_problems():
        _check_one(solver, name, label, problem, optimal)
        n += 1
    rng = random.Random(seed)
    for i in range(random_cases):
        p = monotone_problem(rng, rng.randint(1, 5), rng.randint(1, 4), rng.randint(1, 3), rng.uniform(-0.1, 1.1),
                             base=rng.random() < 0.3)
        _check_one(solver, name, f"random problem {i} (seed {seed})", p, optimal)
        n += 1
    if engine:
        _in_engine(impl, name)
    return n
