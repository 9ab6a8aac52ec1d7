"""KVCacheManager: a request's KV blocks across the hot pool (device memory) and the warm pool (host memory).

* **Replayable prefixes.** Every full block is named by a chained SHA-256 over (parent hash, salt, its
  token ids); a request whose known tokens start with cached blocks takes them instead of recomputing
  them. The salt (``Request.salt``: the tenant and, in a MoE model, the TierSet's routing limits) is part of
  every hash, so different tenants never share a block, nor do requests whose experts computed it differently.
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
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

from litellm_pipeline.engine.block_pool import BlockPool
from litellm_pipeline.engine.request import Request
from litellm_pipeline.telemetry import (
    BlocksDemoted,
    BlocksEvicted,
    BlocksPromoted,
    EventBus,
    PrefixLookup,
)


def hash_block(parent: bytes, tokens: Sequence[int], salt: str) -> bytes:
    """Content hash of one full block: parent hash, salt (see ``Request.salt``) and the block's token ids."""
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
    """Host-memory blocks, kept in a :class:`BlockPool` of their own: cached prefixes demoted from the hot
    pool (evictable under the warm pool's policy) and swapped-out requests (in use until swapped back in)."""

    def __init__(self, pool: BlockPool, kv: list, block_size: int):
        self.pool = pool
        self.kv = kv
        self.block_size = block_size
        # a parallel engine's driver: each copy is sent to the workers first, ``(to_warm, src_ids, dst_ids)``
        self.mirror = None

    def _copy(self, hot_kv: list, to_warm: bool, src_ids: list[int], dst_ids: list[int]) -> None:
        if self.mirror is not None:
            self.mirror(to_warm, src_ids, dst_ids)
        src, dst = (hot_kv, self.kv) if to_warm else (self.kv, hot_kv)
        copy_blocks(src, src_ids, dst, dst_ids, self.block_size)

    @property
    def num_held(self) -> int:
        """Slots in use (holding swapped-out requests)."""
        return sum(1 for c in self.pool.ref_counts if c)

    def has(self, h: bytes) -> bool:
        return self.pool.lookup(h) is not None

    def store(self, h: bytes, hot_kv: list, hot_block: int) -> bool:
        """Keep a copy of an evicted hot block (evicting the warm pool's own victim if full)."""
        if self.pool.lookup(h) is not None or not self.pool.can_allocate(1):
            return False
        (slot,) = self.pool.allocate(1)
        self._copy(hot_kv, True, [hot_block], [slot])
        self.pool.register(slot, h)
        self.pool.free([slot])  # unreferenced and hashed: cached, evictable
        return True

    def take(self, h: bytes) -> int:
        """Hold the cached warm slot of ``h`` so that nothing evicts it before :meth:`promote` copies it."""
        slot = self.pool.lookup(h)
        self.pool.acquire(slot)
        return slot

    def promote(self, slot: int, hot_kv: list, hot_block: int) -> None:
        """Copy a held warm slot into a hot block; the warm copy is dropped (the hot one now caches it)."""
        self._copy(hot_kv, False, [slot], [hot_block])
        self.pool.free([slot])
        self.pool.discard(slot)

    def swap_out(self, hot_kv: list, blocks: list[int]) -> list[int] | None:
        if not self.pool.can_allocate(len(blocks)):
            return None
        slots = self.pool.allocate(len(blocks))
        self._copy(hot_kv, True, blocks, slots)
        return slots

    def swap_in(self, hot_kv: list, slots: list[int], blocks: list[int]) -> None:
        self._copy(hot_kv, False, slots, blocks)
        self.pool.free(slots)

    def drop(self, slots: list[int]) -> None:
        self.pool.free(slots)


