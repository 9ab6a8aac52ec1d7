"""TierSetSelector: which TierSet a request runs at, from the mode, its budget, the solver and the cost model.

Modes (``pipeline.stages.select_tier.params.mode``):

* ``fixed`` — the request's own tier, else the configured one; the budget is only checked.
* ``balanced`` — the best weighted score (quality, minus latency and money relative to the full model, by
  ``budget.weights``) among the per-layer expert counts that fit the budget.
* ``deep`` — the highest predicted quality that fits the budget.
* ``max`` — every expert in every layer; the budget is only checked.

A request that names a tier always gets it (its budget checked). Where nothing fits, ``budget.on_infeasible``
decides: ``reject`` (an invalid-request error naming the budget and the cheapest feasible cost) or
``cheapest`` (run the cheapest TierSet, flagged in the cost record).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, get_args

from litellm_pipeline.budget.latency import LatencyTracker
from litellm_pipeline.budget.spec import LIMITS, BudgetSpec
from litellm_pipeline.errors import InvalidRequestError
from litellm_pipeline.registry.types import Option, Problem
from litellm_pipeline.tiers.cost_model import CostModel, Prediction
from litellm_pipeline.tiers.tierset import TierSet

Mode = Literal["fixed", "balanced", "deep", "max"]
MODES = get_args(Mode)


@dataclass(frozen=True)
class Weights:
    """``balanced`` mode's score: quality minus latency and money, each relative to the full model's."""

    quality: float = 1.0
    latency: float = 0.1
    monetary: float = 0.1


@dataclass(frozen=True)
class BudgetPolicy:
    """The plain ``budget`` config the select_tier stage works with."""

    solver: str = "exact"
    on_infeasible: Literal["reject", "cheapest"] = "reject"
    weights: Weights = Weights()
    default: BudgetSpec | None = None  # the budget of requests that bring none
    latency_headroom: float = 0.0  # share of a latency budget the solvers and the in-flight guard leave unplanned


@dataclass(frozen=True)
class Load:
    """What the engine is doing when a request arrives: the batch it will join and the work ahead of it."""

    batch: int = 1  # decode batch the request will be part of (itself included)
    wait_ms: float = 0.0  # predicted time before its prefill starts


@dataclass(frozen=True)
class Selection:
    tierset: TierSet
    predicted: Prediction
    feasible: bool  # whether the TierSet is predicted to keep every limit of the budget
    mode: str
    cost_model: str = "analytic"
    load: Load = Load()
    # (end-to-end, inter-token) factors the prediction was corrected by (what requests and steps measured): the
    # cost model's own prediction is ``predicted`` divided by them, which is what a finished request is compared
    # with to learn the next factors
    correction: tuple[float, float] = (1.0, 1.0)


def _limits(budget: BudgetSpec | None) -> tuple[float | None, float | None, float | None]:
    return budget.limits() if budget is not None else (None, None, None)


def budget_text(budget: BudgetSpec | None) -> str:
    parts = [f"{n}={v:g}" for n, v in zip(LIMITS, _limits(budget)) if v is not None]
    return ", ".join(parts) if parts else "no limits"


def within(pred: Prediction, budget: BudgetSpec | None) -> dict[str, bool]:
    """Per set limit of ``budget``: whether the prediction keeps it."""
    return budget.kept(pred.latency_ms, pred.per_token_ms, pred.monetary) if budget is not None else {}


class TierSetSelector:
    def __init__(
        self,
        tiers: Mapping[str, TierSet],
        cost_model: CostModel,
        solver,
        num_experts: int,
        mode: Mode = "fixed",
        default_tier: str = "balanced",
        on_infeasible: Literal["reject", "cheapest"] = "reject",
        weights: Weights = Weights(),
        tracker: LatencyTracker | None = None,
        latency_headroom: float = 0.0,
    ):
        if mode not in MODES:
            raise ValueError(f"mode: {mode!r} is not a select_tier mode; allowed: {', '.join(MODES)}")
        self.tiers, self.cost, self.solver = tiers, cost_model, solver
        self.mode, self.default, self.on_infeasible, self.weights = mode, tiers[default_tier], on_infeasible, weights
        self.num_experts = num_experts
        self.tracker = tracker
        self.plan_share = 1.0 - latency_headroom  # of a latency limit, what a plan may use
        self._factors_cache: dict[tuple[str | None, int], tuple[float, float]] = {}
        self._factors_at = -1  # the tracker's version the cache holds
        layers = len(cost_model.layers)
        # every expert in every layer: the configured tier that says so (with its name and price), if any
        self.full = self.solved_tierset((num_experts,) * layers) if layers else self.default

    # ---- the decision -----------------------------------------------------------------------------------
    def select(self, tier: str | None, budget: BudgetSpec | None, prompt_tokens: int, max_tokens: int,
               load: Load = Load()) -> Selection:
        if tier is not None or self.mode == "fixed":
            ts = self.tiers[tier] if tier is not None else self.default
            return self._checked(ts, budget, prompt_tokens, max_tokens, load, "fixed")
        if self.mode == "max" or not self.cost.layers:
            ts = self.full if self.mode == "max" else self.default
            return self._checked(ts, budget, prompt_tokens, max_tokens, load, self.mode)
        problem = self.problem(budget, prompt_tokens, max_tokens, load)
        solution = self.solver.solve(problem)
        if solution is None:
            return self._infeasible(problem, budget, prompt_tokens, max_tokens, load)
        ts = self.solved_tierset(solution.ks(problem))
        sel = self._selection(ts, prompt_tokens, max_tokens, load, True, self.mode)
        if self._keeps_plan(sel.predicted, budget):
            return sel
        # the solver plans with what requests at every TierSet took; what requests at this one took says it would
        # not keep the budget: the best configured tier whose own prediction keeps it, else refused up front
        # rather than served late
        lat_scale, money_scale = self._scales(prompt_tokens, max_tokens, load.batch)
        best = None
        for t in self.tiers.values():
            alt = self._selection(t, prompt_tokens, max_tokens, load, True, self.mode)
            pred = alt.predicted
            if not self._keeps_plan(pred, budget) or not within(pred, budget).get("monetary_cost_units", True):
                continue
            # what the mode maximizes, for the whole TierSet (as ``problem`` weighs its layers)
            score = pred.quality if self.mode == "deep" else (
                self.weights.quality * pred.quality - lat_scale * pred.latency_ms - money_scale * pred.monetary)
            if best is None or score > best[0]:
                best = (score, alt)
        if best is not None:
            return best[1]
        return self._infeasible(problem, budget, prompt_tokens, max_tokens, load)

    def _scales(self, prompt_tokens: int, max_tokens: int, batch: int) -> tuple[float, float]:
        """``balanced`` mode's weights on latency and money, relative to the full model's for this request."""
        full = self.cost.predict(self.full, prompt_tokens, max_tokens, batch)
        w = self.weights
        return (w.latency / full.latency_ms if full.latency_ms > 0 else 0.0,
                w.monetary / full.monetary if full.monetary > 0 else 0.0)

    def predict(self, ts: TierSet, prompt_tokens: int, max_tokens: int, load: Load) -> Prediction:
        """The cost model's prediction, corrected by what requests at this TierSet and batch actually took."""
        return self._corrected(ts, prompt_tokens, max_tokens, load)[0]

    def _corrected(self, ts: TierSet, prompt_tokens: int, max_tokens: int, load: Load):
        """(the corrected prediction, the (end-to-end, inter-token) factors it was corrected by)."""
        p = self.cost.predict(ts, prompt_tokens, max_tokens, load.batch, load.wait_ms)
        f, g = self._factors(ts.name, load.batch)
        if (f, g) == (1.0, 1.0):
            return p, (f, g)
        return Prediction(p.latency_ms * f, p.per_token_ms * g, p.monetary, p.quality), (f, g)

    def _selection(self, ts, prompt_tokens, max_tokens, load, feasible, mode, budget=None) -> Selection:
        pred, correction = self._corrected(ts, prompt_tokens, max_tokens, load)
        if feasible is None:
            feasible = all(within(pred, budget).values())
        return Selection(ts, pred, feasible, mode, self.cost.source, load, correction)

    def _factors(self, tier: str | None, batch: int) -> tuple[float, float]:
        """(end-to-end, inter-token) corrections: what requests took against their predictions, raised to what
        engine steps at this batch took against the predicted step time where that says more (steps are
        measured every few milliseconds, requests only when they finish)."""
        if self.tracker is None:
            return 1.0, 1.0
        if self._factors_at != self.tracker.version:  # measured since: what was cached is stale
            self._factors_at = self.tracker.version
            self._factors_cache.clear()
        got = self._factors_cache.get((tier, batch))
        if got is None:
            got = self._factors_cache[(tier, batch)] = self._measured_factors(tier, batch)
        return got

    def _measured_factors(self, tier: str | None, batch: int) -> tuple[float, float]:
        f, g = self.tracker.factors(tier, batch)
        measured = self.tracker.step_ms(batch)
        if measured is not None:
            base = self.cost.predict(self.default, 1, 1, batch).per_token_ms
            if base > 0:
                s = measured / base
                f, g = max(f, s), max(g, s)
        return f, g

    def prefill_ms(self, tokens: int) -> float:
        """What prefilling ``tokens`` prompt tokens adds to the engine's steps: measured by the tracker where it
        has seen prefills, else the cost model's estimate at the default TierSet."""
        measured = self.tracker.prefill_ms(tokens) if self.tracker is not None and tokens else None
        return measured if measured is not None else tokens * self.cost.prefill_ms_per_token(self.default)

    def solved_tierset(self, ks: tuple[int, ...]) -> TierSet:
        """A configured tier when one has exactly these counts (and no expert restriction), else a new one."""
        for t in self.tiers.values():
            if t.experts_per_layer == ks and t.allowed_experts is None:
                return t
        name = f"{ks[0]}" if all(k == ks[0] for k in ks) else "-".join(map(str, ks))
        return TierSet(f"auto:{name}", ks, price=self.cost.mixed_price(ks))

    def problem(self, budget: BudgetSpec | None, prompt_tokens: int, max_tokens: int, load: Load) -> Problem:
        """One option per expert count per layer; constraints: end-to-end ms, inter-token ms, money."""
        cm, w = self.cost, self.weights
        lat_scale, money_scale = self._scales(prompt_tokens, max_tokens, load.batch)
        layers = []
        for i in range(len(cm.layers)):
            opts = []
            for k in cm.choices:
                lat, tok, money, q = cm.layer_option(i, k, prompt_tokens, max_tokens, load.batch)
                value = q if self.mode == "deep" else w.quality * q - lat_scale * lat - money_scale * money
                opts.append(Option(k, (lat, tok, money), value))
            layers.append(tuple(opts))
        fixed_lat, fixed_tok = cm.fixed(prompt_tokens, max_tokens, load.batch)
        f, g = self._factors(None, load.batch)  # measured / predicted latency at this batch, all TierSets
        if (f, g) != (1.0, 1.0):
            layers = [tuple(Option(o.k, (o.costs[0] * f, o.costs[1] * g, o.costs[2]), o.value) for o in opts)
                      for opts in layers]
        lat, tok, money = _limits(budget)
        limits = (None if lat is None else lat * self.plan_share, None if tok is None else tok * self.plan_share, money)
        return Problem(tuple(layers), limits, ((fixed_lat + load.wait_ms) * f, fixed_tok * g, 0.0))

    # ---- helpers ------------------------------------------------------------------------------------------
    def _checked(self, ts, budget, prompt_tokens, max_tokens, load, mode) -> Selection:
        return self._selection(ts, prompt_tokens, max_tokens, load, None, mode, budget)

    def _infeasible(self, problem: Problem, budget, prompt_tokens, max_tokens, load) -> Selection:
        cheapest = problem.cheapest()
        ts = self.solved_tierset(cheapest.ks(problem))
        if self.on_infeasible == "cheapest":
            return self._selection(ts, prompt_tokens, max_tokens, load, False, self.mode)
        pred = self.predict(ts, prompt_tokens, max_tokens, load)
        raise InvalidRequestError(
            "budget",
            f"cannot be met ({budget_text(budget)}): the cheapest TierSet ({ts.name}, experts per layer "
            f"{list(ts.experts_per_layer)}) is predicted at latency_cost_ms={pred.latency_ms:.3g}, "
            f"latency_per_token_ms={pred.per_token_ms:.3g}, monetary_cost_units={pred.monetary:.4g} for "
            f"{prompt_tokens} prompt and {max_tokens} output tokens ({self.cost.source} cost model)"
            + self._planning_note(budget),
        )

    def _keeps_plan(self, pred: Prediction, budget: BudgetSpec | None) -> bool:
        """Whether ``pred`` keeps the share of the budget's latency limits a plan may use (money is the solver's
        own: its costs are exact)."""
        lat, tok, _ = _limits(budget)
        eps = 1e-9
        return ((lat is None or pred.latency_ms <= lat * self.plan_share * (1 + eps))
                and (tok is None or pred.per_token_ms <= tok * self.plan_share * (1 + eps)))

    def _planning_note(self, budget: BudgetSpec | None) -> str:
        """What a latency limit was planned against, where that is less than the limit itself."""
        if budget is None or (budget.latency_cost_ms is None and budget.latency_per_token_ms is None):
            return ""
        if self.plan_share < 1.0:
            return f"; {self.plan_share:.0%} of a latency limit is planned with (budget.latency_headroom)"
        return ""
