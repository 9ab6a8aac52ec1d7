"""check_kv_policy: a ``kv_policy`` class under scripted and random hit/evict sequences through a real BlockPool.

The contract (``litellm_pipeline/engine/kv_policy.py``): a class built with no arguments that tracks the evictable
blocks of one pool, i.e. blocks holding a cached prefix that no request references. The pool calls ``add(b)`` when a
cached block's last reference goes (it becomes evictable), ``remove(b)`` when a prefix hit takes it back, ``hit(b)``
on every prefix hit, ``forget(b)`` when its content is gone, and ``pop()`` to choose a victim; ``len`` and ``in``
count and test the evictable set. What must hold:

* ``pop`` returns a block that was added and not removed or popped since (so never a block in use), removes it, and
  returns None only when nothing is evictable; ``len`` is exactly the number of such blocks.
* any order among evictable blocks is allowed: which one goes first is the policy's choice.

A policy may also define ``describe(block, depth, parent)``: the pool then reports every block it caches (while it
is still in use) with its depth in the prefix chain (1 = a prompt's first block) and the cached block of the
previous link (None for the first). The checks below feed it as the KV manager does.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from litellm_pipeline.engine.block_pool import BlockPool
from litellm_pipeline.testing._support import (
    assert_drained,
    build_llm,
    config_name,
    describe,
    resolve,
)


class _Witness:
    """Stands between the pool and the policy and checks every answer against the pool's own state."""

    def __init__(self, policy: Any, name: str):
        self.policy, self.name = policy, name
        self.pool: BlockPool | None = None
        self.evictable: set[int] = set()
        self.evictions = 0

    def _check_len(self, when: str) -> None:
        n = len(self.policy)
        assert n == len(self.evictable), (
            f"kv_policy {self.name}: len() is {n} after {when}, but {len(self.evictable)} blocks are evictable "
            f"({sorted(self.evictable)[:8]}...)"
        )

    def __len__(self) -> int:
        return len(self.policy)

    def __contains__(self, block: int) -> bool:
        got = block in self.policy
        assert got == (block in self.evictable), (
            f"kv_policy {self.name}: `{block} in policy` is {got}, but the block is "
            f"{'evictable' if block in self.evictable else 'not evictable'}"
        )
        return got

    def add(self, block: int) -> None:
        self.policy.add(block)
        self.evictable.add(block)
        self._check_len(f"add({block})")

    def remove(self, block: int) -> None:
        self.policy.remove(block)
        self.evictable.discard(block)
        self._check_len(f"remove({block})")

    def hit(self, block: int) -> None:
        self.policy.hit(block)

    def forget(self, block: int) -> None:
        self.policy.forget(block)

    def describe(self, block: int, depth: int, parent: int | None) -> None:
        assert self.pool is None or self.pool.ref_counts[block] > 0, f"describe({block}) of a block not in use"
        fn = getattr(self.policy, "describe", None)
        if fn is not None:
            fn(block, depth, parent)

    def _why_not(self, b: Any) -> str:
        pool = self.pool
        if pool is not None and isinstance(b, int) and 0 <= b < pool.num_blocks and pool.ref_counts[b]:
            return f"in use by {pool.ref_counts[b]} request(s)"
        return "never added, or removed or popped since"

    def pop(self) -> int | None:
        had = sorted(self.evictable)
        b = self.policy.pop()
        if not had:
            assert b is None, f"kv_policy {self.name}: pop() returned {b!r} although no block was evictable"
            return None
        assert b is not None, f"kv_policy {self.name}: pop() returned None although blocks {had[:8]} are evictable"
        assert b in self.evictable, (
            f"kv_policy {self.name}: pop() chose block {b!r}, which is not evictable ({self._why_not(b)}); "
            f"evictable: {had[:8]}"
        )
        self.evictable.discard(b)
        self.evictions += 1
        self._check_len(f"pop() -> {b}")
        return b


def _h(*parts: Any) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


