"""Decoder building blocks. Layers take explicit arguments and hold plain parameters (no init work: the
loader fills them). Attention and MoE dispatch are callables chosen from the registry when the model is built.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from litellm_pipeline.model.batch import AttentionMetadata, RoutePlan
from litellm_pipeline.model.moe import route_tokens
from litellm_pipeline.model.rope import apply_rotary


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = _param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 statistics, then back to the input dtype before the weight (as the reference models do)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up projections stacked into one matmul."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = _param(2 * intermediate, hidden)
        self.down_proj = _param(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj)


class Attention(nn.Module):
    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        qk_norm_eps: float | None,
        sliding_window: int | None,
        attn_fn: Callable,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = _param(self.q_size + 2 * self.kv_size, hidden)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size) if bias else None
        self.o_proj = _param(hidden, self.q_size)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.sliding_window = sliding_window
        self.scale = head_dim**-0.5
        self.attn_fn = attn_fn

    def forward(self, x, cos, sin, meta: AttentionMetadata, k_cache, v_cache) -> torch.Tensor:
        t = x.shape[0]
        qkv = F.linear(x, self.qkv_proj, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, cos, sin)
        o = self.attn_fn(q, k, v, k_cache, v_cache, meta, self.scale, self.sliding_window)
        return F.linear(o.reshape(t, self.q_size), self.o_proj)


class SparseMoE(nn.Module):
    """Mixtral / Qwen-MoE block: router, top-k experts (limited by the step's RoutePlan), optional shared expert."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        normalize: bool,
        shared_intermediate: int,
        dispatch_fn: Callable,
    ):
        super().__init__()
        self.gate = _param(num_experts, hidden)
        self.w13 = _param(num_experts, 2 * intermediate, hidden)
        self.w2 = _param(num_experts, hidden, intermediate)
        self.top_k, self.normalize = top_k, normalize
        self.shared_expert = GatedMLP(hidden, shared_intermediate) if shared_intermediate else None
        self.shared_expert_gate = _param(1, hidden) if shared_intermediate else None
        self.dispatch_fn = dispatch_fn

    def forward(self, x: torch.Tensor, plan: RoutePlan | None) -> torch.Tensor:
        idx, w = route_tokens(F.linear(x, self.gate), self.top_k, self.normalize, plan)
        out = self.dispatch_fn(x, idx, w, self.w13, self.w2)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate)) * self.shared_expert(x)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, attn: Attention, mlp: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.is_moe = isinstance(mlp, SparseMoE)

    def forward(self, h, cos, sin, meta, k_cache, v_cache, plan: RoutePlan | None) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, meta, k_cache, v_cache)
        x = self.post_attention_layernorm(h)
        return h + (self.mlp(x, plan) if self.is_moe else self.mlp(x))
