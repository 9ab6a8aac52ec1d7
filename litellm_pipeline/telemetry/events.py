"""The events the runtime publishes. Each is a small frozen record; ``kind`` is its stable name.

Request lifecycle: arrived → (rejected | admitted) → scheduled → first_token → (finished | aborted), with
preempted any number of times in between, and one ``tokens`` event per step with the gap before every token
after a request's first. KV cache: prefix lookups (hit and miss tokens), evictions,
demotions to the warm tier and promotions from it. Engine: one ``step`` per engine step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from litellm_pipeline.registry.types import Event

__all__ = [
    "Event",
    "RequestArrived",
    "RequestRejected",
    "RequestAdmitted",
    "TierSelected",
    "RequestCosted",
    "RequestScheduled",
    "FirstToken",
    "TokensGenerated",
    "RequestFinished",
    "RequestAborted",
    "RequestPreempted",
    "PrefixLookup",
    "BlocksEvicted",
    "BlocksDemoted",
    "BlocksPromoted",
    "StepFinished",
    "SpeculationVerified",
]


@dataclass(frozen=True, slots=True)
class RequestArrived(Event):
    """A request was submitted (before any request-level stage ran)."""

    kind: ClassVar[str] = "arrived"
    request_id: str | None  # None until admitted when the caller gave no id
    tenant: str
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class RequestRejected(Event):
    """A request stage (or the engine) refused the request; nothing of it was kept."""

    kind: ClassVar[str] = "rejected"
    request_id: str | None
    tenant: str
    error: str  # the error class name, e.g. "InvalidRequestError"
    reason: str  # its message
    quota: str = ""  # the tenant quota it broke (RateLimitedError / OverloadedError), e.g. "tokens_per_minute"


@dataclass(frozen=True, slots=True)
class RequestAdmitted(Event):
    kind: ClassVar[str] = "admitted"
    request_id: str
    tenant: str
    tier: str | None
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class RequestScheduled(Event):
    """A waiting request started running (first time, or again after a preemption)."""

    kind: ClassVar[str] = "scheduled"
    request_id: str
    queue_time_s: float  # since arrival


@dataclass(frozen=True, slots=True)
class FirstToken(Event):
    kind: ClassVar[str] = "first_token"
    request_id: str
    ttft_s: float  # since arrival


@dataclass(frozen=True, slots=True)
class TokensGenerated(Event):
    """One per step, for the requests that got a token after their first: the time since each one's previous
    token (inter-token latency, one value per token; a step's requests in one event keeps it off the per-token
    path)."""

    kind: ClassVar[str] = "tokens"
    request_ids: tuple[str, ...]
    gaps_s: tuple[float, ...]
    tenants: tuple[str, ...]  # each request's tenant and tier (a request that finished in this step has no
    tiers: tuple[str | None, ...]  # other event left to name them by)


@dataclass(frozen=True, slots=True)
class TierSelected(Event):
    """The select_tier stage's decision for an admitted request (its cost record repeats it at the end)."""

    kind: ClassVar[str] = "tier_selected"
    request_id: str
    tenant: str
    tier: str
    experts_per_layer: tuple[int, ...]
    mode: str
    feasible: bool  # False: nothing fitted the budget; the cheapest TierSet runs
    predicted_latency_ms: float
    predicted_monetary: float


@dataclass(frozen=True, slots=True)
class RequestCosted(Event):
    """A finished request's predicted and actual latency (what keeps the cost model's estimates current)."""

    kind: ClassVar[str] = "costed"
    request_id: str
    tier: str
    batch: int  # the decode batch it was predicted for
    predicted_latency_ms: float
    predicted_per_token_ms: float
    latency_ms: float
    per_token_ms: float | None  # None for a one-token output
    budget_missed: tuple[str, ...] = ()  # the budget limits the actual values broke (BudgetSpec field names)
    # the (end-to-end, inter-token) factors the prediction had been corrected by from earlier measurements: the
    # cost model's own prediction is the predicted one divided by them
    correction: tuple[float, float] = (1.0, 1.0)


