"""select_tier: choose the TierSet a request may spend in MoE layers."""

from __future__ import annotations

from typing import Literal

from litellm_pipeline.errors import InvalidRequestError
from litellm_pipeline.registry import register
from litellm_pipeline.stages.base import RequestContext, Stage


@register("stage", "select_tier")
class SelectTier(Stage):
    """Mode ``fixed``: the request's own tier if it names one, else the configured ``tier``."""

    level = "request"
    inputs = ("admitted",)
    outputs = ("tierset",)

    def __init__(self, rt, mode: Literal["fixed"] = "fixed", tier: str = "balanced"):
        super().__init__(rt)
        if mode != "fixed":
            raise ValueError(f"pipeline.stages.select_tier.params.mode: {mode!r} is not available; allowed: fixed")
        if tier not in rt.tiers:
            raise ValueError(
                f"pipeline.stages.select_tier.params.tier: unknown tier {tier!r}; known tiers: {', '.join(rt.tiers)}"
            )
        self.default = rt.tiers[tier]

    def __call__(self, ctx: RequestContext) -> None:
        req = ctx.request
        if req.tier is None:
            req.tierset = self.default
        elif req.tier in self.rt.tiers:
            req.tierset = self.rt.tiers[req.tier]
        else:
            raise InvalidRequestError("tier", f"unknown tier {req.tier!r}; known tiers: {', '.join(self.rt.tiers)}")
        ctx.tierset = req.tierset
