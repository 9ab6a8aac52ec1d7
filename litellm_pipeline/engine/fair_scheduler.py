"""The ``fair`` scheduler: weighted fair queuing across tenants when waiting requests join the running batch.

Each tenant has its own FIFO of waiting requests and a *virtual time*: the work of its requests admitted so far
(prompt + max_tokens, what a request asks of the engine) divided by its weight (``conf/tenants``, 1 for a tenant
not listed there). The next request to start is the head of the queue of the backlogged tenant with the smallest
virtual time (ties: the tenant that queued first). So while tenants compete, each gets batch admissions in
proportion to its weight, and a tenant that floods the engine queues mostly behind itself: another tenant's
request starts as soon as a batch slot frees, not after the flood. A tenant that was idle re-enters at the
current virtual time (that of the latest admission), so idleness banks no credit to spend in a burst.

Only the admission order differs from ``fcfs``: running requests, chunked prefill, preemption (the newest running
request first) and KV handling are inherited. A preempted request goes back to the front of its tenant's queue
with its charge refunded, so resuming costs it nothing extra. Per admission the cost is O(log tenants) (a heap of
the backlogged tenants); a step that admits nothing touches none of this.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Any, Iterator, Mapping

from litellm_pipeline.engine.request import Request
from litellm_pipeline.engine.scheduler import FcfsScheduler
from litellm_pipeline.registry import register

__all__ = ["FairQueue", "FairScheduler"]


class FairQueue:
    """The waiting requests of every tenant, with the deque operations the scheduler uses: ``[0]`` (the next to
    start), ``popleft``, ``append`` (a new arrival), ``appendleft`` (a preempted request), ``remove`` (an abort),
    ``len``, ``in``. Iteration lists each tenant's queue in turn (not the order requests will start in)."""

    def __init__(self, weights: Mapping[str, float] | None = None):
        self._weights = dict(weights or {})
        self._queues: dict[str, deque[Request]] = {}  # backlogged tenants only
        self._vtime: dict[str, float] = {}
        # (virtual time, seq, tenant); an entry is live only while _live[tenant] == seq, so changing a tenant's
        # time pushes a new entry and the old one is dropped lazily when it surfaces
        self._heap: list[tuple[float, int, str]] = []
        self._live: dict[str, int] = {}
        self._seq = itertools.count()
        self._clock = 0.0  # the virtual time of the latest admission
        self._len = 0

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def vtime(self, tenant: str) -> float:
        """The tenant's virtual time (admitted work / weight); for tests and debugging."""
        return self._vtime.get(tenant, self._clock)

    def _charge(self, req: Request) -> float:
        return (len(req.prompt_ids) + req.params.max_tokens) / self.weight(req.tenant)

    # ---- deque interface ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        for q in self._queues.values():
            yield from q

    def __contains__(self, req: object) -> bool:
        q = self._queues.get(getattr(req, "tenant", None))
        return q is not None and req in q

    def __getitem__(self, index: int) -> Request:
        if index != 0:
            raise IndexError("a FairQueue only shows its head ([0])")
        if not self._len:
            raise IndexError("the queue is empty")
        return self._queues[self._head()][0]

    def append(self, req: Request) -> None:
        t = req.tenant
        q = self._queues.get(t)
        if q is None:  # the tenant becomes backlogged: at the current virtual time at the earliest
            q = self._queues[t] = deque()
            self._vtime[t] = max(self._vtime.get(t, self._clock), self._clock)
            self._push(t)
        q.append(req)
        self._len += 1

    def appendleft(self, req: Request) -> None:
        """A preempted request: first of its tenant's queue again, its admission charge refunded."""
        t = req.tenant
        q = self._queues.get(t)
        if q is None:
            q = self._queues[t] = deque()
        q.appendleft(req)
        self._len += 1
        self._vtime[t] = self._vtime.get(t, self._clock) - self._charge(req)
        self._push(t)

    def popleft(self) -> Request:
        t = self._head()
        heapq.heappop(self._heap)
        q = self._queues[t]
        req = q.popleft()
        self._len -= 1
        self._clock = self._vtime[t]
        self._vtime[t] += self._charge(req)
        if q:
            self._push(t)
        else:
            self._retire(t)
        return req

    def first(self, skip: set[str]) -> Request | None:
        """The head of the backlogged tenant with the smallest virtual time that is not in ``skip``."""
        best = None
        for t, q in self._queues.items():
            if t not in skip and (best is None or (self._vtime[t], self._live[t]) < best[0]):
                best = ((self._vtime[t], self._live[t]), q[0])
        return None if best is None else best[1]

    def take(self, req: Request) -> None:
        """Start ``req``, the head of its tenant's queue, charging its tenant as :meth:`popleft` does (the clock
        moves only when it is the tenant next in turn)."""
        t = req.tenant
        if self._queues[self._head()][0] is req:
            self.popleft()
            return
        q = self._queues[t]
        if not q or q[0] is not req:
            raise ValueError("only the head of a tenant's queue starts")
        q.popleft()
        self._len -= 1
        self._vtime[t] += self._charge(req)
        if q:
            self._push(t)
        else:
            self._retire(t)

    def remove(self, req: Request) -> None:
        q = self._queues.get(req.tenant)
        if q is None:
            raise ValueError("request is not waiting")
        q.remove(req)
        self._len -= 1
        if not q:
            self._retire(req.tenant)

    # ---- heap of backlogged tenants ---------------------------------------------------------------------
    def _push(self, tenant: str) -> None:
        seq = next(self._seq)
        self._live[tenant] = seq
        heapq.heappush(self._heap, (self._vtime[tenant], seq, tenant))
        if len(self._heap) > 2 * len(self._queues) + 16:  # too many dead entries: rebuild from the live ones
            self._heap = [(self._vtime[t], self._live[t], t) for t in self._queues]
            heapq.heapify(self._heap)

    def _head(self) -> str:
        """The backlogged tenant with the smallest virtual time (dead heap entries are dropped on the way)."""
        heap = self._heap
        while True:
            _, seq, tenant = heap[0]
            if self._live.get(tenant) == seq:
                return tenant
            heapq.heappop(heap)

    def _retire(self, tenant: str) -> None:
        del self._queues[tenant]
        del self._live[tenant]
        if self._vtime[tenant] <= self._clock:  # it would re-enter at the clock anyway: forget it
            del self._vtime[tenant]


@register("scheduler", "fair")
class FairScheduler(FcfsScheduler):
    """``fcfs`` with weighted fair queuing across tenants for admission (see the module docstring).

    ``weights``: tenant name -> share (the builder passes ``conf/tenants``' weights); others weigh 1.
    """

    def __init__(self, *args: Any, weights: Mapping[str, float] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)  # fcfs's (kv, max_num_seqs, max_num_batched_tokens, preemption, bus, ...)
        self.waiting = FairQueue(weights)  # type: ignore[assignment]  # the deque operations fcfs uses

    def _first_waiting(self, skip: set[str]) -> Request | None:
        return self.waiting.first(skip)

    def _take_waiting(self, req: Request) -> None:
        self.waiting.take(req)
