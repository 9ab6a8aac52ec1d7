"""route: the per-token expert limits of this step, from each request's TierSet (a registered router)."""

from __future__ import annotations

from litellm_pipeline import registry
from litellm_pipeline.registry import register
from litellm_pipeline.stages.base import Stage, StepContext


@register("stage", "route")
class Route(Stage):
    inputs = ("schedule", "tierset")
    outputs = ("route_plan",)

    def __init__(self, rt, router: str = "tierset", **router_params):
        super().__init__(rt)
        self.router = registry.get("router", router)(rt.model_cfg, rt.device, **router_params)

    def __call__(self, ctx: StepContext) -> None:
        ctx.route_plan = self.router.plan(ctx.schedule)
