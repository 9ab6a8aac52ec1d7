"""BlockPool: a fixed set of KV blocks handed out by reference count, with a prefix cache.

A block is *in use* while its count is above 0. A full block may carry a content hash; when its count
drops to 0 it stays cached (findable by hash) and becomes evictable under the pool's ``kv_policy``. A block
without a hash goes straight back to the free list. Allocation takes never-cached blocks first, then
evicts; ``on_evict`` lets a warm tier keep an evicted block's content (and telemetry count it).

The same structure serves the warm tier in host memory (``WarmPool``): cached slots there are evictable
under its own policy, and slots holding a swapped-out request are simply in use.
"""

from __future__ import annotations

from collections import deque
from typing import Callable


class NoFreeBlocks(RuntimeError):
    """The pool cannot satisfy an allocation (callers check ``can_allocate`` first)."""


class BlockPool:
    def __init__(self, num_blocks: int, policy=None, on_evict: Callable[[int, bytes], None] | None = None):
        if num_blocks < 1:
            raise ValueError(f"cache.num_blocks must be >= 1 (got {num_blocks})")
        from litellm_pipeline.engine.kv_policy import LRUPolicy

        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.policy = policy if policy is not None else LRUPolicy()
        self.on_evict = on_evict
        # optional policy hook: where a newly cached block sits in its prefix chain (cost-aware policies use it)
        self._describe = getattr(self.policy, "describe", None)
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks an allocation can get: never-cached ones plus evictable cached ones."""
        return len(self._free) + len(self.policy)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    @property
    def num_idle_cached(self) -> int:
        """Cached blocks no request holds: kept for prefix hits, evictable (the policy's candidates)."""
        return len(self.policy)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise NoFreeBlocks(f"asked for {n} KV blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b = self.policy.pop()
                self._uncache(b, evicted=True)
            self.ref_counts[b] = 1
            out.append(b)
        return out

    def _uncache(self, b: int, evicted: bool) -> None:
        h = self.block_hash[b]
        if h is None:
            return
        if evicted and self.on_evict is not None:
            self.on_evict(b, h)
        self.policy.forget(b)
        self.block_hash[b] = None
        if self.cached.get(h) == b:
            del self.cached[h]

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; at 0 a hashed block stays cached, others are free."""
        for b in reversed(blocks):  # reversed: a sequence's tail is the least reusable part, evict it first
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.block_hash[b] is not None:
                    self.policy.add(b)
                else:
                    self._free.append(b)

    def lookup(self, h: bytes) -> int | None:
        return self.cached.get(h)

    def acquire(self, b: int) -> None:
        """Take a reference on a cached block found by :meth:`lookup` (a prefix hit)."""
        if self.ref_counts[b] == 0:
            self.policy.remove(b)
        self.ref_counts[b] += 1
        self.policy.hit(b)

    def register(self, b: int, h: bytes, depth: int = 0, parent: int | None = None) -> None:
        """Record that block ``b`` (in use) now holds the full block whose content hash is ``h``.

        ``depth`` (1 = a prompt's first block; 0 = unknown) and ``parent`` (the cached block of the previous
        link of its chain, None for the first) are passed on to a policy that has ``describe``."""
        if self.block_hash[b] is not None or h in self.cached:
            return  # already cached (same content elsewhere): keep the first copy
        self.block_hash[b] = h
        self.cached[h] = b
        if self._describe is not None and depth:
            self._describe(b, depth, parent)

    def discard(self, b: int) -> None:
        """Forget the content of a cached block that no request references; it becomes free at once."""
        if self.ref_counts[b] != 0:
            raise RuntimeError(f"KV block {b} is in use ({self.ref_counts[b]} references): cannot discard it")
        if self.block_hash[b] is None:
            return  # not cached: already on the free list
        if b in self.policy:
            self.policy.remove(b)
        self._uncache(b, evicted=False)
        self._free.append(b)

    def reset_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their content but are no longer findable)."""
        for b in range(self.num_blocks):
            if self.block_hash[b] is not None:
                in_policy = b in self.policy
                self._uncache(b, evicted=False)
                if in_policy:
                    self.policy.remove(b)
                    self._free.append(b)

    def is_empty(self) -> bool:
        """True when no block is referenced: every request has given its memory back."""
        return not any(self.ref_counts) and self.num_free == self.num_blocks
