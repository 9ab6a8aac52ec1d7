"""BlockPool: reference-counted KV blocks with a prefix cache; the same structure backs the warm tier."""

from __future__ import annotations

import pytest

from litellm_pipeline.engine.block_pool import BlockPool, NoFreeBlocks
from litellm_pipeline.engine.kv_policy import LFUPolicy, LRUPolicy


@pytest.mark.parametrize("policy_cls", [LRUPolicy, LFUPolicy])
def test_block_pool_keeps_freed_hashed_blocks_until_evicted(policy_cls):
    evicted = []
    pool = BlockPool(4, policy=policy_cls(), on_evict=lambda b, h: evicted.append(h))
    a, b = pool.allocate(2)
    pool.register(a, b"A")
    pool.register(b, b"B")
    pool.free([a, b])
    assert pool.num_free == 4 and pool.lookup(b"A") == a and pool.is_empty()
    pool.acquire(a)  # a prefix hit takes it back
    assert pool.ref_counts[a] == 1 and pool.num_free == 3
    pool.free([a])
    new = pool.allocate(3)  # 2 never-cached blocks first, then one eviction
    assert len(evicted) == 1 and len(set(new)) == 3
    pool.free(new)
    assert pool.is_empty()


def test_allocating_more_than_free_raises_and_double_free_is_caught():
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    assert not pool.can_allocate(1)
    with pytest.raises(NoFreeBlocks, match="asked for 1 KV blocks, 0 free"):
        pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="double free of KV block"):
        pool.free(blocks[:1])
    assert pool.is_empty()


def test_discard_forgets_an_unused_cached_block_and_refuses_one_in_use():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.register(a, b"A")
    with pytest.raises(RuntimeError, match="in use"):
        pool.discard(a)
    pool.free([a])
    assert pool.lookup(b"A") == a and a in pool.policy
    pool.discard(a)
    assert pool.lookup(b"A") is None and a not in pool.policy and pool.num_cached == 0
    assert pool.num_free == 3 and sorted(pool.allocate(3)) == [0, 1, 2]  # it really is free, once


def test_register_keeps_the_first_copy_of_a_content():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.register(a, b"X")
    pool.register(b, b"X")
    assert pool.lookup(b"X") == a and pool.block_hash[b] is None
    pool.free([a, b])
    assert pool.num_cached == 1 and pool.is_empty()


def test_reset_cache_frees_unused_cached_blocks_and_unhashes_used_ones():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.register(a, b"A")
    pool.register(b, b"B")
    pool.free([a])
    pool.reset_cache()
    assert pool.num_cached == 0 and pool.lookup(b"B") is None and pool.num_free == 2
    pool.free([b])
    assert pool.is_empty() and len(pool.policy) == 0
