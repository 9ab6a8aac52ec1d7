"""BlockPool: the fixed set of KV blocks, handed out by reference count."""

from __future__ import annotations

from collections import deque


class NoFreeBlocks(RuntimeError):
    """The pool cannot satisfy an allocation (callers check ``can_allocate`` first)."""


class BlockPool:
    """Fixed-size KV blocks with reference counts; a block is free exactly when its count is 0."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"cache.num_blocks must be >= 1 (got {num_blocks})")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocks(f"asked for {n} KV blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self.ref_counts[b] = 1
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; blocks whose count reaches 0 go back to the free list."""
        for b in reversed(blocks):  # reversed: the tail of a sequence is the least reusable part
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)

    def is_empty(self) -> bool:
        """True when no block is referenced: every request has given its memory back."""
        return len(self._free) == self.num_blocks and not any(self.ref_counts)
