"""select_tier: choose the TierSet a request may spend in MoE layers (see :mod:`litellm_pipeline.budget.selector`).

The stage asks the :class:`~litellm_pipeline.budget.selector.TierSetSelector` for a TierSet given the request's
tier, budget, prompt length, ``max_tokens`` and the engine's current load, keeps the decision on the request
(its cost record is built from it when the request finishes) and sets the token limit the monetary budget
allows, which the engine enforces (``finish_reason="budget"``).
"""

from __future__ import annotations

import heapq
import math
import time

from litellm_pipeline import registry
from litellm_pipeline.budget.latency import LatencyTracker
from litellm_pipeline.budget.selector import (
    MODES,
    Load,
    Mode,
    TierSetSelector,
    budget_text,
)
from litellm_pipeline.errors import InvalidRequestError, OverloadedError
from litellm_pipeline.registry import register
from litellm_pipeline.registry.types import SchedulerLoad
from litellm_pipeline.stages.base import RequestContext, Stage


@register("stage", "select_tier")
class SelectTier(Stage):
    """Pick the TierSet a request may spend in MoE layers, from its tier, budget and the engine's load.

    ``mode``: fixed | balanced | deep | max; ``tier``: the configured tier of ``fixed`` mode (and of
    ``balanced`` / ``deep`` on a dense model)."""

    level = "request"
    inputs = ("admitted",)
    outputs = ("tierset",)

    def __init__(self, rt, mode: Mode = "fixed", tier: str = "balanced"):
        super().__init__(rt)
        if mode not in MODES:  # before the tracker subscribes to the bus
            raise ValueError(f"mode: {mode!r} is not a select_tier mode; allowed: {', '.join(MODES)}")
        if tier not in rt.tiers:
            raise ValueError(
                f"pipeline.stages.select_tier.params.tier: unknown tier {tier!r}; known tiers: {', '.join(rt.tiers)}"
            )
        b = rt.budget
        # the modes that decide by predicted latency keep it current from what requests took (this enables
        # the event bus; fixed and max only report predictions and leave it as configured)
        self.tracker = LatencyTracker() if mode in ("balanced", "deep") else None
        if self.tracker is not None:
            rt.bus.subscribe(self.tracker)
        self.selector = TierSetSelector(
            rt.tiers, rt.cost_model, registry.get("budget_solver", b.solver)(), rt.model_cfg.num_experts,
            mode=mode, default_tier=tier, on_infeasible=b.on_infeasible, weights=b.weights, tracker=self.tracker,
            latency_headroom=b.latency_headroom,
        )

    def __call__(self, ctx: RequestContext) -> None:
        rt, req = self.rt, ctx.request
        if req.tier is not None and req.tier not in rt.tiers:
            raise InvalidRequestError("tier", f"unknown tier {req.tier!r}; known tiers: {', '.join(rt.tiers)}")
        if req.budget is None:
            req.budget = rt.budget.default
        prompt = len(req.prompt_ids)
        max_tokens = min(req.params.max_tokens, rt.max_model_len - prompt)
        held = rt.scheduler.load()
        load = self._load(held)
        if self.tracker is not None:
            self._protect_admitted(held, load, prompt)
        sel = self.selector.select(req.tier, req.budget, prompt, max_tokens, load)
        req.tierset, req.selection = sel.tierset, sel
        req.budget_max_tokens = self._affordable(req, sel.tierset, prompt)
        ctx.tierset = req.tierset

    def _affordable(self, req, ts, prompt: int) -> int | None:
        """The most output tokens the monetary budget pays for at ``ts`` (None: no monetary limit)."""
        cap = req.budget.monetary_cost_units if req.budget is not None else None
        if cap is None:
            return None
        left = cap - ts.price.of(prompt, 0)
        per_token = ts.price.of(0, 1)
        if per_token == 0:
            n = math.inf if left >= 0 else 0
        else:
            n = math.floor(left / per_token + 1e-9)
        if n < 1:
            raise InvalidRequestError(
                "budget",
                f"cannot be met ({budget_text(req.budget)}): at {ts.name} the {prompt} prompt tokens and one output "
                f"token cost {ts.price.of(prompt, 1):.4g} monetary units",
            )
        return None if n == math.inf else int(n)

    def _protect_admitted(self, sched: SchedulerLoad, load: Load, prompt_tokens: int) -> None:
        """Refuse a new request (OverloadedError, 503) if what it adds to the steps of the requests already in
        flight (its prefill once, and one more decode row in every step) would push one of them past its latency
        budget when that request would keep it otherwise: under overload the requests admitted first keep their
        budgets instead of every request missing them. A request in flight also waits through the prompt work
        already queued (chunks share its steps), and every step is measured with what the serving loop spends
        between steps."""
        inflight = [r for r in sched.in_flight if r.budget is not None and r.budget.latency_cost_ms is not None]
        if not inflight:
            return
        default = self.selector.default
        now = time.monotonic()
        ahead = min(len(sched.running) + len(sched.waiting), sched.max_num_seqs)  # the batch without the newcomer
        before = self.selector.predict(default, 1, 1, Load(batch=max(1, ahead))).per_token_ms
        after = self.selector.predict(default, 1, 1, Load(batch=load.batch)).per_token_ms
        prefill_ms = self.selector.prefill_ms(prompt_tokens)
        queued_ms = self.selector.prefill_ms(sched.queued_prompt_tokens())
        for r in inflight:
            left_ms = (r.arrival - now) * 1e3 + r.budget.latency_cost_ms * self.selector.plan_share - queued_ms
            steps = _output_left(r) + (0 if r.num_computed >= len(r.prompt_ids) else 1)
            if steps * before <= left_ms < steps * after + prefill_ms:
                raise OverloadedError(
                    f"the engine is at capacity for latency budgets: one more request would make request "
                    f"{r.request_id!r} miss its latency_cost_ms={r.budget.latency_cost_ms:g} ({steps} steps left at "
                    f"{after:.3g} ms instead of {before:.3g} ms each, and {prefill_ms:.3g} ms for the new prompt; "
                    f"{left_ms:.3g} ms of its budget left); retry later"
                )

    def _load(self, sched: SchedulerLoad) -> Load:
        """The batch a new request joins and the time before its prefill starts: the prompt work queued ahead
        of it at the default tier's prefill cost, plus, when every sequence slot is taken, the decode steps until
        one frees for it (the running and waiting requests ahead each hold a slot for their remaining output
        tokens, first come first served) at the predicted step time of a full batch."""
        running, waiting = sched.running, sched.waiting
        slots = sched.max_num_seqs
        batch = min(len(running) + len(waiting) + 1, slots)
        default = self.selector.default
        wait_ms = self.selector.prefill_ms(sched.queued_prompt_tokens())
        if len(running) + len(waiting) >= slots:
            step_ms = self.selector.predict(default, 1, 1, Load(batch=slots)).per_token_ms
            wait_ms += steps_until_free_slot(running, waiting, slots) * step_ms
        return Load(batch=batch, wait_ms=wait_ms)


def _output_left(req) -> int:
    cap = req.params.max_tokens if req.budget_max_tokens is None else min(req.params.max_tokens, req.budget_max_tokens)
    return max(1, cap - len(req.output_ids))


def steps_until_free_slot(running, waiting, slots: int) -> int:
    """Decode steps until a sequence slot is free for a request that queues behind ``waiting``: each running
    request frees its slot after its remaining output tokens, each waiting one takes the first slot to free
    and holds it for its own (upper bounds: a request may stop early)."""
    free_at = sorted(_output_left(r) for r in running)[:slots]
    free_at += [0] * (slots - len(free_at))
    heapq.heapify(free_at)
    for r in waiting:
        heapq.heapreplace(free_at, free_at[0] + _output_left(r))
    return free_at[0]
