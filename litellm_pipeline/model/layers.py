"""Decoder building blocks. Layers take explicit arguments and hold plain parameters (no init work: the
loader fills them). Attention, MoE dispatch and the layer ops (projections, norms, activation, RoPE) are chosen
from the registry and bound when the pipeline is built; until then the torch reference ops run.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

from litellm_pipeline.model.expert_offload import offloaded_experts, predict_experts
from litellm_pipeline.model.layer_ops import TorchLayerOps
from litellm_pipeline.registry.types import AttentionMetadata, RoutePlan


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


REFERENCE_OPS = TorchLayerOps()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = _param(dim)
        self.eps = eps
        self.ops = REFERENCE_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up projections stacked into one matmul."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = _param(2 * intermediate, hidden)
        self.down_proj = _param(hidden, intermediate)
        self.ops = REFERENCE_OPS
        self.reduce: Callable | None = None  # tensor parallel: the all-reduce of the row-parallel down projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        y = ops.linear(ops.silu_mul(ops.linear(x, self.gate_up_proj)), self.down_proj)
        return y if self.reduce is None else self.reduce(y)


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
        o_bias: bool = False,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = _param(self.q_size + 2 * self.kv_size, hidden)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size) if bias else None
        self.o_proj = _param(hidden, self.q_size)
        self.o_bias = _param(hidden) if o_bias else None  # Llama / Qwen3 with attention_bias (q, k, v and o)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.sliding_window = sliding_window
        self.scale = head_dim**-0.5
        self.attn_fn = attn_fn
        self.ops = REFERENCE_OPS
        self.reduce: Callable | None = None  # tensor parallel: the all-reduce of the row-parallel o projection

    def forward(self, x, cos, sin, meta: AttentionMetadata, k_cache, v_cache) -> torch.Tensor:
        t = x.shape[0]
        ops = self.ops
        qkv = ops.linear(x, self.qkv_proj, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.rotary(q, k, cos, sin)
        o = self.attn_fn(q, k, v, k_cache, v_cache, meta, self.scale, self.sliding_window)
        if self.reduce is None:
            return ops.linear(o.reshape(t, self.q_size), self.o_proj, self.o_bias)
        out = self.reduce(ops.linear(o.reshape(t, self.q_size), self.o_proj))  # each rank's heads' partial sum
        return out if self.o_bias is None else out + self.o_bias


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
        expert_device: str | torch.device | None = None,
        experts: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.gate = _param(num_experts, hidden)
        # expert parallel: this rank holds experts [first, last) of the router's num_experts
        self.experts = experts if experts is not None and experts != (0, num_experts) else None
        local = num_experts if self.experts is None else self.experts[1] - self.experts[0]
        with torch.device(expert_device) if expert_device is not None else contextlib.nullcontext():
            self.w13 = _param(local, 2 * intermediate, hidden)
            self.w2 = _param(local, hidden, intermediate)
        self.top_k, self.normalize = top_k, normalize
        self.shared_expert = GatedMLP(hidden, shared_intermediate) if shared_intermediate else None
        self.shared_expert_gate = _param(1, hidden) if shared_intermediate else None
        self.dispatch_fn = dispatch_fn
        self.ops = REFERENCE_OPS
        # expert offload (moe.hot_experts, see expert_offload.py): this layer's device slots, and the next MoE
        # block, whose experts are predicted and prefetched while this one runs
        self.offload = None
        self.next_moe: SparseMoE | None = None
        # tensor or expert parallel: the all-reduce of this rank's share of the block's output
        self.reduce: Callable | None = None
        # expert parallel alone: the shared expert is whole on every rank, and one of them adds it
        self.runs_shared = True

    def forward(self, x: torch.Tensor, plan: RoutePlan | None) -> torch.Tensor:
        ops = self.ops
        idx, w = ops.route(x, self.gate, self.top_k, self.normalize, plan)
        if self.experts is not None:  # the slots routed to this rank's experts, numbered locally; the others unused
            first, last = self.experts
            own = (idx >= first) & (idx < last)
            idx = torch.where(own, idx - first, -1)
            w = torch.where(own, w, 0.0)
        if self.offload is None:
            out = self.dispatch_fn(x, idx, w, self.w13, self.w2, ops)
        else:
            nxt = self.next_moe
            if nxt is not None:  # start the next layer's copies before this layer's experts run
                nxt.offload.prefetch(predict_experts(x, nxt.gate, idx.shape[1], ops.linear))
            out = offloaded_experts(self.offload, x, idx, w, ops)
        if self.shared_expert is not None and self.runs_shared:
            g = ops.linear(x, self.shared_expert_gate)  # [T, 1]
            gate = _rowwise_sigmoid(g) if getattr(ops, "deterministic", False) else torch.sigmoid(g)
            out = out + gate * self.shared_expert(x)
        return out if self.reduce is None else self.reduce(out)


def _rowwise_sigmoid(z: torch.Tensor) -> torch.Tensor:
    """sigmoid of a [T, 1] column, each row computed alike whatever T is: ``softmax([z, 0])[0]``, which the CPU
    softmax runs row by row. ``torch.sigmoid`` runs a flat [T] tensor through vector lanes and a scalar tail that
    round differently, so a row's last bits would depend on where it sits in the batch (within 1e-7 of it)."""
    return torch.softmax(torch.nn.functional.pad(z, (0, 1)), -1)[:, :1]


class DecoderLayer(nn.Module):
    def __init__(self, attn: Attention, mlp: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.is_moe = isinstance(mlp, SparseMoE)
        self.ops = REFERENCE_OPS
        self.fused_decode: Callable | None = None  # the ops' decode_attention, when bound (see CausalLM.bind)

    def forward(self, h, cos, sin, meta, k_cache, v_cache, plan: RoutePlan | None) -> torch.Tensor:
        hx = None
        if self.fused_decode is not None and meta.decode_only:
            hx = self.fused_decode(self, h, cos, sin, meta, k_cache, v_cache)
        if hx is None:
            post = self.post_attention_layernorm
            a = self.self_attn(self.input_layernorm(h), cos, sin, meta, k_cache, v_cache)
            hx = self.ops.add_rms_norm(h, a, post.weight, post.eps)  # the residual add and the next norm in one pass
        h, x = hx
        if self.is_moe:
            return h + self.mlp(x, plan)
        return self.ops.residual_mlp(h, x, self.mlp) if self.mlp.reduce is None else h + self.mlp(x)
