"""Schedulers (registry kind ``scheduler``): decide each step which requests compute how many tokens.

A step's plan is ``[(request, num_new_tokens), ...]`` (the vLLM-v1 shape): a request mid-prompt gets a
chunk, a generating request gets one token, all under ``max_num_batched_tokens`` and ``max_num_seqs``.
Prefill and decode are not separate phases: a running request simply has ``num_tokens - num_computed``
tokens left to compute. KV blocks are allocated here; when they run out the newest running request is
preempted by recompute (its blocks freed, its tokens recomputed later with identical results).
"""

from __future__ import annotations

from collections import deque

from litellm_pipeline.engine.block_pool import BlockPool
from litellm_pipeline.engine.request import Request, RequestStatus
from litellm_pipeline.registry import register


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@register("scheduler", "fcfs")
class FcfsScheduler:
    """First come, first served; preempts the newest running request when KV blocks run out."""

    def __init__(self, pool: BlockPool, block_size: int, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _grow(self, req: Request, upto: int) -> bool:
        """Give ``req`` blocks for its first ``upto`` tokens; False if the pool cannot."""
        need = blocks_for(upto, self.block_size) - len(req.block_ids)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        req.block_ids.extend(self.pool.allocate(need))
        return True

    def preempt(self, req: Request) -> None:
        """Recompute preemption: free its KV; it waits at the front and recomputes prompt + output so far."""
        self.running.remove(req)
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_computed = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def schedule(self) -> list[tuple[Request, int]]:
        budget = self.max_num_batched_tokens
        plan: list[tuple[Request, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            while not self._grow(req, req.num_computed + n):
                victim = self.running[-1]
                self.preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            plan.append((req, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._grow(req, req.num_computed + n):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            plan.append((req, n))
            budget -= n
        return plan

    def finish(self, req: Request) -> None:
        """Take a finished or aborted request out and give its blocks back."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.pool.free(req.block_ids)
        req.block_ids = []
