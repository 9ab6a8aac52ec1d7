"""A training-mode MoE transformer in plain torch, for the demo model (the runtime's model in
litellm_pipeline/model is inference-only), in one of two Hugging Face layouts (``NetworkConfig.family``):

* ``mixtral`` — ``MixtralForCausalLM`` (``model.layers.N.block_sparse_moe.experts.E.w1.weight`` ...): RMSNorm,
  rotate-half RoPE with ``rope_theta``, GQA, softmax router over all experts, top-k renormalised, SwiGLU experts.
* ``qwen3_moe`` — ``Qwen3MoeForCausalLM`` (``model.layers.N.mlp.experts.E.gate_proj.weight`` ...): the same plus
  an RMSNorm of every query and key head before RoPE, and the top-k weights renormalised only with
  ``norm_topk_prob`` (without it each expert adds its own softmax share, so fewer experts add less).

Parameter names and shapes are exactly the checkpoint's, so ``state_dict()`` is written as is and both this
runtime and `transformers` load it.

Routing takes a per-token expert count ``k`` (the same in every layer, or one per layer) so one network can be
trained at several compute tiers (k=1 is the runtime's ``fast`` tier, the native top-k ``balanced``, 2x ``deep``,
all experts ``max``) and at per-layer mixtures of them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

FAMILIES = ("mixtral", "qwen3_moe")


@dataclass(frozen=True)
class NetworkConfig:
    vocab_size: int
    hidden_size: int = 128
    intermediate_size: int = 128  # per expert
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    max_position_embeddings: int = 64
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    family: str = "mixtral"  # or "qwen3_moe"
    norm_topk_prob: bool = True  # qwen3_moe: renormalise the top-k weights (mixtral always does)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family: {self.family!r} is not one of {', '.join(FAMILIES)}")
        if self.family == "mixtral" and not self.norm_topk_prob:
            raise ValueError("norm_topk_prob: a Mixtral router always renormalises its top-k (use family qwen3_moe)")

    @classmethod
    def from_hf(cls, cfg: dict) -> "NetworkConfig":
        """The network of a checkpoint's config.json written by :meth:`hf_config` (either family)."""
        family = cfg.get("model_type", "mixtral")
        vals = dict(cfg, family=family)
        if family == "qwen3_moe":
            vals.update(num_local_experts=cfg["num_experts"], intermediate_size=cfg["moe_intermediate_size"],
                        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))
        keys = cls.__dataclass_fields__
        return cls(**{k: v for k, v in vals.items() if k in keys})

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def hf_config(self, *, bos_token_id: int, eos_token_id: int, pad_token_id: int, torch_dtype: str) -> dict:
        """config.json of the equivalent MixtralForCausalLM or Qwen3MoeForCausalLM."""
        fields = {k: v for k, v in asdict(self).items() if k not in ("family", "norm_topk_prob")}
        if self.family == "qwen3_moe":
            fields.pop("num_local_experts")
            family = {
                "architectures": ["Qwen3MoeForCausalLM"],
                "model_type": "qwen3_moe",
                "num_experts": self.num_local_experts,
                "moe_intermediate_size": self.intermediate_size,
                "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "use_sliding_window": False,
                "attention_bias": False,
                "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            }
        else:
            family = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
        return {
            **family,
            **fields,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "sliding_window": None,
            "tie_word_embeddings": False,
            "attention_dropout": 0.0,
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.0,
            "use_cache": True,
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id,
            "torch_dtype": torch_dtype,
        }


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(cfg: NetworkConfig, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.outer(torch.arange(length).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: NetworkConfig):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(h, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, h, bias=False)
        self.qk_norm = cfg.family == "qwen3_moe"
        if self.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        # right padding only: real tokens never attend to pads under the causal mask
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.hd))


