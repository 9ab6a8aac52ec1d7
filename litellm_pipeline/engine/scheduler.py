"""Schedulers (registry kind ``scheduler``): decide each step which requests compute how many tokens.

A step's plan is ``[(request, num_new_tokens), ...]`` (the vLLM-v1 shape): a request mid-prompt gets a
chunk, a generating request gets one token, all under ``max_num_batched_tokens`` and ``max_num_seqs``.
Prefill and decode are not separate phases: a running request simply has ``num_tokens - num_computed``
tokens left to compute, and a new one first takes whatever prefix the KV cache already holds.

When hot KV blocks run out, the least important running request (see ``victim``) is preempted: by
``swap`` (its blocks parked in the warm pool, restored on resume) or by ``recompute`` (blocks freed, its
tokens recomputed later, partly from the prefix cache). Either way it resumes with identical output.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from typing import Literal

from litellm_pipeline.engine.kv_cache_manager import KVCacheManager
from litellm_pipeline.engine.request import Request, RequestStatus
from litellm_pipeline.registry import register
from litellm_pipeline.registry.types import SchedulerLoad
from litellm_pipeline.telemetry import EventBus, RequestPreempted, RequestScheduled


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@register("scheduler", "fcfs")
class FcfsScheduler:
    """First come, first served; the newest running request is preempted first."""

    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption: Literal["recompute", "swap"] = "recompute",
        bus: EventBus | None = None,
    ):
        self.kv = kv
        self.bus = bus if bus is not None else EventBus()
        self.pool = kv.hot
        self.block_size = kv.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption = preemption
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # ---- ordering policy (subclasses change these two)
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def requeue(self, req: Request) -> None:
        """A preempted request goes back ahead of newer arrivals."""
        self.waiting.appendleft(req)

    def _add_running(self, req: Request) -> None:
        self.running.append(req)

    def victim(self) -> Request:
        """The running request to preempt: always the last of ``running`` (not yet scheduled this step)."""
        return self.running[-1]

    # ----
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def load(self) -> SchedulerLoad:
        return SchedulerLoad(tuple(self.running), tuple(self.waiting), self.max_num_seqs)

    def postprocess(self, schedule: list[tuple[Request, int]]) -> None:
        """The step ran: each scheduled request has its tokens computed (``n``: those it keeps; a speculating
        request keeps its verified tokens only, and the blocks that held only rejected ones go back); newly full
        blocks become replayable prefixes."""
        for req, n in schedule:
            req.num_computed += n
            self.kv.commit(req)
            self.kv.trim(req)

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.draft = []  # proposed for a step it is not in
        self.kv.trim(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.kv.commit(req)
        mode = "swap"
        if not (self.preemption == "swap" and self.kv.swap_out(req)):
            mode = "recompute"
            self.kv.free(req)
            req.num_computed = 0
        if self.bus.enabled:
            self.bus.publish(RequestPreempted(req.request_id, mode))
        self.requeue(req)

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Grow a request's blocks; pinned sessions give way (least recently used first) before it fails."""
        return self.kv.grow(req, num_tokens) or (
            self.kv.release_sessions(self.kv.blocks_needed(req, num_tokens)) and self.kv.grow(req, num_tokens)
        )

    def _start(self, req: Request, budget: int) -> int:
        """Bring a waiting request's KV into the hot pool (its swapped blocks, or its cached prefix) and grow
        it for its next chunk; returns the chunk's tokens, or 0 (then it holds no hot block).

        A swapped request is swapped in only when the whole chunk fits, so a waiting request never sits on
        blocks it cannot use."""
        if req.swapped_slots is not None:
            n = min(req.num_tokens - req.num_computed, budget)
            need = blocks_for(req.num_computed + n, self.block_size)
            if not (self.kv.hot.can_allocate(need) or self.kv.release_sessions(need)):
                return 0
            self.kv.swap_in(req)
            self.kv.grow(req, req.num_computed + n)
            return n
        if req.session_id is not None:
            self.kv.touch_session(req.session_id)
        if not req.block_ids:
            req.num_computed = self.kv.acquire_prefix(req)
        n = min(req.num_tokens - req.num_computed, budget)
        if not self._grow(req, req.num_computed + n):
            self.kv.free(req)  # do not sit on cached prefix blocks while waiting
            req.num_computed = 0
            return 0
        return n

    def schedule(self) -> list[tuple[Request, int]]:
        self.kv.expire_sessions()
        budget = self.max_num_batched_tokens
        plan: list[tuple[Request, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_scheduled_tokens - req.num_computed, budget)
            whole = n == req.num_scheduled_tokens - req.num_computed
            if req.draft and not (whole and self._grow(req, req.num_computed + n)):
                # a draft is verified only whole within the budget, and it never makes anyone wait: without it
                # the request computes its one token (the draft's blocks go back)
                req.draft = []
                self.kv.trim(req)
                n = min(req.num_tokens - req.num_computed, budget)
            while not self._grow(req, req.num_computed + n):
                victim = self.victim()
                self.preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue  # it was preempted (and removed): the same index now holds the next one
            plan.append((req, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting[0]
            n = self._start(req, budget)
            if not n:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self._add_running(req)
            if self.bus.enabled:
                self.bus.publish(RequestScheduled(req.request_id, time.monotonic() - req.arrival))
            plan.append((req, n))
            budget -= n
        return plan

    def blocked(self) -> tuple[Request, str] | None:
        """When nothing can be scheduled although requests wait and none runs: the first waiting request and
        why it can never start (every other block is free or evictable, so it would not fit later either)."""
        if self.running or not self.waiting:
            return None
        req = self.waiting[0]
        need = blocks_for(req.num_tokens, self.block_size)
        return req, (
            f"cannot be scheduled: it needs {need} KV blocks for its {req.num_tokens} tokens but only "
            f"{self.kv.hot.num_free} of {self.kv.hot.num_blocks} can be freed"
        )

    def finish(self, req: Request) -> None:
        """Take a finished or aborted request out and give its blocks back (pinning a session's prefix)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.commit(req)
        if req.session_id is not None and req.finish_reason not in (None, "abort", "error"):
            self.kv.pin_session(req.session_id, req)
        self.kv.free(req)


@register("scheduler", "priority")
class PriorityScheduler(FcfsScheduler):
    """Lowest ``priority`` value first (ties: earliest arrival); preempts the highest value, then newest.

    ``running`` is kept in that order too, so the victim (its last entry) is never a request already
    scheduled earlier in the same step.
    """

    @staticmethod
    def _key(req: Request) -> tuple:
        return (req.priority, req.arrival)

    def add(self, req: Request) -> None:
        keys = [self._key(r) for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, self._key(req)), req)

    def requeue(self, req: Request) -> None:
        self.add(req)

    def _add_running(self, req: Request) -> None:
        bisect.insort(self.running, req, key=self._key)
