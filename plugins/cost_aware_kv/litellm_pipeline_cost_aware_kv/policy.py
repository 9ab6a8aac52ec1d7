"""recompute_cost: a KV eviction policy that keeps the cached blocks that are dearest to recompute.

Losing a cached block costs the work of recomputing it when its prefix comes back, and that work grows with its
depth in the prefix chain: block ``d`` (1 = a prompt's first block) holds tokens that attend over ``d`` blocks of
context. Two facts of chained prefix hashes shape the order:

* A lookup stops at the first missing block, so evicting a block whose children are still cached makes them
  unreachable: they keep occupying the pool and save nothing. Only *leaves* (no cached child) are evicted while any
  leaf is evictable, so chains are peeled from their tails.
* Among leaves the policy runs GreedyDual: a block freed at "clock" ``L`` gets priority ``L + depth``; the lowest
  goes first and the clock moves up to it. A shallow block goes before a deep one freed at the same time, but old
  deep blocks do not stay forever: every eviction ages the rest.

It needs the pool's ``describe(block, depth, parent)`` hook (see ``litellm_pipeline/engine/block_pool.py``). A block
it was never told about (the warm tier's pool, which is not given chains) counts as depth 1: among those the
order is least recently freed first, like ``lru``. A cached block whose parent was evicted (an orphan), and everything
below it, cannot be hit until the parent's content is cached again, so it costs 0 (until a new child shows it
reachable again).
"""

from __future__ import annotations

import heapq
import itertools


class RecomputeCostPolicy:
    """Evict the evictable leaf with the lowest ``clock-at-free + depth`` (GreedyDual over recompute cost)."""

    def __init__(self) -> None:
        self._depth: dict[int, int] = {}  # cached block -> cost (its depth; 0 for an orphan)
        self._parent: dict[int, int] = {}  # cached block -> the cached block before it in its chain
        self._kids: dict[int, set[int]] = {}  # cached block -> its cached children
        self._live: dict[int, tuple[bool, float, int]] = {}  # evictable block -> its current heap key
        self._heap: list[tuple[bool, float, int, int]] = []  # (has cached kids, priority, tick, block); stale skipped
        self._clock = 0.0  # GreedyDual's L: the priority of the latest victim
        self._tick = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, block: int) -> bool:
        return block in self._live

    # ---- what the pool tells it
    def describe(self, block: int, depth: int, parent: int | None) -> None:
        """A block was just cached at ``depth`` of its chain, after ``parent`` (None: the chain's first)."""
        self._depth[block] = depth
        if parent is not None and parent in self._depth:
            self._depth[parent] = depth - 1  # an orphan that is reachable again has its depth back
            self._parent[block] = parent
            kids = self._kids.setdefault(parent, set())
            kids.add(block)
            if len(kids) == 1 and parent in self._live:  # an evictable leaf just became a parent
                self._push(parent, self._live[parent][1])

    def add(self, block: int) -> None:
        self._push(block, self._clock + self._depth.get(block, 1))
        if len(self._heap) > 2 * len(self._live) + 16:  # removed entries would otherwise pile up
            self._heap = [(*key, b) for b, key in self._live.items()]
            heapq.heapify(self._heap)

    def remove(self, block: int) -> None:
        self._live.pop(block, None)

    def hit(self, block: int) -> None:
        pass  # a reused block is refreshed when it is freed again (add): its priority restarts from the clock

    def forget(self, block: int) -> None:
        """The block's content is gone: unlink it from its chain; its children become orphans."""
        self._depth.pop(block, None)
        parent = self._parent.pop(block, None)
        if parent is not None:
            kids = self._kids.get(parent)
            if kids is not None:
                kids.discard(block)
                if not kids:
                    del self._kids[parent]
                    if parent in self._live:  # it is a leaf now
                        self._push(parent, self._live[parent][1])
        orphans = list(self._kids.pop(block, ()))
        for child in orphans:
            self._parent.pop(child, None)
        while orphans:  # the whole subtree is unreachable until this content returns: nothing to lose
            b = orphans.pop()
            self._depth[b] = 0
            orphans.extend(self._kids.get(b, ()))
            if b in self._live:
                self._push(b, min(self._live[b][1], self._clock))

    def pop(self) -> int | None:
        while self._heap:
            has_kids, prio, tick, block = heapq.heappop(self._heap)
            if self._live.get(block) != (has_kids, prio, tick):
                continue  # removed, or re-keyed since this entry was pushed
            del self._live[block]
            self._clock = max(self._clock, prio)
            return block
        return None

    def _push(self, block: int, prio: float) -> None:
        key = (bool(self._kids.get(block)), prio, next(self._tick))
        self._live[block] = key
        heapq.heappush(self._heap, (*key, block))
