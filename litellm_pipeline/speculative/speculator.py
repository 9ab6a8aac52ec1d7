"""Speculator: per step, which running requests draft how many tokens, and what becomes of their drafts."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from litellm_pipeline.engine.request import Request
from litellm_pipeline.telemetry import EventBus, SpeculationVerified

log = logging.getLogger(__name__)

# a request whose whole draft was rejected stops drafting for this many output tokens, doubled at each further
# failure (four times as long for a costly proposer; reset by any acceptance): a workload where nothing is accepted
# pays for a draft rarely
_FIRST_PAUSE = 4
_MAX_PAUSE = 256
# the engine's recent acceptance (kept / drafted, a moving average over verified drafts, weight _RATE_WEIGHT each):
# below _LOW_RATE a new request starts with k = 1 (growing by one per whole accepted draft); for a proposer that
# drafts with a model (``costly``) it also starts drafting only after _LATE_START output tokens, but for one in
# _PROBE_EVERY that starts at once (so a workload that turns good is seen)
_RATE_WEIGHT = 0.25
_LOW_RATE = 0.2
_LATE_START = 16
_PROBE_EVERY = 8


@dataclass(frozen=True)
class SpeculativeSettings:
    """conf/speculative, as plain values: ``method`` (a ``proposer`` registry name, or ``none``), ``k`` the most
    tokens drafted per step, ``adaptive``: lower k where drafts fail (and pause drafting where none is accepted)."""

    method: str = "none"
    k: int = 4
    adaptive: bool = True
    disable_by_batch_size: int | None = 2  # no drafts while more requests than this run (None: always draft)


@dataclass
class SpecState:
    """One request's drafting: its current k, and while paused the output length at which it drafts again."""

    k: int
    k_max: int
    resume_at: int = 0
    pause: int = _FIRST_PAUSE


class Speculator:
    """Built by the config builder when ``speculative.method`` is not ``none``; the engine calls it under its lock.

    ``propose`` (before the scheduler runs) gives eligible running requests a ``draft``; ``fill`` (after the
    scheduler grew their KV for it) lets a proposer that drafts with the target's KV write the tokens;
    ``verified`` (in the postprocess) learns what verification kept."""

    def __init__(self, proposer, settings: SpeculativeSettings, max_model_len: int, bus: EventBus | None = None):
        self.proposer = proposer
        self.k = settings.k
        self.adaptive = settings.adaptive
        self.max_batch = settings.disable_by_batch_size
        self.max_model_len = max_model_len
        self.bus = bus if bus is not None else EventBus()
        self.rate = 0.5  # no evidence yet: a few failed drafts bring it below _LOW_RATE, a few kept ones near 1
        self.failures = 0  # proposer calls that raised
        self._started = 0
        self._costly = bool(getattr(proposer, "costly", False))
        self._draft_price = getattr(proposer, "draft_price", None)  # a tier draft's Price per token
        self._fills = getattr(proposer, "fill", None)
        self._releases = getattr(proposer, "release", None)

    def _state(self, req: Request) -> SpecState | None:
        st = req.spec_state
        if st is None:
            asked = req.spec_tokens
            k = self.k if asked is None else min(asked, self.k)
            st = req.spec_state = SpecState(k, k)
            if self.adaptive and k and self.rate < _LOW_RATE:  # drafts have mostly failed lately: start small
                self._started += 1
                st.k = 1
                if self._costly and self._started % _PROBE_EVERY:
                    st.resume_at = _LATE_START
        return st

    def propose(self, running: Sequence[Request]) -> None:
        for r in running:
            if r.draft:  # proposed for a step it was not scheduled in
                r.draft = []
        if self.max_batch is not None and len(running) > self.max_batch:
            return  # a full batch reads the weights once for many tokens already: verification would cost more
        reqs, ks = [], []
        for r in running:
            if r.num_computed + 1 != r.num_tokens or r.matcher is not None:
                continue  # mid-prompt, or constrained (its matcher sees one token at a time)
            st = self._state(r)
            if st.k_max == 0:
                continue
            n_out = len(r.output_ids)
            if n_out < st.resume_at:
                continue
            # the step yields up to k + 1 tokens: none past max_tokens or the context
            k = min(st.k, r.params.max_tokens - n_out - 1, self.max_model_len - r.num_tokens - 1)
            if k > 0:
                reqs.append(r)
                ks.append(k)
        if not reqs:
            return
        try:
            drafts = self.proposer.propose(reqs, ks)
        except Exception:  # drafts are optional: a failing proposer costs its speed-up, never a request
            self._failed("propose")
            return
        for r, k, d in zip(reqs, ks, drafts):
            if d:
                r.draft = list(d[:k])

    def fill(self, schedule: Sequence[tuple[Request, int]]) -> bool:
        """The proposer's ``fill`` over the scheduled drafts (their KV grown); True if it ran (drafts may be
        shorter now)."""
        if self._fills is None:
            return False
        reqs = [r for r, _ in schedule if r.draft]
        if not reqs:
            return False
        try:
            self._fills(reqs)
        except Exception:
            self._failed("fill")
            for r in reqs:
                r.draft = []
        return True

    def _failed(self, what: str) -> None:
        self.failures += 1
        if self.failures <= 3 or self.failures % 1000 == 0:  # said, not repeated every step
            log.exception("speculative decoding: proposer %s.%s raised (failure %d); this step runs without drafts",
                          type(self.proposer).__name__, what, self.failures)

    def release(self, req: Request) -> None:
        """The request ended: what the proposer keeps for it goes."""
        if self._releases is not None:
            self._releases(req)

    def verified(self, outcome: Sequence[tuple[Request, int, int]]) -> None:
        """``(request, drafted, accepted)`` per speculating request of the step."""
        per_pos = [0] * self.k
        drafted_total = accepted_total = 0
        draft_price = self._draft_price
        for req, drafted, accepted in outcome:
            req.num_draft_tokens += drafted
            req.num_accepted_tokens += accepted
            ts = req.tierset
            if ts is not None:  # what the rejected rows and the draft cost at list prices (reported, not charged)
                req.spec_monetary += ((drafted - accepted) * ts.price.output_1k
                                      + drafted * (draft_price.output_1k if draft_price is not None else 0.0)) / 1000
            drafted_total += drafted
            accepted_total += accepted
            for j in range(min(accepted, self.k)):
                per_pos[j] += 1
            self.rate += _RATE_WEIGHT * (accepted / drafted - self.rate)
            st = req.spec_state
            if st is None or not self.adaptive:
                continue
            if accepted == 0:  # pause, longer each time in a row (much longer where a draft costs a model's work)
                st.resume_at = len(req.output_ids) + st.pause
                st.pause = min(st.pause * (4 if self._costly else 2), _MAX_PAUSE)
                st.k = 1
            else:
                st.pause = _FIRST_PAUSE
                st.k = min(st.k_max, accepted + 1)  # one more than it kept: grows while drafts hold
        if self.bus.enabled and outcome:
            self.bus.publish(SpeculationVerified(len(outcome), drafted_total, accepted_total, tuple(per_pos)))
