"""Runtime: the plain objects a built pipeline shares (model, cache, scheduler, tokenizer, tiers, tenant quotas)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from litellm_pipeline.budget.selector import BudgetPolicy
from litellm_pipeline.constraints import ConstraintCompiler
from litellm_pipeline.engine.block_pool import BlockPool
from litellm_pipeline.engine.tenants import TenantLedger
from litellm_pipeline.model.config import ModelConfig
from litellm_pipeline.model.decoder import CausalLM
from litellm_pipeline.telemetry import EventBus
from litellm_pipeline.text.tokenizer import Tokenizer
from litellm_pipeline.tiers import TierSet
from litellm_pipeline.tiers.cost_model import CostModel


@dataclass
class Runtime:
    model: CausalLM
    model_cfg: ModelConfig
    tokenizer: Tokenizer
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    pool: BlockPool
    kv: object  # KVCacheManager
    scheduler: object
    block_size: int
    max_model_len: int
    tiers: dict[str, TierSet]
    device: torch.device
    eos_token_ids: frozenset = field(default_factory=frozenset)
    seed: int = 0
    bus: EventBus = field(default_factory=EventBus)
    cost_model: CostModel | None = None
    budget: BudgetPolicy = field(default_factory=BudgetPolicy)
    deterministic: bool = False  # engine.deterministic: batch-invariant steps
    tenants: TenantLedger | None = None  # the quotas of conf/tenants (None: no tenant has one)
    cuda_graphs: bool = False  # device.cuda_graphs on a CUDA device: the decode stage replays captured graphs
    huge_pages: bool = False  # device.huge_pages on a CPU device: the decode stage packs the weights into huge pages
    constraints: ConstraintCompiler | None = None  # structured output (None: requests with a constraint are refused)
    speculator: object | None = None  # speculative decoding (speculative.Speculator; None: off)
    parallel: object | None = None  # tensor / expert parallel: this rank's parallel.workers.Member (None: one process)


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device, pin: bool = False,
    kv_heads: int | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One flat K and one flat V tensor per layer: ``[num_blocks * block_size, kv_heads, head_dim]``.

    ``pin``: page-locked host memory (the warm tier of a CUDA engine), so copies to the device are fast.
    ``kv_heads``: the heads this rank holds under tensor parallelism (default: the model's).
    """
    shape = (num_blocks * block_size, kv_heads or cfg.num_kv_heads, cfg.head_dim)

    def alloc() -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)

    return [(alloc(), alloc()) for _ in range(cfg.num_layers)]


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_heads: int | None = None) -> int:
    heads = kv_heads or cfg.num_kv_heads
    return 2 * cfg.num_layers * block_size * heads * cfg.head_dim * torch.finfo(dtype).bits // 8
