"""Request: one generation in flight, and the outputs the engine reports for it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple

import torch

from litellm_pipeline.budget import BudgetSpec
from litellm_pipeline.budget.spec import CostRecord
from litellm_pipeline.errors import InternalError
from litellm_pipeline.request_spec import RequestSpec
from litellm_pipeline.sampling import SamplingParams
from litellm_pipeline.tiers import TierSet

if TYPE_CHECKING:
    from litellm_pipeline.budget.selector import Selection
    from litellm_pipeline.registry.interfaces import Matcher
    from litellm_pipeline.text.detokenizer import IncrementalDetokenizer


class RequestStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Engine-side state of one request. Built from a :class:`RequestSpec` (its fields are copied as plain
    attributes: they are read on every step). Identity, not value, is equality."""

    spec: RequestSpec
    prompt_ids: list[int]
    request_id: str | None = None  # the engine names a request only once it is admitted
    arrival: float = field(default_factory=time.monotonic)
    # from the spec
    params: SamplingParams = field(init=False)
    tier: str | None = field(init=False)  # requested tier name (None: the select_tier stage decides)
    budget: BudgetSpec | None = field(init=False)
    tenant: str = field(init=False)
    priority: int = field(init=False)  # lower value = served first (priority scheduler)
    session_id: str | None = field(init=False)  # keep this conversation's KV pinned after the request ends
    spec_tokens: int | None = field(init=False)  # most draft tokens per step (None: the engine's; 0: none)
    # decided by the request-level stages
    tierset: TierSet | None = None
    selection: Selection | None = None  # the select_tier decision (prediction, mode) behind ``tierset``
    budget_max_tokens: int | None = None  # the most output tokens its monetary budget pays for
    cost: CostRecord | None = None  # set by the engine when it finishes
    # what request stages took for it (e.g. a tenant's quota, tenants.QuotaHold): each has cancel() and
    # settle(req); the engine cancels them if a later request stage rejects the request and settles them once
    # when it finishes or is aborted
    holds: list = field(default_factory=list)
    # set by the engine on admission
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    matcher: Matcher | None = None  # its constraint's state (structured output); advanced as tokens are kept
    # speculative decoding: tokens proposed after its known ones, verified by this step's forward (the engine's
    # Speculator sets them before scheduling and clears them in the postprocess), and its totals
    draft: list[int] = field(default_factory=list)
    spec_state: object | None = None  # the Speculator's per-request state (speculative/speculator.py)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    spec_monetary: float = 0.0  # list price of its speculative work not in its output (CostRecord)
    # engine bookkeeping (the engine's postprocess and the scheduler own these)
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    text_offsets: list[int] | None = None  # where each output token's text starts in ``text`` (with logprobs)
    # where each output token's text ends (with logprobs): None while the detokenizer holds it back (part of a
    # character), then the start of the token after it
    text_ends: list[int | None] | None = None
    num_computed: int = 0  # tokens of prompt+output whose KV is in the cache
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks
    num_registered: int = 0  # leading blocks already findable in the prefix cache
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache
    prefix_reported: bool = False  # its prefix lookup was published (telemetry)
    swapped_slots: list[int] | None = None  # warm-pool slots while preempted by swap
    num_preemptions: int = 0
    finish_reason: str | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None  # when its latest token was made (inter-token latency)
    finish_time: float | None = None
    # output text (the emit stage owns these)
    text: str = ""
    emitted_chars: int = 0

    def __post_init__(self) -> None:
        s = self.spec
        self.params, self.tier, self.budget = s.params, s.tier, s.budget
        self.tenant = s.tenant
        self.priority, self.session_id = s.priority, s.session_id
        self.spec_tokens = s.num_speculative_tokens

    @property
    def salt(self) -> str:
        """What its cached KV blocks are keyed by besides their tokens: the tenant (tenants never share a block)
        and, in a MoE model, the TierSet's routing limits (experts per layer, allowed experts), which change
        every layer's hidden states and so the K/V of every layer after the first MoE block. A dense model's
        TierSets route nothing, so its tiers share blocks."""
        ts = self.tierset
        if ts is None or not ts.experts_per_layer:
            return self.tenant
        return f"{self.tenant}\x00{ts.experts_per_layer}\x00{ts.allowed_experts}"

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens a step may compute up to: the known ones and the draft under verification."""
        return len(self.prompt_ids) + len(self.output_ids) + len(self.draft)

    def token_at(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output (+ draft) without building the concatenation."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        o = p + len(self.output_ids)
        if end > o:  # reaches into the draft
            head = self.token_at(start, o) if start < o else []
            return head + self.draft[max(start, o) - o : end - o]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def stop_reason(self, token: int, eos_token_ids: frozenset, max_model_len: int, ahead: int = 0) -> str | None:
        """Why appending ``token`` (not yet appended, after ``ahead`` more tokens of this step that are not
        appended either) ends the request by token rules, or None.

        ``"stop"``: a stop token id, or an end-of-sequence token unless ``ignore_eos``; ``"length"``: it is
        the ``max_tokens``-th output token or fills the model's context; ``"budget"``: it is the last output
        token the monetary budget pays for. Stop *strings* are the emit stage's.
        """
        p = self.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids):
            return "stop"
        n = len(self.output_ids) + ahead + 1
        if n >= p.max_tokens or self.num_tokens + ahead + 1 >= max_model_len:
            return "length"
        if self.budget_max_tokens is not None and n >= self.budget_max_tokens:
            return "budget"
        return None

    def cost_record(self) -> CostRecord | None:
        """The finished request's plan and what it actually cost (None if no select_tier stage decided)."""
        sel = self.selection
        if sel is None:
            return None
        ts, pred = sel.tierset, sel.predicted
        end = self.finish_time if self.finish_time is not None else time.monotonic()
        n = len(self.output_ids)
        latency = (end - self.arrival) * 1e3
        per_token = (end - self.first_token_time) * 1e3 / (n - 1) if self.first_token_time and n > 1 else None
        money = ts.price.of(len(self.prompt_ids), n)
        met = self.budget.kept(latency, per_token, money) if self.budget is not None else {}
        return CostRecord(
            ts.name, ts.experts_per_layer, sel.mode, sel.cost_model, sel.feasible, pred.latency_ms,
            pred.per_token_ms, pred.monetary, pred.quality, latency, per_token, money, self.budget, met,
            self.num_draft_tokens, self.num_accepted_tokens, self.spec_monetary,
        )


