"""KV eviction policies (registry kind ``kv_policy``): which cached-but-unused block to give up first.

A policy tracks the *evictable* blocks of one pool: blocks that hold a cached prefix but that no request
references. ``add`` makes a block evictable, ``remove`` takes it back (a prefix hit reused it), ``hit``
counts a reuse, ``pop`` chooses and removes the victim. All operations are O(1) or O(log n).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict

from litellm_pipeline.registry import register


@register("kv_policy", "lru")
class LRUPolicy:
    """Least recently used: the block freed (or hit) longest ago goes first."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block: int) -> bool:
        return block in self._order

    def add(self, block: int) -> None:
        self._order[block] = None
        self._order.move_to_end(block)

    def remove(self, block: int) -> None:
        self._order.pop(block, None)

    def hit(self, block: int) -> None:
        pass  # recency is refreshed by the next add()

    def forget(self, block: int) -> None:
        """The block's content is gone (evicted or overwritten): drop any history kept for it."""

    def pop(self) -> int | None:
        if not self._order:
            return None
        block, _ = self._order.popitem(last=False)
        return block


@register("kv_policy", "lfu")
class LFUPolicy:
    """Least frequently used: fewest prefix hits goes first; ties go to the least recently freed."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int]] = []  # (hits, tick, block); stale entries skipped lazily
        self._live: dict[int, tuple[int, int]] = {}
        self._hits: dict[int, int] = {}
        self._tick = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, block: int) -> bool:
        return block in self._live

    def add(self, block: int) -> None:
        key = (self._hits.get(block, 0), next(self._tick))
        self._live[block] = key
        heapq.heappush(self._heap, (*key, block))
        if len(self._heap) > 2 * len(self._live) + 16:
            # stale entries (blocks removed by a prefix hit) would otherwise pile up without bound
            self._heap = [(*k, b) for b, k in self._live.items()]
            heapq.heapify(self._heap)

    def remove(self, block: int) -> None:
        self._live.pop(block, None)

    def hit(self, block: int) -> None:
        self._hits[block] = self._hits.get(block, 0) + 1

    def forget(self, block: int) -> None:
        self._hits.pop(block, None)

    def pop(self) -> int | None:
        while self._heap:
            hits, tick, block = heapq.heappop(self._heap)
            if self._live.get(block) == (hits, tick):
                del self._live[block]
                return block
        return None