@dataclass(frozen=True)
class KVLayout:
    """Where one step's tokens write their K/V and where each sequence reads its context: flat slot ids
    (``block * block_size + offset``) into every layer's cache, in the step's row order (entries with
    several new tokens first, then the single-token ones).

    * ``chunk_slots[i]`` — ``[ctx_len]``: every context position of the i-th multi-token entry (its new
      tokens write the last ``n`` of them).
    * ``decode_slots`` — ``[B, Lmax]``: the context of each single-token entry, padded (pad slots are
      arbitrary; ``decode_ctx_lens`` says how many are real). Its new token writes
      ``decode_slots[b, decode_ctx_lens[b] - 1]`` (``decode_new_slots``; ``decode_new_slot_ids`` as ints).
    """

    chunk_slots: tuple[torch.Tensor, ...]
    decode_slots: torch.Tensor | None = None
    decode_ctx_lens: torch.Tensor | None = None
    decode_new_slot_ids: tuple[int, ...] = ()

    @cached_property
    def decode_new_slots(self) -> torch.Tensor | None:
        """``[B]`` long, made on first use: a decode-only step that runs from its tokens never asks (the fused
        decode reads each new slot from ``decode_slots``), and a tensor op costs tens of microseconds when the
        caches are cold."""
        if self.decode_slots is None:
            return None
        return torch.tensor(self.decode_new_slot_ids, dtype=torch.long)


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
        bus: EventBus | None = None,
    ):
        self.hot, self.hot_kv, self.block_size, self.warm = hot, hot_kv, block_size, warm
        self._offsets = torch.arange(block_size)  # slot offsets inside a block
        self._row: tuple[list[int], int, torch.Tensor] | None = None  # see _slot_row
        self.prefix_caching = prefix_caching
        self.bus = bus if bus is not None else EventBus()
        hot.on_evict = self._on_evict
        self.session_ttl_s, self.max_sessions = session_ttl_s, max_sessions
        self.sessions: OrderedDict[str, tuple[list[int], float]] = OrderedDict()

    def _on_evict(self, block: int, h: bytes) -> None:
        demoted = self.warm is not None and self.warm.store(h, self.hot_kv, block)
        if self.bus.enabled:
            self.bus.publish(BlocksEvicted(1))
            if demoted:
                self.bus.publish(BlocksDemoted(1))

    # ---- where a step's tokens live
    def step_layout(self, schedule: Sequence[tuple[Request, int]]) -> KVLayout:
        """The KV slots of a scheduled step (see :class:`KVLayout`); blocks were grown by the scheduler."""
        bs = self.block_size
        chunks = []
        i = 0
        for req, n in schedule:
            if n == 1:
                break
            end = req.num_computed + n
            if len(schedule) == 1:  # one sequence alone (a prompt, a draft verified at batch 1): its kept slot row
                chunks.append(self._slot_row(req.block_ids, -(-end // bs))[0, :end])
            else:
                pos = torch.arange(end)
                chunks.append(torch.tensor(req.block_ids, dtype=torch.long)[pos // bs] * bs + pos % bs)
            i += 1
        decodes = schedule[i:]
        if not decodes:
            return KVLayout(tuple(chunks))
        # a decode step runs every few milliseconds: a handful of tensor ops whatever the batch (each costs
        # microseconds, and the caches are cold after the weights streamed through them)
        b = len(decodes)
        if b == 1:  # one sequence decoding (batch-1): views into its slot row, kept from step to step
            req = decodes[0][0]
            n = req.num_computed + 1
            row = self._slot_row(req.block_ids, -(-n // bs))
            new = req.block_ids[(n - 1) // bs] * bs + (n - 1) % bs
            return KVLayout(tuple(chunks), row[:, :n], torch.tensor([n]), (new,))
        ctx_lens = [r.num_computed + 1 for r, _ in decodes]
        slots = self.slot_table([r.block_ids for r, _ in decodes], ctx_lens)
        new = [r.block_ids[(n - 1) // bs] * bs + (n - 1) % bs for (r, _), n in zip(decodes, ctx_lens)]
        return KVLayout(tuple(chunks), slots, torch.tensor(ctx_lens), tuple(new))

    def slot_table(self, block_lists: Sequence[list[int]], lens: Sequence[int]) -> torch.Tensor:
        """``[B, max(lens)]`` long: the slots of the first ``lens[b]`` positions of sequence b (padded past
        them with arbitrary slots, never read)."""
        bs, b = self.block_size, len(lens)
        lmax = max(lens)
        nblk = -(-lmax // bs)
        table = [blocks[:nblk] for blocks in block_lists]
        for row in table:
            if len(row) < nblk:
                row.extend([0] * (nblk - len(row)))  # a shorter context: pad blocks (never read)
        # every slot of the table's blocks, [b, nblk * bs], then the first lmax of each row
        slots = (torch.tensor(table, dtype=torch.long).unsqueeze(-1) * bs + self._offsets).view(b, nblk * bs)
        if nblk * bs != lmax:
            slots = slots[:, :lmax].contiguous()
        return slots

    def _slot_row(self, blocks: list[int], nblk: int) -> torch.Tensor:
        """Every slot of ``blocks`` (at least ``nblk`` of them) as one row [1, N]. The row of the last list asked is
        kept: a request decoding alone asks for the same list every step, one block longer every block_size
        steps. A request's list only grows in place (it is replaced when its blocks go), so holding it and
        its length tells whether the row is current."""
        kept = self._row
        if kept is not None and kept[0] is blocks and kept[1] >= nblk:
            return kept[2]
        row = (torch.tensor(blocks, dtype=torch.long).unsqueeze(-1) * self.block_size + self._offsets).view(1, -1)
        self._row = (blocks, len(blocks), row)
        return row

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
        promoted = 0
        for h in hashes:
            b = self.hot.lookup(h)
            if b is not None:
                self.hot.acquire(b)
            elif self.warm is not None and self.warm.has(h) and self.hot.can_allocate(1):
                slot = self.warm.take(h)  # first: the hot allocation may demote blocks into the warm pool
                b = self.hot.allocate(1)[0]
                self.warm.promote(slot, self.hot_kv, b)
                self.hot.register(b, h, len(got) + 1, got[-1] if got else None)
                promoted += 1
            else:
                break
            got.append(b)
        req.block_ids = got
        req.num_registered = len(got)
        covered = len(got) * self.block_size
        if req.num_computed == 0 and not req.output_ids:
            req.num_cached_tokens = covered
        if self.bus.enabled:
            if promoted:
                self.bus.publish(BlocksPromoted(promoted))
            if not req.prefix_reported:  # a request may look up again after waiting for room: count it once
                req.prefix_reported = True
                self.bus.publish(PrefixLookup(req.request_id, covered, len(req.prompt_ids) - covered))
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
            # the parent is the block a prefix lookup finds for the previous hash (another request's copy
            # when this one computed the same content too)
            parent = self.hot.lookup(hashes[i - 1]) if i else None
            self.hot.register(req.block_ids[i], hashes[i], i + 1, parent)
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

    def trim(self, req: Request) -> None:
        """Give back the blocks past the request's computed tokens and the one it computes next (a draft's
        rejected tokens, a draft dropped before it ran). Those blocks are its own: none is registered."""
        keep = -(-(req.num_computed + 1) // self.block_size)
        if len(req.block_ids) > keep:
            self.hot.free(req.block_ids[keep:])
            req.block_ids = req.block_ids[:keep]  # a new list: a kept slot row of the old one is stale

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

    def release_sessions(self, num_blocks: int) -> bool:
        """End pinned sessions, least recently used first, until ``num_blocks`` hot blocks can be allocated;
        True if they can."""
        while not self.hot.can_allocate(num_blocks) and self.sessions:
            self.end_session(next(iter(self.sessions)))
        return self.hot.can_allocate(num_blocks)

    def touch_session(self, session_id: str) -> None:
        if session_id in self.sessions:
            self.sessions.move_to_end(session_id)
