"""KVCacheManager: a request's KV blocks across the hot pool (device memory) and the warm pool (host memory).

* **Replayable prefixes.** Every full block is named by a chained SHA-256 over (parent hash, salt, its
  token ids); a request whose known tokens start with cached blocks takes them instead of recomputing
  them. The salt (the tenant) is part of every hash, so different tenants never share a block.
* **Hot / warm tiers.** A cached block that nobody uses is evicted from the hot pool under pressure; with a
  warm pool its content is first copied there, and a later prefix hit copies it back.
* **Swap.** A preempted request's blocks can be parked in the warm pool and restored on resume.
* **Sessions.** A finished turn's full blocks can stay pinned (with a TTL and a cap), so the next turn of
  the conversation only prefills its new tokens.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import OrderedDict, deque
from typing import Sequence

import torch

from litellm_pipeline.engine.block_pool import BlockPool
from litellm_pipeline.engine.request import Request


def hash_block(parent: bytes, tokens: Sequence[int], salt: str) -> bytes:
    """Content hash of one full block: parent hash, tenant salt and the block's token ids."""
    h = hashlib.sha256(parent)
    h.update(salt.encode("utf-8"))
    h.update(b"\x00")
    h.update(array("q", tokens).tobytes())
    return h.digest()


def _blocks(kv: torch.Tensor, block_size: int) -> torch.Tensor:
    return kv.view(-1, block_size, *kv.shape[1:])


def copy_blocks(src: list, src_ids: list[int], dst: list, dst_ids: list[int], block_size: int) -> None:
    """Copy whole blocks of every layer's K and V from one pool's tensors to another's."""
    if not src_ids:
        return
    device = dst[0][0].device
    si = torch.tensor(src_ids, device=src[0][0].device)
    di = torch.tensor(dst_ids, device=device)
    for (sk, sv), (dk, dv) in zip(src, dst):
        for s, d in ((sk, dk), (sv, dv)):
            _blocks(d, block_size).index_copy_(0, di, _blocks(s, block_size).index_select(0, si).to(device))