class Sample(NamedTuple):
    """One sampled token (the sample stage's output, per request that reached the end of its tokens)."""

    request: Request
    token_id: int
    logprobs: dict[int, float] | None


class Emission(NamedTuple):
    """What the emit stage makes of one sample: the text to stream now, a finish it asks for, and where the
    token's text starts in the request's text (None: the engine takes the text's end)."""

    request: Request
    delta_text: str
    finish_reason: str | None  # "stop" / "length" / None; the engine enforces token limits regardless
    text_offset: int | None = None
    held: bool = False  # the detokenizer holds the token's text back (part of a character): its end is not known


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
    text_offsets: list[int] | None = None  # with logprobs: where each token's text starts in ``text``
    # with logprobs: where each token's text ends (None: not known yet); ``text[text_offsets[i]:text_ends[i]]``
    # is the i-th token's part of the text, and the parts join to the text
    text_ends: list[int | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # set when the request failed (finish_reason "error")
    error_id: str | None = None  # the id of that failure in the log
    cost: CostRecord | None = None  # set once finished: the TierSet it ran at, predicted and actual cost
    num_draft_tokens: int = 0  # speculative decoding: tokens proposed for it so far
    num_accepted_tokens: int = 0  # of those, the ones verification kept

    def raise_error(self) -> None:
        """Raise the request's failure as an :class:`InternalError` (no-op if it did not fail)."""
        if self.error is not None:
            raise InternalError(self.error, error_id=self.error_id)


def request_output(req: Request, delta_text: str = "", delta_ids: list[int] | None = None) -> RequestOutput:
    return RequestOutput(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_ids,
        text=req.text[: req.emitted_chars] if not req.finished else req.text,
        token_ids=list(req.output_ids),
        delta_text=delta_text,
        delta_token_ids=delta_ids or [],
        finished=req.finished,
        finish_reason=req.finish_reason,
        logprobs=req.logprobs,
        text_offsets=req.text_offsets,
        text_ends=req.text_ends,
        tier=req.tierset.name if req.tierset else None,
        num_cached_tokens=req.num_cached_tokens,
        cost=(req.cost or req.cost_record()) if req.finished else None,
        num_draft_tokens=req.num_draft_tokens,
        num_accepted_tokens=req.num_accepted_tokens,
    )
