"""What one rank holds of a model under tensor and expert parallelism (``conf/parallel``).

Tensor parallelism is Megatron's split: the q/k/v and gate/up projections are column-parallel (each rank computes
its heads / its slice of the intermediate), o and down are row-parallel (each rank's partial sum, then one
all-reduce); the embedding and LM head are split by vocabulary. Expert parallelism gives each rank whole experts
(a contiguous range); every rank routes every token the same way and runs the experts it owns on the tokens routed
to them, and one all-reduce sums the experts' outputs. With both sizes equal, the same ranks do both: attention,
dense MLPs and shared experts tensor-parallel, routed experts expert-parallel.

Supported: ``tensor=N`` for every family, ``expert=N`` for MoE families, and ``tensor=N expert=N`` together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from litellm_pipeline.errors import ConfigError
from litellm_pipeline.model.config import ModelConfig


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``world``: its tensor-parallel slice and its experts."""

    tensor: int = 1
    expert: int = 1
    rank: int = 0

    @property
    def world(self) -> int:
        return max(self.tensor, self.expert)

    @property
    def parallel(self) -> bool:
        return self.world > 1

    @property
    def tp_rank(self) -> int:
        return self.rank if self.tensor > 1 else 0

    @property
    def ep_rank(self) -> int:
        return self.rank if self.expert > 1 else 0

    # ---- attention heads
    def q_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        n = cfg.num_heads // self.tensor
        return self.tp_rank * n, (self.tp_rank + 1) * n

    def kv_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """This rank's KV heads: a slice where there are at least as many as ranks, else the one head its query
        heads share (replicated on several ranks, as vLLM does)."""
        hk, t = cfg.num_kv_heads, self.tensor
        if hk >= t:
            n = hk // t
            return self.tp_rank * n, (self.tp_rank + 1) * n
        h = self.tp_rank * hk // t
        return h, h + 1

    def local_kv_heads(self, cfg: ModelConfig) -> int:
        a, b = self.kv_heads(cfg)
        return b - a

    # ---- MLPs, experts, vocabulary
    def split(self, n: int) -> tuple[int, int]:
        """This rank's slice of a tensor-parallel dimension of size ``n`` (divisible: checked by :func:`check`)."""
        m = n // self.tensor
        return self.tp_rank * m, (self.tp_rank + 1) * m

    def experts(self, cfg: ModelConfig) -> tuple[int, int]:
        m = cfg.num_experts // self.expert
        return self.ep_rank * m, (self.ep_rank + 1) * m

    def expert_split(self, n: int) -> tuple[int, int]:
        """The slice of an expert's intermediate dimension: whole under expert parallelism, else tensor-split."""
        return (0, n) if self.expert > 1 else self.split(n)

    def vocab_chunk(self, vocab: int) -> int:
        return -(-vocab // self.tensor)

    def vocab(self, vocab: int) -> tuple[int, int]:
        """This rank's rows of the embedding / LM head: equal chunks, the last one shorter where they do not divide."""
        c = self.vocab_chunk(vocab)
        return min(vocab, self.tp_rank * c), min(vocab, (self.tp_rank + 1) * c)


def make_shard(tensor: int, expert: int, rank: int, cfg: ModelConfig) -> Shard:
    """The shard of ``rank``, after checking that ``cfg`` can be split so; a ConfigError names what cannot."""
    check(tensor, expert, cfg)
    return Shard(tensor, expert, rank)


def check(tensor: int, expert: int, cfg: ModelConfig) -> None:
    if tensor > 1 and expert > 1 and tensor != expert:
        raise ConfigError(f"parallel: tensor={tensor} with expert={expert} is not supported; use tensor=N, expert=N "
                          f"or both equal (attention tensor-parallel and experts expert-parallel on the same ranks)")
    if expert > 1:
        if not cfg.is_moe:
            raise ConfigError(f"parallel.expert={expert}: the model is dense (no experts to spread)")
        if cfg.num_experts % expert:
            raise ConfigError(f"parallel.expert={expert}: must divide the model's {cfg.num_experts} experts per layer")
    if tensor > 1:
        t = tensor
        if cfg.num_heads % t:
            raise ConfigError(f"parallel.tensor={t}: must divide the model's {cfg.num_heads} attention heads")
        hk = cfg.num_kv_heads
        if hk % t and t % hk:
            raise ConfigError(f"parallel.tensor={t}: the model's {hk} KV heads can neither be split {t} ways nor "
                              f"replicated ({t} is not a multiple of {hk})")
        dims = {"intermediate_size": cfg.intermediate_size}
        if cfg.is_moe:
            dims["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
            if expert == 1:
                dims["moe_intermediate_size"] = cfg.moe_intermediate_size
        for name, n in dims.items():
            if n % t:
                raise ConfigError(f"parallel.tensor={t}: must divide the model's {name} ({n})")


def slice_rows(t: torch.Tensor, a: int, b: int, dim: int = 0) -> torch.Tensor:
    return t.narrow(dim, a, b - a) if (a, b) != (0, t.shape[dim]) else t
