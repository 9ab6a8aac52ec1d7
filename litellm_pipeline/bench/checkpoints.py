"""Random-weight bench checkpoints built from a seed.

Each is written once as an ordinary Hugging Face checkpoint directory (config.json, model.safetensors,
tokenizer.json, ...) in a cache folder and then loaded through the same loader as any user checkpoint.
Same seed, same bytes, every run. (The embedded default model is the trained one in
``litellm_pipeline/demo``.)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from litellm_pipeline.text.tokenizer import build_byte_tokenizer


def cache_root() -> Path:
    env = os.environ.get("LITELLM_PIPELINE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "litellm_pipeline"


def random_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random tensors under the Hugging Face names of a Llama / Mistral / Mixtral ``config.json``."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:  # scaled so activations neither vanish nor explode
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // nh
    experts = cfg.get("num_local_experts", 0)
    out = {"model.embed_tokens.weight": torch.randn(v, h, generator=g), "model.norm.weight": torch.ones(h)}
    for li in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{li}."
        out[p + "input_layernorm.weight"] = torch.ones(h)
        out[p + "post_attention_layernorm.weight"] = torch.ones(h)
        out[p + "self_attn.q_proj.weight"] = w(nh * hd, h)
        out[p + "self_attn.k_proj.weight"] = w(nkv * hd, h)
        out[p + "self_attn.v_proj.weight"] = w(nkv * hd, h)
        out[p + "self_attn.o_proj.weight"] = w(h, nh * hd)
        if experts:
            out[p + "block_sparse_moe.gate.weight"] = w(experts, h)
            for x in range(experts):
                q = f"{p}block_sparse_moe.experts.{x}."
                out[q + "w1.weight"] = w(i, h)
                out[q + "w3.weight"] = w(i, h)
                out[q + "w2.weight"] = w(h, i)
        else:
            out[p + "mlp.gate_proj.weight"] = w(i, h)
            out[p + "mlp.up_proj.weight"] = w(i, h)
            out[p + "mlp.down_proj.weight"] = w(h, i)
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = w(v, h) * 4.0  # peaked next-token distributions, so greedy text is stable
    return out


def write_random_checkpoint(target: Path, cfg: dict, seed: int, tokenizer=None) -> Path:
    """Write ``cfg`` with seeded random weights as a Hugging Face checkpoint directory (atomically)."""
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        gen = {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id")}
        (tmp / "generation_config.json").write_text(json.dumps(gen))
        (tokenizer or build_byte_tokenizer()).save(tmp)
        save_file(random_weights(cfg, seed), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        try:
            tmp.rename(target)  # atomic: concurrent first runs never see a half-written directory
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