@dataclass(frozen=True, slots=True)
class RequestFinished(Event):
    kind: ClassVar[str] = "finished"
    request_id: str
    tenant: str
    reason: str  # "stop" | "length" | ...
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    tier: str | None
    latency_s: float  # arrival to finish


@dataclass(frozen=True, slots=True)
class RequestAborted(Event):
    """A request was cancelled. It also carries the engine's state right after the abort: no step may follow
    (an idle server whose last client went away), and gauges read from ``step`` events alone would go stale."""

    kind: ClassVar[str] = "aborted"
    request_id: str
    tenant: str
    output_tokens: int
    num_running: int = 0
    num_waiting: int = 0
    used_blocks: int = 0  # hot blocks referenced by requests (cached but unreferenced ones are not used)
    warm_used_blocks: int = 0  # warm-tier slots holding swapped-out requests
    total_blocks: int = 0  # hot blocks in the pool
    cached_blocks: int = 0  # hot blocks the prefix cache keeps that no request holds
    warm_cached_blocks: int = 0  # warm-tier slots holding cached prefixes
    # (tenant, hot blocks its running requests hold) for every tenant with a running request (a shared prefix
    # block counts for each holder, as the scheduler's KV shares count it)
    tenant_blocks: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class RequestPreempted(Event):
    kind: ClassVar[str] = "preempted"
    request_id: str
    mode: str  # "swap" | "recompute"
    tenant: str = ""


@dataclass(frozen=True, slots=True)
class PrefixLookup(Event):
    """A new request looked its prompt up in the prefix cache."""

    kind: ClassVar[str] = "prefix_lookup"
    request_id: str
    hit_tokens: int
    miss_tokens: int


@dataclass(frozen=True, slots=True)
class _BlockEvent(Event):
    num_blocks: int


class BlocksEvicted(_BlockEvent):
    """Cached hot blocks given up for new allocations (with a warm tier they are demoted first)."""

    __slots__ = ()
    kind: ClassVar[str] = "evicted"


class BlocksDemoted(_BlockEvent):
    """Evicted hot blocks whose content was kept in the warm tier."""

    __slots__ = ()
    kind: ClassVar[str] = "demoted"


class BlocksPromoted(_BlockEvent):
    """Warm blocks copied back into the hot pool by a prefix hit."""

    __slots__ = ()
    kind: ClassVar[str] = "promoted"


@dataclass(frozen=True, slots=True)
class StepFinished(Event):
    kind: ClassVar[str] = "step"
    batch_size: int  # requests in the step
    prefill_tokens: int  # prompt tokens computed (chunks and single prompt tokens)
    decode_tokens: int  # generated tokens computed
    duration_s: float
    num_running: int  # after the step
    num_waiting: int
    free_blocks: int  # hot blocks an allocation could get
    used_blocks: int = 0  # hot blocks referenced by requests (num_blocks - free_blocks)
    warm_used_blocks: int = 0  # warm-tier slots holding swapped-out requests
    total_blocks: int = 0  # hot blocks in the pool
    cached_blocks: int = 0  # hot blocks the prefix cache keeps that no request holds
    warm_cached_blocks: int = 0  # warm-tier slots holding cached prefixes
    # (tenant, hot blocks its running requests hold) for every tenant with a running request (a shared prefix
    # block counts for each holder, as the scheduler's KV shares count it)
    tenant_blocks: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class SpeculationVerified(Event):
    """A step verified speculative drafts (once per such step)."""

    kind: ClassVar[str] = "spec_decode"
    num_drafts: int  # requests that verified a draft
    num_draft_tokens: int  # tokens drafted
    num_accepted_tokens: int  # of those, kept
    accepted_per_position: tuple[int, ...]  # drafts whose token at position i (0-based) was kept