class WarmPool:
    """Host-memory blocks: cached prefixes demoted from the hot pool, and swapped-out requests."""

    def __init__(self, num_blocks: int, kv: list, block_size: int, policy):
        self.num_blocks = num_blocks
        self.kv = kv
        self.block_size = block_size
        self.policy = policy  # evictable = cached slots
        self.cached: dict[bytes, int] = {}
        self.slot_hash: list[bytes | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.held = 0  # slots holding swapped-out requests

    def _take_slots(self, n: int) -> list[int] | None:
        if n > len(self._free) + len(self.policy):
            return None
        out = []
        for _ in range(n):
            if self._free:
                out.append(self._free.popleft())
                continue
            s = self.policy.pop()
            h = self.slot_hash[s]
            self.slot_hash[s] = None
            self.policy.forget(s)
            if h is not None and self.cached.get(h) == s:
                del self.cached[h]
            out.append(s)
        return out

    def _release(self, slot: int) -> None:
        h = self.slot_hash[slot]
        if h is not None:
            self.slot_hash[slot] = None
            self.cached.pop(h, None)
            self.policy.remove(slot)
            self.policy.forget(slot)
        self._free.append(slot)

    def has(self, h: bytes) -> bool:
        return h in self.cached

    def store(self, h: bytes, hot_kv: list, hot_block: int) -> None:
        """Keep a copy of an evicted hot block (dropping the warm pool's own victim if full)."""
        if h in self.cached:
            return
        slots = self._take_slots(1)
        if slots is None:
            return
        copy_blocks(hot_kv, [hot_block], self.kv, slots, self.block_size)
        self.slot_hash[slots[0]] = h
        self.cached[h] = slots[0]
        self.policy.add(slots[0])

    def promote(self, h: bytes, hot_kv: list, hot_block: int) -> None:
        """Copy a cached warm block into a hot block; the warm copy is released (the hot one now caches it)."""
        slot = self.cached[h]
        self.policy.hit(slot)
        copy_blocks(self.kv, [slot], hot_kv, [hot_block], self.block_size)
        self._release(slot)

    def swap_out(self, hot_kv: list, blocks: list[int]) -> list[int] | None:
        slots = self._take_slots(len(blocks))
        if slots is None:
            return None
        copy_blocks(hot_kv, blocks, self.kv, slots, self.block_size)
        self.held += len(slots)
        return slots

    def swap_in(self, hot_kv: list, slots: list[int], blocks: list[int]) -> None:
        copy_blocks(self.kv, slots, hot_kv, blocks, self.block_size)
        self.drop(slots)

    def drop(self, slots: list[int]) -> None:
        for s in slots:
            self._free.append(s)
        self.held -= len(slots)


class KVCacheManager:
    def __init__(
        self,
        hot: BlockPool,
        hot_kv: list,
        block_size: int,
        warm: WarmPool | None = None,
        prefix_caching: bool = True,
        session_ttl_s: float = 600.0,
        max_sessions: int = 64,
    ):
        self.hot, self.hot_kv, self.block_size, self.warm = hot, hot_kv, block_size, warm
        self.prefix_caching = prefix_caching
        if warm is not None:
            hot.on_evict = lambda b, h: warm.store(h, hot_kv, b)
        self.session_ttl_s, self.max_sessions = session_ttl_s, max_sessions
        self.sessions: OrderedDict[str, tuple[list[int], float]] = OrderedDict()
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    # ---- prefixes
    def block_hashes(self, req: Request, num_tokens: int) -> list[bytes]:
        """Hashes of the full blocks among the first ``num_tokens`` tokens (computed once, then kept)."""
        bs = self.block_size
        for i in range(len(req.block_hashes), num_tokens // bs):
            parent = req.block_hashes[-1] if i else b""
            req.block_hashes.append(hash_block(parent, req.token_at(i * bs, (i + 1) * bs), req.salt))
        return req.block_hashes[: num_tokens // bs]

    def acquire_prefix(self, req: Request) -> int:
        """Give a block-less request the cached blocks of its longest known prefix; returns tokens covered.

        At least one token is always left to compute, so the step that follows yields logits.
        """
        if not self.prefix_caching:
            return 0
        known = req.num_tokens
        hashes = self.block_hashes(req, ((known - 1) // self.block_size) * self.block_size)
        got: list[int] = []
        for h in hashes:
            b = self.hot.lookup(h)
            if b is not None:
                self.hot.acquire(b)
            elif self.warm is not None and self.warm.has(h) and self.hot.can_allocate(1):
                b = self.hot.allocate(1)[0]
                self.warm.promote(h, self.hot_kv, b)
                self.hot.register(b, h)
            else:
                break
            got.append(b)
        req.block_ids = got
        req.num_registered = len(got)
        covered = len(got) * self.block_size
        if req.num_computed == 0 and not req.output_ids:
            self.prefix_query_tokens += len(req.prompt_ids)
            self.prefix_hit_tokens += covered
            req.num_cached_tokens = covered
        return covered

    def commit(self, req: Request) -> None:
        """Make the request's newly completed full blocks findable by later requests."""
        if not self.prefix_caching:
            return
        full = min(req.num_computed // self.block_size, len(req.block_ids))
        if full <= req.num_registered:
            return
        hashes = self.block_hashes(req, full * self.block_size)
        for i in range(req.num_registered, full):
            self.hot.register(req.block_ids[i], hashes[i])
        req.num_registered = full

    # ---- growth and release
    def blocks_needed(self, req: Request, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(req.block_ids))

    def grow(self, req: Request, num_tokens: int) -> bool:
        need = self.blocks_needed(req, num_tokens)
        if need and not self.hot.can_allocate(need):
            return False
        if need:
            req.block_ids.extend(self.hot.allocate(need))
        return True

    def free(self, req: Request) -> None:
        if req.swapped_slots is not None and self.warm is not None:
            self.warm.drop(req.swapped_slots)
            req.swapped_slots = None
        self.hot.free(req.block_ids)
        req.block_ids = []
        req.num_registered = 0

    # ---- swap
    def swap_out(self, req: Request) -> bool:
        """Park a preempted request's KV in the warm pool; False if it has no room (recompute instead)."""
        if self.warm is None or not req.block_ids:
            return False
        slots = self.warm.swap_out(self.hot_kv, req.block_ids)
        if slots is None:
            return False
        self.hot.free(req.block_ids)
        req.block_ids, req.swapped_slots = [], slots
        return True

    def swap_in(self, req: Request) -> bool:
        n = len(req.swapped_slots or ())
        if not self.hot.can_allocate(n):
            return False
        blocks = self.hot.allocate(n)
        self.warm.swap_in(self.hot_kv, req.swapped_slots, blocks)
        req.block_ids, req.swapped_slots = blocks, None
        req.num_registered = 0
        return True

    # ---- sessions
    def pin_session(self, session_id: str, req: Request) -> None:
        """Keep the finished turn's full blocks referenced so the next turn finds them hot."""
        full = req.block_ids[: req.num_registered]
        for b in full:
            self.hot.acquire(b)
        self.end_session(session_id)
        self.sessions[session_id] = (full, time.monotonic() + self.session_ttl_s)
        while len(self.sessions) > self.max_sessions:
            self.end_session(next(iter(self.sessions)))

    def end_session(self, session_id: str) -> bool:
        entry = self.sessions.pop(session_id, None)
        if entry is None:
            return False
        self.hot.free(entry[0])
        return True

    def expire_sessions(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for sid in [s for s, (_, exp) in self.sessions.items() if exp <= now]:
            self.end_session(sid)

    def touch_session(self, session_id: str) -> None:
        if session_id in self.sessions:
            self.sessions.move_to_end(session_id)
