"""CausalLM: the one decoder implementation behind every supported family (dense and MoE)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from litellm_pipeline.model.attention_cpu import cpu_paged_attention
from litellm_pipeline.model.config import ModelConfig
from litellm_pipeline.model.layers import (
    REFERENCE_OPS,
    Attention,
    DecoderLayer,
    GatedMLP,
    RMSNorm,
    SparseMoE,
    _param,
)
from litellm_pipeline.model.moe import fused_dispatch
from litellm_pipeline.model.rope import RotaryEmbedding
from litellm_pipeline.model.weight_arena import pack_weights
from litellm_pipeline.parallel.comm import Collectives
from litellm_pipeline.parallel.shard import Shard
from litellm_pipeline.registry.types import AttentionMetadata, RoutePlan


class CausalLM(nn.Module):
    """Embedding -> decoder layers -> final norm -> LM head, over a flat batch of tokens and a paged KV cache."""

    def __init__(self, cfg: ModelConfig, attn_fn: Callable, dispatch_fn: Callable,
                 expert_device: str | torch.device | None = None, shard: Shard | None = None,
                 comm: Collectives | None = None):
        """``shard``: this rank's part of the model under tensor / expert parallelism (``parallel/shard.py``), its
        collectives run over ``comm``; None: the whole model."""
        super().__init__()
        self.cfg = cfg
        self.shard = shard = shard or Shard()
        self.comm = comm
        self.vocab_range = shard.vocab(cfg.vocab_size)
        self.embed_tokens = _param(self.vocab_range[1] - self.vocab_range[0], cfg.hidden_size)
        qk_eps = cfg.rms_norm_eps if cfg.qk_norm else None
        t = shard.tensor
        reduce = comm.all_reduce if comm is not None else None
        layers = []
        for i in range(cfg.num_layers):
            attn = Attention(
                cfg.hidden_size,
                cfg.num_heads // t,
                shard.local_kv_heads(cfg),
                cfg.head_dim,
                cfg.attention_bias,
                qk_eps,
                cfg.sliding_windows[i],
                attn_fn,
                o_bias=cfg.o_bias,
            )
            if t > 1:
                attn.reduce = reduce
            if cfg.is_moe and cfg.moe_layers[i]:
                mlp: nn.Module = SparseMoE(
                    cfg.hidden_size,
                    cfg.moe_intermediate_size // (1 if shard.expert > 1 else t),
                    cfg.num_experts,
                    cfg.experts_per_token,
                    cfg.norm_topk_prob,
                    cfg.shared_expert_intermediate_size // t,
                    dispatch_fn,
                    expert_device,
                    experts=shard.experts(cfg),
                )
                if shard.parallel:
                    mlp.reduce = reduce  # one all-reduce for the routed and the shared experts together
                    mlp.runs_shared = t > 1 or shard.rank == 0
            else:
                mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size // t)
                if t > 1:
                    mlp.reduce = reduce
            layers.append(DecoderLayer(attn, mlp, cfg.hidden_size, cfg.rms_norm_eps))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else _param(*self.embed_tokens.shape)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)
        self.dynamic_rope = cfg.rope.get("rope_type") == "dynamic"
        self.ops = REFERENCE_OPS
        self.fused_decode_layers: Callable | None = None  # the ops' decode_layers, when bound (see bind)
        self.decode_weights: dict | None = None
        # on the driver of a parallel engine: sends each call to the workers' shards first (parallel/workers.py)
        self.mirror = None

    def bind(self, attn_fn: Callable, dispatch_fn: Callable, ops: object | None = None, huge_pages: bool = False) -> None:
        """Swap the attention / MoE dispatch / layer ops implementations of every layer (once, at build time).

        ``huge_pages``: then move the (final) CPU weights into transparent huge pages (``weight_arena``); ops that
        key state by a weight's address get ``weights_moved(model)`` afterwards.
        """
        for layer in self.layers:
            layer.self_attn.attn_fn = attn_fn
            if layer.is_moe:
                layer.mlp.dispatch_fn = dispatch_fn
        if ops is not None:
            prepare = getattr(ops, "prepare_weights", None)
            if prepare is not None:  # e.g. weight-only quantization: the ops convert the weights they will read
                prepare(self)
            self.ops = ops
            for m in self.modules():
                if m is not self and hasattr(m, "ops"):
                    m.ops = ops
        if huge_pages and getattr(self, "expert_offload", None) is None and pack_weights(self):
            moved = getattr(self.ops, "weights_moved", None)
            if moved is not None:
                moved(self)
        # a fused decode step runs the paged attention kernel inside it, so it stands in for cpu_paged only
        fused = getattr(self.ops, "decode_attention", None) if attn_fn is cpu_paged_attention else None
        for layer in self.layers:
            layer.fused_decode = fused
        self.fused_decode_layers = None
        self.decode_weights = None
        if self.shard.parallel:  # the fused kernels run a layer's halves without the all-reduces between them
            fused = None
            for layer in self.layers:
                layer.fused_decode = None
        whole = getattr(self.ops, "decode_layers", None) if fused is not None else None
        if whole is not None and self._uniform_layers(dispatch_fn):
            self.fused_decode_layers = whole
            self.decode_weights = self._decode_weight_lists()

    def _uniform_layers(self, dispatch_fn: Callable) -> bool:
        """Whether one call can run every layer as the per-layer path would: all dense, or all MoE under the
        ``fused`` dispatch without shared experts."""
        moe = [layer.is_moe for layer in self.layers]
        if not any(moe):
            return True
        if any(layer.mlp.offload is not None for layer in self.layers if layer.is_moe):
            return False  # offloaded experts live in per-layer device slots
        return all(moe) and dispatch_fn is fused_dispatch and all(layer.mlp.shared_expert is None for layer in self.layers)

    def _decode_weight_lists(self) -> dict:
        layers, cfg = self.layers, self.cfg
        attn0 = layers[0].self_attn
        moe = layers[0].is_moe
        return {
            "in_norm": [layer.input_layernorm.weight for layer in layers],
            "qkv_w": [layer.self_attn.qkv_proj for layer in layers],
            "qkv_b": [layer.self_attn.qkv_bias for layer in layers] if attn0.qkv_bias is not None else [],
            "q_norm": [layer.self_attn.q_norm.weight for layer in layers] if attn0.q_norm is not None else [],
            "k_norm": [layer.self_attn.k_norm.weight for layer in layers] if attn0.k_norm is not None else [],
            "o_w": [layer.self_attn.o_proj for layer in layers],
            "o_b": [layer.self_attn.o_bias for layer in layers] if attn0.o_bias is not None else [],
            "post_norm": [layer.post_attention_layernorm.weight for layer in layers],
            "mlp_a": [layer.mlp.w13 if moe else layer.mlp.gate_up_proj for layer in layers],
            "mlp_b": [layer.mlp.w2 if moe else layer.mlp.down_proj for layer in layers],
            "router": [layer.mlp.gate for layer in layers] if moe else [],
            "windows": [layer.self_attn.sliding_window or 0 for layer in layers],
            "eps": cfg.rms_norm_eps,
            "qk_eps": attn0.q_norm.eps if attn0.q_norm is not None else 0.0,
            "scale": attn0.scale,
            "num_heads": attn0.num_heads,
            "num_kv_heads": attn0.num_kv_heads,
            "head_dim": attn0.head_dim,
            "moe_k": layers[0].mlp.top_k if moe else 0,
            "moe_normalize": bool(layers[0].mlp.normalize) if moe else False,
            "k_caches": None,
            "v_caches": None,
        }

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        plan: RoutePlan | tuple[RoutePlan | None, ...] | None = None,
        rope_seq_lens: torch.Tensor | None = None,
        logits: bool = False,
    ) -> torch.Tensor:
        """Returns the last hidden states [T, H] (before the final norm; see :meth:`compute_logits`), or with
        ``logits`` the float32 logits of every row [T, V] (``compute_logits`` of them: a decode step whose rows
        all sample, which the fused decode path then runs through the LM head without leaving its kernels)."""
        if self.mirror is not None:  # the workers run this call too; a failure here leaves them mid-call
            self.mirror.forward(input_ids, meta, kv_caches, plan, rope_seq_lens, logits)
            with self.mirror.call():
                return self._forward(input_ids, meta, kv_caches, plan, rope_seq_lens, logits)
        return self._forward(input_ids, meta, kv_caches, plan, rope_seq_lens, logits)

    def _forward(self, input_ids, meta, kv_caches, plan, rope_seq_lens, logits) -> torch.Tensor:
        h = self.embed(input_ids)
        cos, sin = self.rotary.cos_sin(meta.positions, rope_seq_lens if self.dynamic_rope else None, dtype=h.dtype)
        layered = isinstance(plan, tuple)  # one plan per layer (per-layer TierSets in the batch)
        if self.fused_decode_layers is not None and meta.decode_only:
            out = self.fused_decode_layers(self, h, cos, sin, meta, kv_caches, plan, logits=logits)
            if out is not None:
                return out
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            h = layer(h, cos, sin, meta, k_cache, v_cache, plan[i] if layered else plan)
        return self._logits(h) if logits else h

    def decode_tokens(self, input_ids: torch.Tensor, kv_slots: torch.Tensor, ctx_lens: torch.Tensor,
                      kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                      plan: RoutePlan | tuple[RoutePlan | None, ...] | None = None, logits: bool = False,
                      argmax: bool = False) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A decode-only step from its tokens, where the layer ops run one whole (``decode_tokens``): sequence b
        feeds ``input_ids[b]`` at position ``ctx_lens[b] - 1``, writes its K/V to ``kv_slots[b, ctx_lens[b] - 1]``
        and attends ``kv_slots[b, :ctx_lens[b]]``. Returns what :meth:`forward` returns for that step, with
        ``argmax`` (and ``logits``) paired with each row's first maximum of the logits when the ops computed it
        (else None); None where the ops do not take the step (then build its metadata and call forward). Call
        it inside ``torch.inference_mode``."""
        if self.fused_decode_layers is None:
            return None
        take = getattr(self.ops, "decode_tokens", None)
        tables = self.rotary.tables(self.embed_tokens.dtype) if take is not None else None
        if tables is None:
            return None
        return take(self, input_ids, self.embed_tokens, tables, kv_slots, ctx_lens, kv_caches, plan, logits, argmax)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings; split by vocabulary under tensor parallelism (each rank looks up the ids in its
        rows, zeros elsewhere, and one all-reduce adds them up: exact)."""
        if self.shard.tensor == 1:
            return F.embedding(input_ids, self.embed_tokens)
        first, last = self.vocab_range
        own = (input_ids >= first) & (input_ids < last)
        h = F.embedding(torch.where(own, input_ids - first, 0), self.embed_tokens)
        return self.comm.all_reduce(h * own[:, None].to(h.dtype))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head on the rows that need a next token; float32 logits [R, V] (under tensor
        parallelism every rank computes its vocabulary slice and an all-gather joins them)."""
        if self.mirror is not None and self.mirror.compute_logits(hidden):
            with self.mirror.call():
                return self._logits(hidden)
        return self._logits(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = self.ops.linear(self.norm(hidden), w).float()
        if self.shard.tensor == 1:
            return logits
        return self.comm.gather_vocab(logits, self.shard.vocab_chunk(self.cfg.vocab_size), self.cfg.vocab_size)