class Expert(nn.Module):
    # (gate, down, up) projection names per family
    NAMES = {"mixtral": ("w1", "w2", "w3"), "qwen3_moe": ("gate_proj", "down_proj", "up_proj")}

    def __init__(self, cfg: NetworkConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self._names = self.NAMES[cfg.family]
        for name, (a, b) in zip(self._names, ((h, i), (i, h), (h, i))):
            self.add_module(name, nn.Linear(a, b, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, down, up = (getattr(self, n) for n in self._names)
        return down(F.silu(gate(x)) * up(x))


class SparseMoE(nn.Module):
    def __init__(self, cfg: NetworkConfig):
        super().__init__()
        self.num_experts, self.native_k = cfg.num_local_experts, cfg.num_experts_per_tok
        self.normalize = cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_local_experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg) for _ in range(cfg.num_local_experts))

    def forward(self, x: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` [T, H], ``k`` [T] experts per token -> (output [T, H], router losses [3]: load balance, split,
        spill)."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        # rank of each expert per token; stable, so ties go to the lower id as in the runtime
        order = torch.sort(probs, dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(self.num_experts).expand_as(order))
        chosen = rank < k[:, None]
        weights = probs * chosen
        shares = weights / weights.sum(-1, keepdim=True)
        weights = (shares if self.normalize else weights).to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx = chosen[:, e].nonzero().squeeze(1)
            if idx.numel():
                # index_put(accumulate) rather than index_add_: on CPU with several threads index_add_ costs
                # ~1 ms per call when the cores are busy (thread wake-ups); the rows are distinct either way
                out = out.index_put((idx,), expert(x[idx]) * weights[idx, e, None], accumulate=True)
        # Switch/Mixtral balance loss on the native top-k: E * sum_e (share of tokens sent to e) * (mean prob of e)
        native = (rank < self.native_k).float()
        balance = self.num_experts * (native.mean(0) / self.native_k * probs.mean(0)).sum()
        # split: how far the largest renormalised weight of a token routed to several experts stands above an
        # even share (0 when its experts weigh the same); pushing it down makes the experts split the work
        multi = k > 1
        if bool(multi.any()):
            top = shares[multi].max(-1).values
            split = (top - 1.0 / k[multi].float()).mean()
        else:
            split = balance.new_zeros(())
        # spill: the softmax mass outside the native top-k (0 when those experts hold the whole mixture)
        spill = 1.0 - torch.topk(probs, self.native_k, dim=-1).values.sum(-1).mean()
        return out, torch.stack([balance, split, spill])


class DecoderLayer(nn.Module):
    def __init__(self, cfg: NetworkConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self._moe = "block_sparse_moe" if cfg.family == "mixtral" else "mlp"
        self.add_module(self._moe, SparseMoE(cfg))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, valid, k):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        # experts only see real tokens: pads are neither computed nor counted in the balance loss
        moe_out, aux = getattr(self, self._moe)(h[valid], k[valid])
        return x.index_put((valid,), x[valid] + moe_out), aux


class MoeBody(nn.Module):
    def __init__(self, cfg: NetworkConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MoeForTraining(nn.Module):
    """``forward(ids, valid, k) -> (logits [B, T, V], router losses [3] averaged over layers: balance, split,
    spill)``."""

    def __init__(self, cfg: NetworkConfig):
        super().__init__()
        self.cfg = cfg
        self.model = MoeBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg, cfg.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init)

    def _init(self, m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=self.cfg.initializer_range)

    def forward(self, ids: torch.Tensor, valid: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids``/``valid``: [B, T] token ids, real-token mask; ``k``: experts per token, [B, T] for every layer
        or [num_layers, B, T] per layer."""
        t = ids.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.model.embed_tokens(ids)
        aux = x.new_zeros(3, dtype=torch.float32)
        for i, layer in enumerate(self.model.layers):
            x, a = layer(x, cos, sin, valid, k[i] if k.dim() == 3 else k)
            aux = aux + a
        return self.lm_head(self.model.norm(x)), aux / len(self.model.layers)
