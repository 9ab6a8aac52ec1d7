"""Routers (registry kind ``router``): turn each scheduled request's TierSet into the step's RoutePlan."""

from __future__ import annotations

import torch

from litellm_pipeline.engine.request import Request
from litellm_pipeline.model.config import ModelConfig
from litellm_pipeline.registry import register
from litellm_pipeline.registry.types import RoutePlan


@register("router", "tierset")
class TierSetRouter:
    """Each token may use its request's experts per token (in each layer) out of its ``allowed_experts``.

    When every request of the step uses the checkpoint's own routing the plan is ``None`` (the exact
    reference path); a batch that agrees on one limit gets a scalar ``max_k`` and no per-token tensor. When
    some request's TierSet differs between layers, the plan is a tuple with one entry per layer (layers with
    the same counts across the batch share one entry).
    """

    def __init__(self, model_cfg: ModelConfig, device: torch.device):
        self.native_k = model_cfg.experts_per_token
        self.num_experts = model_cfg.num_experts
        self.num_layers = model_cfg.num_layers
        self.device = device

    def plan(self, schedule: list[tuple[Request, int]]) -> RoutePlan | tuple[RoutePlan | None, ...] | None:
        if not self.num_experts or not schedule:
            return None
        uniform = [r.tierset.uniform_k for r, _ in schedule]
        allowed = self._allowed(schedule)
        if all(k is not None for k in uniform):
            return self._layer_plan(uniform, allowed, schedule)
        per_layer: dict[tuple[int, ...], RoutePlan | None] = {}
        plans = []
        for layer in range(self.num_layers):
            ks = tuple(r.tierset.experts_per_layer[layer] for r, _ in schedule)
            if ks not in per_layer:
                per_layer[ks] = self._layer_plan(ks, allowed, schedule)
            plans.append(per_layer[ks])
        return tuple(plans)

    def _allowed(self, schedule: list[tuple[Request, int]]) -> torch.Tensor | None:
        if all(r.tierset.allowed_experts is None for r, _ in schedule):
            return None
        rows = torch.ones(len(schedule), self.num_experts, dtype=torch.bool)
        for i, (r, _) in enumerate(schedule):
            if r.tierset.allowed_experts is not None:
                rows[i] = False
                rows[i, list(r.tierset.allowed_experts)] = True
        counts = torch.tensor([n for _, n in schedule])
        return torch.repeat_interleave(rows, counts, dim=0).to(self.device)

    def _layer_plan(self, ks, allowed, schedule) -> RoutePlan | None:
        k_max = max(ks)
        if allowed is None and all(k == self.native_k for k in ks):
            return None
        top_k = None
        if any(k != k_max for k in ks):
            counts = torch.tensor([n for _, n in schedule])
            top_k = torch.repeat_interleave(torch.tensor(ks), counts).to(self.device)
        return RoutePlan(top_k=top_k, max_k=k_max, allowed=allowed)