class _Script:
    """Requests over a BlockPool as the KV manager drives it: prefix lookup (hits), allocation (evictions),
    registering full blocks with their depth, freeing, discarding and cache resets."""

    def __init__(self, pool: BlockPool, witness: _Witness):
        self.pool, self.w = pool, witness
        self.live: dict[int, list[int]] = {}  # request -> its blocks, in prefix order
        self.next_id = 0

    def start(self, prefix: tuple[int, ...], new_blocks: int) -> bool:
        """A request whose prompt is the chain ``prefix`` (one hash per block) plus ``new_blocks`` fresh ones."""
        got = []
        for depth, key in enumerate(prefix, 1):
            b = self.pool.lookup(_h(prefix[:depth], key))
            if b is None:
                break
            self.pool.acquire(b)
            got.append(b)
        need = len(prefix) - len(got) + new_blocks
        if not self.pool.can_allocate(need):
            self.pool.free(got)
            return False
        fresh = self.pool.allocate(need)
        for b in fresh:
            assert self.pool.ref_counts[b] == 1, f"allocated block {b} has {self.pool.ref_counts[b]} references"
        blocks = got + fresh
        for depth in range(len(got) + 1, len(prefix) + 1):  # full blocks become findable, as commit() does it
            parent = self.pool.lookup(_h(prefix[: depth - 1], prefix[depth - 2])) if depth > 1 else None
            self.pool.register(blocks[depth - 1], _h(prefix[:depth], prefix[depth - 1]), depth, parent)
        self.live[self.next_id] = blocks
        self.next_id += 1
        return True

    def finish(self, rid: int) -> None:
        self.pool.free(self.live.pop(rid))

    def check_cache(self) -> None:
        """Every cached hash maps to a block holding it; a block in use never lost its content."""
        for h, b in self.pool.cached.items():
            assert self.pool.block_hash[b] == h, f"cached hash maps to block {b}, which holds another one"
        for blocks in self.live.values():
            for b in blocks:
                assert self.pool.ref_counts[b] > 0, f"block {b} of a running request has no reference"


def _scripted(cls, name: str) -> int:
    """A constructed sequence: which block must go is forced by what is in use and what a hit took back."""
    w = _Witness(cls(), name)
    pool = BlockPool(6, policy=w)
    w.pool = pool
    s = _Script(pool, w)
    assert s.start((1, 2, 3), 0)  # request 0 caches a 3-block chain
    assert s.start((7, 8, 9), 0)  # request 1 another one: the pool is full
    s.finish(0)  # 3 evictable blocks
    assert s.start((1, 2), 1)  # a hit on 2 of them takes them back; the third can be evicted for the new block
    (kept_a, kept_b, new) = s.live[2]
    assert pool.ref_counts[kept_a] == pool.ref_counts[kept_b] == 1 and w.evictions == 1, (
        f"kv_policy {name}: after a prefix hit on 2 of 3 evictable blocks, allocating one block must evict the "
        f"third (evictions {w.evictions})"
    )
    assert not s.start((5,), 1), f"kv_policy {name}: allocated 2 blocks from a pool with none free or evictable"
    s.finish(1)
    s.finish(2)
    assert len(pool.policy) == 5 and pool.num_free == 6, f"kv_policy {name}: 5 cached blocks should be evictable"
    assert s.start((), 6), f"kv_policy {name}: could not reuse every evictable block for 6 fresh ones"
    s.finish(3)
    assert pool.is_empty(), f"kv_policy {name}: pool not empty at the end (references {pool.ref_counts})"
    return w.evictions


