"""KVCacheManager: prefix hashes, the step's KV layout it hands to stages, the warm tier, swap, sessions."""

from __future__ import annotations

import hashlib
from array import array

import torch

from litellm_pipeline.engine.block_pool import BlockPool
from litellm_pipeline.engine.kv_cache_manager import (
    KVCacheManager,
    WarmPool,
    hash_block,
)
from litellm_pipeline.engine.request import Request
from litellm_pipeline.request_spec import RequestSpec
from litellm_pipeline.telemetry import EventBus, MemorySink, PrefixLookup

BS = 4


def kv_tensors(num_blocks: int, layers: int = 2) -> list:
    """Per layer a K and a V tensor whose every slot holds a distinct value (so copies are checkable)."""
    n = num_blocks * BS
    return [(torch.arange(n, dtype=torch.float32).view(n, 1, 1) + 1000 * li + 1, torch.zeros(n, 1, 1))
            for li in range(layers)]


def make_req(prompt, tenant: str = "") -> Request:
    r = Request(RequestSpec(tuple(prompt), tenant=tenant), list(prompt))
    r.request_id = f"r{id(r)}"
    return r


def manager(num_blocks=8, warm_blocks=0, bus=None) -> KVCacheManager:
    warm = WarmPool(BlockPool(warm_blocks), kv_tensors(warm_blocks), BS) if warm_blocks else None
    return KVCacheManager(BlockPool(num_blocks), kv_tensors(num_blocks), BS, warm, bus=bus)


def test_block_hash_is_chained_salted_sha256():
    toks = [5, 6, 7, 8]
    expect = hashlib.sha256(b"")
    expect.update(b"tenant-a\x00")
    expect.update(array("q", toks).tobytes())
    assert hash_block(b"", toks, "tenant-a") == expect.digest()
    assert hash_block(b"", toks, "tenant-b") != hash_block(b"", toks, "tenant-a")
    h1 = hash_block(b"", toks, "")
    assert hash_block(h1, toks, "") != hash_block(hash_block(b"", [9, 9, 9, 9], ""), toks, "")


