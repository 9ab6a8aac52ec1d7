"""Bench models: random-weight checkpoints of a given shape, and what one token costs in each.

A model is a preset name (:data:`PRESETS`) or a dict of ``config.json`` keys with a ``name`` and an
optional ``base`` preset it overrides (``{name: wide, base: llama125m, hidden_size: 1024}``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from litellm_pipeline.bench.checkpoints import cache_root, write_random_checkpoint
from litellm_pipeline.errors import ConfigError

_COMMON = {
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "torch_dtype": "float32",
}
_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **_COMMON}
_MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "sliding_window": None, **_COMMON}

PRESETS: dict[str, dict[str, Any]] = {
    # GPT-2-small-like widths in the Llama layout
    "llama125m": {**_LLAMA, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
                  "num_attention_heads": 12, "num_key_value_heads": 12, "head_dim": 64},
    # 8 experts, top-2, GQA 8/4
    "mixtral175m": {**_MIXTRAL, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
                    "num_local_experts": 8, "num_experts_per_tok": 2},
    # for tests and quick runs
    "tiny_llama": {**_LLAMA, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
    "tiny_mixtral": {**_MIXTRAL, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                     "num_local_experts": 4, "num_experts_per_tok": 2},
}


def resolve_model(spec: str | dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(name, config.json dict)`` of a preset name or a dict spec."""
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ConfigError(f"bench.models: unknown model {spec!r}; presets: {', '.join(PRESETS)} (or a dict)")
        return spec, dict(PRESETS[spec])
    spec = dict(spec)
    base = spec.pop("base", None)
    name = spec.pop("name", None)
    if base is not None and base not in PRESETS:
        raise ConfigError(f"bench.models: unknown base {base!r}; presets: {', '.join(PRESETS)}")
    cfg = {**(PRESETS[base] if base else _LLAMA), **spec}
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads") if k not in cfg]
    if missing:
        raise ConfigError(f"bench.models: model {name or spec} lacks {missing} (give them or a 'base' preset)")
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    return name or f"custom-{_digest(cfg)}", cfg


def _digest(cfg: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:10]


def ensure_checkpoint(name: str, cfg: dict[str, Any], seed: int) -> Path:
    """The checkpoint directory for this shape and seed, written once under the cache root."""
    return write_random_checkpoint(cache_root() / f"bench-{name}-{_digest(cfg)}-seed{seed}", cfg, seed)


def param_counts(cfg: dict[str, Any]) -> dict[str, int]:
    """Parameter counts of a Llama / Mixtral ``config.json``.

    ``body_active``: the weights one token runs through in the decoder layers (for MoE only its top-k
    experts, plus attention, router and norms); ``head``: the output projection (the embedding when tied),
    read once per sampled token. The embedding lookup reads one row, so it counts as nothing per token.
    ``proj_active`` / ``proj_rows_active``: the projection weights (attention, MLP / active experts) among
    ``body_active`` and their output rows (what int8 weight-only quantizes, one scale per row).
    """
    h, i, v, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    nh, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or h // nh
    experts, top_k = cfg.get("num_local_experts", 0), cfg.get("num_experts_per_tok", 0)
    attn = 2 * h * nh * hd + 2 * h * nkv * hd
    mlp = 3 * h * i
    norms = 2 * h
    attn_rows = (nh + 2 * nkv) * hd + h
    mlp_rows = 2 * i + h
    proj_active = layers * (attn + max(top_k, 1) * mlp)
    proj_rows_active = layers * (attn_rows + max(top_k, 1) * mlp_rows)
    if experts:
        layer_total = attn + experts * mlp + experts * h + norms
        layer_active = attn + top_k * mlp + experts * h + norms
    else:
        layer_total = layer_active = attn + mlp + norms
    embedding = v * h
    tied = bool(cfg.get("tie_word_embeddings", False))
    total = embedding + (0 if tied else v * h) + layers * layer_total + h
    body_active = layers * layer_active + h
    return {
        "total": total,
        "embedding": embedding,
        "head": v * h,
        "head_rows": v,
        "body_active": body_active,
        "active_per_token": body_active + v * h,
        "proj_active": proj_active,
        "proj_rows_active": proj_rows_active,
        "experts": experts,
        "experts_per_token": top_k,
    }
