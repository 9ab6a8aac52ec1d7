"""Request: one generation in flight, and the outputs the engine reports for it."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from litellm_pipeline.sampling import SamplingParams

_ids = itertools.count()


class RequestStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class TierSet:
    """The compute a request may spend in MoE layers: how many experts per token, and which experts."""

    name: str
    experts_per_token: int
    cost: float = 1.0
    allowed_experts: tuple[int, ...] | None = None


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    tier: str | None = None  # requested tier name (None: the select_tier stage decides)
    salt: str = ""  # isolates cached KV between tenants
    priority: int = 0  # lower value = served first (priority scheduler)
    session_id: str | None = None  # keep this conversation's KV pinned after the request ends
    arrival: float = field(default_factory=time.monotonic)
    # filled by the pipeline
    tierset: TierSet | None = None
    generator: torch.Generator | None = None
    detokenizer: object | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    num_computed: int = 0  # tokens of prompt+output whose KV is in the cache
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks
    num_registered: int = 0  # leading blocks already findable in the prefix cache
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache
    swapped_slots: list[int] | None = None  # warm-pool slots while preempted by swap
    num_preemptions: int = 0
    text: str = ""
    emitted_chars: int = 0
    emitted_tokens: int = 0
    finish_reason: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without building the concatenation."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class RequestOutput:
    """What one request produced: the delta of the last step (streaming) and everything so far."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None
    tier: str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
