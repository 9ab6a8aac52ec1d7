"""Routers (registry kind ``router``): turn each scheduled request's TierSet into the step's RoutePlan."""

from __future__ import annotations

import torch

from litellm_pipeline.engine.request import Request
from litellm_pipeline.model.batch import RoutePlan
from litellm_pipeline.model.config import ModelConfig
from litellm_pipeline.registry import register


@register("router", "tierset")
class TierSetRouter:
    """Each token may use its request's ``experts_per_token`` experts out of its ``allowed_experts``.

    When every request of the step uses the checkpoint's own routing the plan is ``None`` (the exact
    reference path); a batch that agrees on one limit gets a scalar ``max_k`` and no per-token tensor.
    """

    def __init__(self, model_cfg: ModelConfig, device: torch.device):
        self.native_k = model_cfg.experts_per_token
        self.num_experts = model_cfg.num_experts
        self.device = device

    def plan(self, schedule: list[tuple[Request, int]]) -> RoutePlan | None:
        if not self.num_experts or not schedule:
            return None
        ks = [r.tierset.experts_per_token for r, _ in schedule]
        restricted = [r.tierset.allowed_experts is not None for r, _ in schedule]
        k_max = max(ks)
        if not any(restricted) and all(k == self.native_k for k in ks):
            return None
        counts = torch.tensor([n for _, n in schedule])
        top_k = None
        if any(k != k_max for k in ks):
            top_k = torch.repeat_interleave(torch.tensor(ks), counts).to(self.device)
        allowed = None
        if any(restricted):
            rows = torch.ones(len(schedule), self.num_experts, dtype=torch.bool)
            for i, (r, _) in enumerate(schedule):
                if r.tierset.allowed_experts is not None:
                    rows[i] = False
                    rows[i, list(r.tierset.allowed_experts)] = True
            allowed = torch.repeat_interleave(rows, counts, dim=0).to(self.device)
        return RoutePlan(top_k=top_k, max_k=k_max, allowed=allowed)
