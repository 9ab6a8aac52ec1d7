"""Schedulers (registry kind ``scheduler``): decide each step which requests compute how many tokens.

A step's plan is ``[(request, num_new_tokens), ...]`` (the vLLM-v1 shape): a request mid-prompt gets a
chunk, a generating request gets one token, all under ``max_num_batched_tokens`` and ``max_num_seqs``.
Prefill and decode are not separate phases: a running request simply has ``num_tokens - num_computed``
tokens left to compute, and a new one first takes whatever prefix the KV cache already holds.

When hot KV blocks run out, the least important running request (see ``victim``) is preempted: by
``swap`` (its blocks parked in the warm pool, restored on resume) or by ``recompute`` (blocks freed, its
tokens recomputed later, partly from the prefix cache). Either way it resumes with identical output.

Tenants' KV shares (``kv_shares``, from ``conf/tenants``' ``max_kv_fraction`` / ``min_kv_fraction``) apply to the
hot pool's blocks that a tenant's running requests hold (a shared prefix block counts for each holder):

* **cap** (``max_kv_fraction``): a waiting request does not start while its tenant's blocks plus the blocks of its
  known tokens would pass the cap (the next waiting request of another tenant is considered instead), and a running
  request that would pass it makes its own tenant give way: that tenant's newest request not yet scheduled this
  step is preempted (possibly itself). A tenant's only request may pass its cap (it could never finish otherwise);
* **guarantee** (``min_kv_fraction``): a tenant within its guarantee is preempted only for a tenant also within
  its own; a waiting request that fits in its tenant's guarantee but not in the free blocks preempts a request of
  a tenant above its guarantee to start;
* when blocks run out, the victim is a request of a tenant over its cap, else of a tenant above its guarantee,
  else (within guarantees) as without shares; within each, the scheduler's own order (``victim``: the newest,
  or the least urgent priority).
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal, Mapping

from litellm_pipeline.engine.kv_cache_manager import KVCacheManager
from litellm_pipeline.engine.request import Request, RequestStatus
from litellm_pipeline.registry import register
from litellm_pipeline.registry.types import SchedulerLoad
from litellm_pipeline.telemetry import EventBus, RequestPreempted, RequestScheduled


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class KVShare:
    """One tenant's share of the hot pool, in blocks: at most ``max_blocks`` (None: no cap), ``min_blocks``
    guaranteed (0: none)."""

    max_blocks: int | None
    min_blocks: int = 0

    @classmethod
    def of(cls, fractions: tuple[float | None, float | None], num_blocks: int) -> "KVShare":
        """From ``(max_kv_fraction, min_kv_fraction)`` of a pool of ``num_blocks``."""
        high, low = fractions
        return cls(None if high is None else max(1, int(high * num_blocks)), int((low or 0.0) * num_blocks))


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
        kv_shares: Mapping[str, tuple[float | None, float | None]] | None = None,
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
        # tenant -> its KV share (empty: no shares, and none of their bookkeeping runs); blocks held per tenant
        self.shares: dict[str, KVShare] = {
            t: KVShare.of(f, kv.hot.num_blocks) for t, f in (kv_shares or {}).items() if f != (None, None)}
        self._held: dict[str, int] = {}

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
        if self.shares:
            self._held[req.tenant] = self._held.get(req.tenant, 0) - len(req.block_ids)
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
            self.bus.publish(RequestPreempted(req.request_id, mode, req.tenant))
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
        shares = bool(self.shares)
        if shares:
            self._count_held()
        budget = self.max_num_batched_tokens
        plan: list[tuple[Request, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_scheduled_tokens - req.num_computed, budget)
            whole = n == req.num_scheduled_tokens - req.num_computed
            before = len(req.block_ids)
            if req.draft and not (whole and self._grow(req, req.num_computed + n)):
                # a draft is verified only whole within the budget, and it never makes anyone wait: without it
                # the request computes its one token (the draft's blocks go back)
                req.draft = []
                self.kv.trim(req)
                n = min(req.num_tokens - req.num_computed, budget)
            if shares:
                while self._passes_cap(req, req.num_computed + n):  # its tenant gives way, not another
                    victim = self._own_newest(req, i)
                    self.preempt(victim)
                    preempted = True
                    if victim is req:
                        break
                if req.status is not RequestStatus.RUNNING:
                    continue
            while not self._grow(req, req.num_computed + n):
                victim = self._victim_for(req) if shares else self.victim()
                if shares and victim is not req and self.running.index(victim) < i:
                    budget += self._unplan(victim, plan)  # scheduled earlier in this step: out of the plan
                    i -= 1
                self.preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue  # it was preempted (and removed): the same index now holds the next one
            if shares:
                self._held[req.tenant] = self._held.get(req.tenant, 0) + len(req.block_ids) - before
            plan.append((req, n))
            budget -= n
            i += 1
        skip: set[str] = set()  # tenants at their KV cap this step, or whose next request does not fit
        full = False  # the blocks ran out: only a request within its tenant's guarantee may still start
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self._first_waiting(skip) if skip else self.waiting[0]
            if req is None:
                break
            if shares and (self._cap_blocks_start(req) or (full and not self._fits_guarantee(req))):
                skip.add(req.tenant)
                continue
            n = self._start(req, budget)
            while not n and shares:  # within its guarantee: a request of a tenant above its own gives way
                freed = self._reclaim(req, plan)
                if freed is None:
                    break
                budget += freed
                n = self._start(req, budget)
            if not n:
                if not shares:
                    break
                full = True  # the others may still start within their guarantees (by reclaiming)
                skip.add(req.tenant)
                continue
            self._take_waiting(req)
            req.status = RequestStatus.RUNNING
            self._add_running(req)
            if shares:
                self._held[req.tenant] = self._held.get(req.tenant, 0) + len(req.block_ids)
            if self.bus.enabled:
                self.bus.publish(RequestScheduled(req.request_id, time.monotonic() - req.arrival))
            plan.append((req, n))
            budget -= n
        return plan

    # ---- tenants' KV shares (only with ``kv_shares``) ---------------------------------------------------------
    def _first_waiting(self, skip: set[str]) -> Request | None:
        """The next waiting request (in this scheduler's order) of a tenant not in ``skip``."""
        return next((r for r in self.waiting if r.tenant not in skip), None)

    def _take_waiting(self, req: Request) -> None:
        """Take ``req`` (from :meth:`_first_waiting`, or the head) out of the queue as it starts."""
        if self.waiting[0] is req:
            self.waiting.popleft()
        else:
            self.waiting.remove(req)

    def _count_held(self) -> None:
        held: dict[str, int] = {}
        for r in self.running:
            held[r.tenant] = held.get(r.tenant, 0) + len(r.block_ids)
        self._held = held

    def _share_class(self, tenant: str) -> int:
        """0: over its cap, 1: above its guarantee (or none), 2: within its guarantee."""
        share, held = self.shares.get(tenant), self._held.get(tenant, 0)
        if share is None:
            return 1
        if share.max_blocks is not None and held > share.max_blocks:
            return 0
        return 2 if held <= share.min_blocks else 1

    def _passes_cap(self, req: Request, num_tokens: int) -> bool:
        """Growing ``req`` to ``num_tokens`` passes its tenant's cap, and it is not the tenant's only request."""
        share = self.shares.get(req.tenant)
        if share is None or share.max_blocks is None:
            return False
        held = self._held.get(req.tenant, 0)
        return held > len(req.block_ids) and held + self.kv.blocks_needed(req, num_tokens) > share.max_blocks

    def _cap_blocks_start(self, req: Request) -> bool:
        """Starting ``req`` (all its known tokens) would pass its tenant's cap while the tenant holds blocks."""
        share = self.shares.get(req.tenant)
        if share is None or share.max_blocks is None:
            return False
        held = self._held.get(req.tenant, 0)
        return held > 0 and held + blocks_for(req.num_tokens, self.block_size) > share.max_blocks

    def _fits_guarantee(self, req: Request) -> bool:
        """``req``'s known tokens fit in what its tenant's guarantee leaves."""
        share = self.shares.get(req.tenant)
        return share is not None and share.min_blocks > 0 and \
            self._held.get(req.tenant, 0) + blocks_for(req.num_tokens, self.block_size) <= share.min_blocks

    def _own_newest(self, req: Request, i: int) -> Request:
        """The last (in this scheduler's order) of ``req``'s tenant's requests not yet scheduled this step."""
        for r in reversed(self.running[i:]):
            if r.tenant == req.tenant:
                return r
        return req

    def _victim_for(self, req: Request) -> Request:
        """Whom ``req`` preempts for blocks: the running request of the lowest share class, then the last in this
        scheduler's order (``req`` included; one scheduled earlier in this step leaves the plan); never one within
        its guarantee for a tenant above its own (``req`` waits instead)."""
        best, best_class, best_at = req, self._share_class(req.tenant), self.running.index(req)
        for at, r in enumerate(self.running):
            c = self._share_class(r.tenant)
            if c < best_class or (c == best_class and at > best_at):
                best, best_class, best_at = r, c, at
        if best_class == 2 and best is not req and self._share_class(req.tenant) != 2:
            return req
        return best

    @staticmethod
    def _unplan(victim: Request, plan: list[tuple[Request, int]]) -> int:
        """Take ``victim`` out of ``plan``; the tokens it had there."""
        for k, (r, n) in enumerate(plan):
            if r is victim:
                del plan[k]
                return n
        return 0

    def _reclaim(self, req: Request, plan: list[tuple[Request, int]]) -> int | None:
        """Within its guarantee but not in the free blocks: preempt the request of another tenant above its own
        guarantee (over its cap first, then the last in this scheduler's order) and drop it from ``plan``; the
        tokens it had there (to add back to the budget), or None if there is no such request or ``req`` does not
        fit its guarantee."""
        if not self._fits_guarantee(req):
            return None
        victim, victim_class = None, 2
        for r in self.running:
            c = self._share_class(r.tenant)
            if r.tenant != req.tenant and c < 2 and c <= victim_class:
                victim, victim_class = r, c
        if victim is None:
            return None
        freed = self._unplan(victim, plan)
        self.preempt(victim)
        return freed

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
