"""Mixture-of-Experts: per-token expert choice under a TierSet, and packed expert dispatch (kind ``moe_dispatch``).

Routing is deterministic: experts are ranked with a stable sort of the router probabilities, so equal
scores always resolve to the lower expert id whatever else is in the batch. A dispatch implementation is
a callable ``(x, expert_idx, expert_w, w13, w2, ops) -> out`` where ``expert_idx``/``expert_w`` are ``[T, K]``
(index -1 marks an unused slot), ``w13`` is ``[E, 2I, H]`` (gate and up stacked), ``w2`` ``[E, H, I]`` and
``ops`` the model's bound ``layer_ops`` (its ``linear`` and ``silu_mul`` run the experts).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from litellm_pipeline.registry import register
from litellm_pipeline.registry.types import RoutePlan


def route_tokens(
    router_logits: torch.Tensor, native_k: int, normalize: bool, plan: RoutePlan | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each token's experts and weights: softmax in float32, top-k within its TierSet, optional renorm."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    k = native_k
    if plan is not None:
        if plan.allowed is not None:
            probs = probs.masked_fill(~plan.allowed, 0.0)
        if plan.max_k is not None:
            k = plan.max_k
    k = min(k, probs.shape[-1])
    weights, idx = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, idx = weights[:, :k], idx[:, :k]
    if plan is not None and plan.top_k is not None:
        unused = torch.arange(k, device=idx.device)[None, :] >= plan.top_k[:, None]
        weights = weights.masked_fill(unused, 0.0)
        idx = idx.masked_fill(unused, -1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return idx, weights


@register("moe_dispatch", "packed")
def packed_dispatch(
    x: torch.Tensor, expert_idx: torch.Tensor, expert_w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ops
) -> torch.Tensor:
    """Group the (token, expert) pairs of the whole batch by expert and run each expert once on its pack."""
    counts = torch.bincount(expert_idx.reshape(-1) + 1, minlength=w13.shape[0] + 1).tolist()  # one host sync per layer
    return packed_experts(x, expert_idx, expert_w, counts, lambda e: (w13[e], w2[e]), ops)


def packed_experts(
    x: torch.Tensor, expert_idx: torch.Tensor, expert_w: torch.Tensor, counts: list[int],
    weights: Callable[[int], tuple[torch.Tensor, torch.Tensor]], ops,
) -> torch.Tensor:
    """``packed``'s arithmetic with each expert's ``(w13_e, w2_e)`` from ``weights(e)``, asked in expert order for
    the experts some token chose; ``counts[e + 1]`` is how many slots chose expert ``e`` (``counts[0]``: unused)."""
    t, k = expert_idx.shape
    order = torch.argsort(expert_idx.reshape(-1), stable=True)
    flat_w = expert_w.reshape(-1)
    out = torch.zeros_like(x)
    start = counts[0]  # slots marked -1 sort first and are skipped
    for e in range(len(counts) - 1):
        c = counts[e + 1]
        if c == 0:
            continue
        sel = order[start : start + c]
        start += c
        tok = sel // k
        xe = x[tok]
        w13_e, w2_e = weights(e)
        ye = ops.linear(ops.silu_mul(ops.linear(xe, w13_e)), w2_e)
        ye = ye * flat_w[sel, None]
        out.index_put_((tok,), ye.to(out.dtype), accumulate=True)  # tok is unique per expert; faster than index_add_ on CPU
    return out


@register("moe_dispatch", "fused")
def fused_dispatch(
    x: torch.Tensor, expert_idx: torch.Tensor, expert_w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ops
) -> torch.Tensor:
    """``packed`` as one call into the layer ops (``cpu_fused``: C++), same grouping and rounding; ``packed`` itself
    where the layer ops have no such call or it does not apply (another device or dtype)."""
    run = getattr(ops, "moe_experts", None)
    out = run(x, expert_idx, expert_w, w13, w2) if run is not None else None
    return out if out is not None else packed_dispatch(x, expert_idx, expert_w, w13, w2, ops)