def test_step_layout_gives_slots_through_each_block_table():
    kv = manager(num_blocks=8)
    chunk, dec_a, dec_b = make_req(range(1, 11)), make_req(range(20, 26)), make_req([30])
    for r, n in ((chunk, 10), (dec_a, 6), (dec_b, 1)):
        assert kv.grow(r, n)
    dec_a.num_computed = 5  # its 6th token is this step's single new token
    chunk.num_computed = 3  # a chunk of 7 tokens after 3 cached ones
    layout = kv.step_layout([(chunk, 7), (dec_a, 1), (dec_b, 1)])

    def slot(r, pos):
        return r.block_ids[pos // BS] * BS + pos % BS

    (c,) = layout.chunk_slots
    assert c.tolist() == [slot(chunk, p) for p in range(10)]
    assert layout.decode_ctx_lens.tolist() == [6, 1]
    assert layout.decode_slots.shape == (2, 6)
    assert layout.decode_slots[0].tolist() == [slot(dec_a, p) for p in range(6)]
    assert layout.decode_slots[1, 0].item() == slot(dec_b, 0)
    assert layout.decode_new_slots.tolist() == [slot(dec_a, 5), slot(dec_b, 0)]
    only_chunks = kv.step_layout([(chunk, 7)])
    assert only_chunks.decode_slots is None and len(only_chunks.chunk_slots) == 1


def test_step_layout_of_one_decoding_sequence_follows_its_blocks():
    """A sequence decoding alone gets its slots from a row kept between steps: right across block boundaries,
    when another sequence decodes alone in between, and after its blocks were freed and allocated anew."""
    kv = manager(num_blocks=8)
    a, other = make_req(range(1, 4)), make_req(range(40, 43))
    assert kv.grow(other, 3)

    def slot(r, pos):
        return r.block_ids[pos // BS] * BS + pos % BS

    def check(r, n):
        r.num_computed = n - 1
        layout = kv.step_layout([(r, 1)])
        assert layout.decode_ctx_lens.tolist() == [n]
        assert layout.decode_slots.tolist() == [[slot(r, p) for p in range(n)]]
        assert layout.decode_new_slots.tolist() == [slot(r, n - 1)]

    for n in range(3, 3 * BS + 1):  # across three block boundaries
        assert kv.grow(a, n)
        check(a, n)
        if n % 3 == 0:
            check(other, 3)  # another sequence alone in between
    kv.free(a)
    assert kv.grow(other, 2 * BS)  # takes blocks a had
    assert kv.grow(a, 5)  # new blocks, a new list
    check(a, 5)
    assert layout_equals_batched(kv, a, 5)


def layout_equals_batched(kv, r, n):
    """A lone sequence's decode slots equal its row of a two-sequence step (the general path)."""
    r.num_computed = n - 1
    alone = kv.step_layout([(r, 1)]).decode_slots[0]
    return alone.tolist() == kv.step_layout([(r, 1), (r, 1)]).decode_slots[0, :n].tolist()


def test_prefix_lookup_is_published_once_per_request():
    sink = MemorySink()
    kv = manager(num_blocks=8, bus=EventBus([sink]))
    a = make_req(range(1, 14))
    kv.acquire_prefix(a)
    kv.grow(a, 13)
    a.num_computed = 13
    kv.commit(a)
    kv.free(a)
    b = make_req(range(1, 14))
    assert kv.acquire_prefix(b) == 12  # three full blocks; the last token is always recomputed
    kv.free(b)
    b.num_computed = 0
    kv.acquire_prefix(b)  # looked up again (e.g. after waiting for room): not counted twice
    kv.free(b)
    hits = [(e.hit_tokens, e.miss_tokens) for e in sink.of(PrefixLookup)]
    assert hits == [(0, 13), (12, 1)]
    assert kv.hot.is_empty()


def test_warm_pool_keeps_evicted_blocks_and_promotes_them_back():
    kv = manager(num_blocks=3, warm_blocks=4)
    a = make_req(range(1, 10))  # 2 full blocks + 1 token
    kv.acquire_prefix(a)
    kv.grow(a, 9)
    a.num_computed = 9
    kv.commit(a)
    k_before = [kv.hot_kv[0][0][b * BS : (b + 1) * BS].clone() for b in a.block_ids[:2]]
    kv.free(a)
    other = make_req(range(50, 62))
    kv.grow(other, 12)  # takes every hot block: the two cached ones are evicted into the warm pool
    assert kv.warm.pool.num_cached == 2 and kv.hot.num_cached == 0
    kv.free(other)
    b = make_req(range(1, 10))
    assert kv.acquire_prefix(b) == 8  # both blocks promoted from the warm tier
    for blk, before in zip(b.block_ids, k_before):
        assert torch.equal(kv.hot_kv[0][0][blk * BS : (blk + 1) * BS], before)
    assert kv.warm.pool.num_cached == 0 and kv.warm.pool.is_empty()
    kv.free(b)
    assert kv.hot.is_empty()


def test_swap_out_and_in_restores_the_content():
    kv = manager(num_blocks=4, warm_blocks=4)
    r = make_req(range(1, 9))
    kv.grow(r, 8)
    content = torch.cat([kv.hot_kv[1][0][b * BS : (b + 1) * BS] for b in r.block_ids]).clone()
    assert kv.swap_out(r)
    assert r.block_ids == [] and kv.warm.num_held == 2 and kv.hot.is_empty()
    hog = make_req(range(100, 108))
    kv.grow(hog, 8)
    kv.hot_kv[1][0].fill_(-1)  # the hot content is gone
    kv.free(hog)
    assert kv.swap_in(r)
    assert torch.equal(torch.cat([kv.hot_kv[1][0][b * BS : (b + 1) * BS] for b in r.block_ids]), content)
    assert kv.warm.num_held == 0
    kv.free(r)
    assert kv.hot.is_empty() and kv.warm.pool.is_empty()


def test_swap_out_without_room_in_the_warm_pool_is_refused():
    kv = manager(num_blocks=4, warm_blocks=1)
    r = make_req(range(1, 9))
    kv.grow(r, 8)
    assert not kv.swap_out(r) and len(r.block_ids) == 2
    kv.free(r)
    assert kv.hot.is_empty() and kv.warm.pool.is_empty()


def test_session_pins_full_blocks_until_it_ends():
    kv = manager(num_blocks=6)
    r = make_req(range(1, 11))
    kv.grow(r, 10)
    r.num_computed = 10
    kv.commit(r)
    kv.pin_session("s", r)
    kv.free(r)
    assert kv.hot.num_free == 4  # two full blocks stay referenced by the session
    assert kv.end_session("s") and not kv.end_session("s")
    assert kv.hot.is_empty()


def test_promotion_survives_the_warm_pool_evicting_while_the_hot_block_is_found():
    """Allocating the hot block for a promotion can demote another hot block into a full warm pool; that
    must not evict the very warm block being promoted."""
    kv = manager(num_blocks=2, warm_blocks=1)
    a = make_req(range(1, 6))  # one full block + 1 token
    kv.acquire_prefix(a)
    kv.grow(a, 5)
    a.num_computed = 5
    kv.commit(a)
    kv.free(a)
    filler = make_req(range(40, 48))  # two full blocks: evicts a's block into the warm pool
    kv.grow(filler, 8)
    filler.num_computed = 8
    kv.commit(filler)
    kv.free(filler)  # both filler blocks cached in the hot pool, a's in the (full) warm pool
    assert kv.warm.pool.num_cached == 1 and kv.hot.num_cached == 2
    b = make_req(range(1, 6))
    assert kv.acquire_prefix(b) == 4  # the hot allocation demotes a filler block; a's block is kept for b
    kv.free(b)
    assert kv.hot.is_empty() and kv.warm.pool.is_empty()
