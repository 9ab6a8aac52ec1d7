"""ModelConfig: the plain, frozen description of a decoder that the model core needs, parsed from config.json.

One decoder implementation covers all supported families; this module turns each family's config.json
dialect (transformers 4 and 5 spellings alike) into the same set of explicit fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from litellm_pipeline.model.rope import rope_parameters_from_config

# architecture name in config.json -> family
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file or the unsupported feature."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: dict
    tie_word_embeddings: bool
    attention_bias: bool  # a bias on the q, k and v projections
    qk_norm: bool
    sliding_windows: tuple  # per layer: window size or None
    hidden_act: str = "silu"
    o_bias: bool = False  # a bias on the attention output projection (o_proj)
    # Mixture of Experts (num_experts == 0: dense)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple = ()  # per layer: True where the MLP is a sparse MoE block
    bos_token_id: int | None = None
    eos_token_ids: tuple = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"{source}: architecture {arch!r} is not supported; supported architectures: "
                + ", ".join(SUPPORTED_ARCHITECTURES)
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        try:
            mc = cls._parse(cfg, arch, family)
        except KeyError as exc:
            raise CheckpointError(f"{source}: required key {exc.args[0]!r} is missing for {arch}") from exc
        except (TypeError, ValueError, ZeroDivisionError, IndexError, AttributeError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{source}: malformed {arch} config ({type(exc).__name__}: {exc})") from exc
        mc._check_sizes(source)
        return mc

    def _check_sizes(self, source: str) -> None:
        """Shapes a model can be built with: positive sizes, query heads a multiple of the KV heads, top-k
        within the experts."""
        positive = {
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "max_position_embeddings": self.max_position_embeddings,
        }
        bad = [f"{k} = {v}" for k, v in positive.items() if v < 1]
        if bad:
            raise CheckpointError(f"{source}: {', '.join(bad)} (must be >= 1)")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"{source}: num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads "
                f"{self.num_kv_heads}"
            )
        if self.is_moe and not 1 <= self.experts_per_token <= self.num_experts:
            raise CheckpointError(
                f"{source}: num_experts_per_tok {self.experts_per_token} must be in 1..{self.num_experts}"
            )

    @classmethod
    def _parse(cls, cfg: dict, arch: str, family: str) -> "ModelConfig":
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        layers = int(cfg["num_hidden_layers"])
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise CheckpointError(f"config.json: hidden_act {act!r} is not supported (supported: silu)")
        rope = rope_parameters_from_config(cfg)

        qkv_bias, o_bias = _attention_biases(cfg, family)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        moe: dict[str, Any] = {}
        if family == "mixtral":
            n = int(cfg["num_local_experts"])
            moe = dict(
                num_experts=n,
                experts_per_token=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["intermediate_size"]),
                norm_topk_prob=True,
                moe_layers=(True,) * layers,
            )
        elif family in ("qwen2_moe", "qwen3_moe"):
            n = int(cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"])
            only = set(cfg.get("mlp_only_layers") or [])
            step = int(cfg.get("decoder_sparse_step") or 1)
            moe = dict(
                num_experts=n,
                experts_per_token=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", family == "qwen3_moe")),
                shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
                if family == "qwen2_moe"
                else 0,
                moe_layers=tuple((i not in only) and n > 0 and (i + 1) % step == 0 for i in range(layers)),
            )
        return cls(
            architecture=arch,
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
            rope=rope,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=family in ("qwen3", "qwen3_moe"),
            sliding_windows=_sliding_windows(cfg, family, layers),
            hidden_act="silu",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **moe,
        )


def _attention_biases(cfg: dict, family: str) -> tuple[bool, bool]:
    """(q/k/v bias, o_proj bias), as transformers builds each family's attention.

    Llama and Qwen3 (dense and MoE) put a bias on q, k, v and o alike when ``attention_bias`` is set; Qwen2
    always has a q/k/v bias and never an o bias; Qwen2-MoE the same, switchable by ``qkv_bias`` (transformers 5;
    always on before); Mistral and Mixtral have no attention bias whatever config.json says.
    """
    if family in ("llama", "qwen3", "qwen3_moe"):
        bias = bool(cfg.get("attention_bias", False))
        return bias, bias
    if family == "qwen2":
        return True, False
    if family == "qwen2_moe":
        return bool(cfg.get("qkv_bias", True)), False
    return False, False


def _sliding_windows(cfg: dict, family: str, layers: int) -> tuple:
    """Per-layer sliding window, following each family's rule (``layer_types`` wins when present)."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if family in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False):
        window = None
    if window is None:
        return (None,) * layers
    window = int(window)
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    if family in ("qwen2", "qwen2_moe", "qwen3"):
        first = int(cfg.get("max_window_layers") or 0)
        return tuple(window if i >= first else None for i in range(layers))
    if family == "llama":
        return (None,) * layers
    return (window,) * layers


def read_json(path: Path) -> dict:
    """Read a JSON file; a missing or corrupt file is a CheckpointError naming it."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file missing: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"corrupt JSON in {path}: {exc}") from exc