def _random(cls, name: str, seed: int, steps: int) -> int:
    """Random prefix-sharing traffic over a small pool, with discards and cache resets."""
    rng = random.Random(seed)
    w = _Witness(cls(), name)
    pool = BlockPool(rng.randint(8, 24), policy=w)
    w.pool = pool
    s = _Script(pool, w)
    families = [tuple(rng.randint(0, 3) for _ in range(rng.randint(1, 6))) for _ in range(5)]
    for _ in range(steps):
        op = rng.random()
        if op < 0.55 or not s.live:
            fam = rng.choice(families)
            s.start(fam[: rng.randint(1, len(fam))] + (rng.randint(0, 50),) * rng.randint(0, 1), rng.randint(0, 2))
        elif op < 0.93:
            s.finish(rng.choice(list(s.live)))
        elif op < 0.97:
            idle = [b for b in range(pool.num_blocks) if pool.ref_counts[b] == 0 and pool.block_hash[b] is not None]
            if idle:
                pool.discard(rng.choice(idle))  # the pool takes it back from the policy (remove)
        else:
            pool.reset_cache()
        s.check_cache()
        w._check_len("a pool operation")
    for rid in list(s.live):
        s.finish(rid)
    assert pool.is_empty() and not any(pool.ref_counts), (
        f"kv_policy {name}: pool not empty after every request finished: {pool.num_blocks - pool.num_free} blocks "
        "not allocatable"
    )
    return w.evictions


def _in_engine(impl, name: str) -> int:
    """The demo model with a tiny pool: prefix-sharing prompts under eviction (a warm tier and none) give the
    tokens of a run without prefix caching, and the pool ends empty."""
    from litellm_pipeline.sampling import SamplingParams
    from litellm_pipeline.telemetry import BlocksEvicted, MemorySink

    prompts = ["copy:abcdefgh=", "copy:abcdefgz=", "copy:abcdxyzq=", "rev:abcdefgh=", "copy:abcdefgh=", "12+345="]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ref = build_llm(["cache.enable_prefix_caching=false"]).generate(prompts, params)
    evicted = 0
    with config_name("kv_policy", impl) as cfg:
        for warm in (0, 8):
            llm = build_llm([f"cache.kv_policy={cfg}", "cache.block_size=4", "cache.num_blocks=12",
                             f"cache.warm_blocks={warm}", "engine.max_num_seqs=2"])
            sink = MemorySink()
            llm.engine.bus.subscribe(sink)
            for _ in range(2):  # the second round meets the first round's cached prefixes
                outs = llm.generate(prompts, params)
                for p, o, r in zip(prompts, outs, ref):
                    assert o.token_ids == r.token_ids, (
                        f"kv_policy {name} (warm blocks {warm}): {p!r} generated {o.token_ids}, without prefix "
                        f"caching {r.token_ids}: a block was evicted or reused while its content was still needed"
                    )
            assert_drained(llm, f"kv_policy {name} (warm blocks {warm})")
            evicted += int(sink.total(BlocksEvicted, "num_blocks"))
    assert evicted, f"kv_policy {name}: the engine run never evicted a block, so it proved nothing"
    return evicted


def check_kv_policy(impl: str | type, *, random_runs: int = 20, steps: int = 300, engine: bool = True,
                    seed: int = 0) -> dict[str, int]:
    """Check a ``kv_policy`` class (a registry name or the class) through a real :class:`BlockPool`.

    A constructed sequence (a prefix hit takes back blocks that must then survive an eviction, a full pool refuses,
    every evictable block can be reused), ``random_runs`` random runs of prefix-sharing traffic with discards and
    cache resets, and with ``engine=True`` the demo model on a 12-block pool with and without a warm tier. Every
    ``pop`` is checked against the pool (never a block in use, never one not evictable, None only when nothing is),
    ``len`` / ``in`` against the evictable set, and every run ends with the pool empty (all reference counts 0).
    Returns the evictions seen per part, so a caller can check they happened.
    """
    cls = resolve("kv_policy", impl)
    name = impl if isinstance(impl, str) else describe(impl)
    fresh = cls()
    assert len(fresh) == 0 and fresh.pop() is None, f"kv_policy {name}: a new policy must be empty (pop() -> None)"
    out = {"scripted": _scripted(cls, name),
           "random": sum(_random(cls, name, seed * 1000 + i, steps) for i in range(random_runs))}
    assert out["random"], f"kv_policy {name}: the random runs never evicted a block"
    if engine:
        out["engine"] = _in_engine(impl, name)
    return out
