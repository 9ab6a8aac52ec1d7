"""prefill: lay out this step's prompt chunks (positions, paged-KV slots, per-sequence attention spans)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from litellm_pipeline.engine.request import Request
from litellm_pipeline.registry import register
from litellm_pipeline.registry.types import SeqAttention
from litellm_pipeline.stages.base import Stage, StepContext


@dataclass
class PrefillBatch:
    requests: list[tuple[Request, int]]
    token_ids: list[int]
    positions: list[torch.Tensor]
    slots: list[torch.Tensor]
    seqs: list[SeqAttention]
    rope_seq_lens: list[int]  # per token: the sequence length its forward sees (dynamic RoPE)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@register("stage", "prefill")
class Prefill(Stage):
    """Lay out the step's prompt chunks: positions, paged-KV slots and per-sequence attention spans.

    Chunks (entries computing more than one token) come first in the step's row order; their KV slots
    come from the step's :class:`~litellm_pipeline.engine.kv_cache_manager.KVLayout`."""

    inputs = ("schedule", "kv_layout")
    outputs = ("prefill_batch",)

    def __call__(self, ctx: StepContext) -> None:
        reqs, ids, pos, slots, seqs, lens = [], [], [], [], [], []
        row = 0
        for (req, n), kv in zip(ctx.schedule, ctx.kv_layout.chunk_slots):
            start, end = req.num_computed, req.num_computed + n
            reqs.append((req, n))
            ids.extend(req.token_at(start, end))
            pos.append(torch.arange(start, end))
            slots.append(kv[start:end])
            seqs.append(SeqAttention(q_start=row, q_len=n, ctx_len=end, kv_slots=kv))
            lens.extend([end] * n)
            row += n
        ctx.prefill_batch = PrefillBatch(reqs, ids, pos, slots, seqs, lens)
