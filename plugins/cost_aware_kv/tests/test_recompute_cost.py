"""recompute_cost: the conformance kit, its eviction order, and what it saves in a real engine."""

from __future__ import annotations

import pytest

plugin = pytest.importorskip(
    "litellm_pipeline_cost_aware_kv", reason="plugin not installed: pip install -e plugins/cost_aware_kv"
)

from litellm_pipeline import SamplingParams, registry  # noqa: E402
from litellm_pipeline.engine.block_pool import BlockPool  # noqa: E402
from litellm_pipeline.testing import check_kv_policy  # noqa: E402
from litellm_pipeline.testing._support import assert_drained, build_llm  # noqa: E402

Policy = plugin.RecomputeCostPolicy


def test_registered_through_its_entry_point():
    assert "recompute_cost" in registry.names("kv_policy")
    assert registry.get("kv_policy", "recompute_cost") is Policy


def test_passes_the_conformance_kit():
    seen = check_kv_policy(Policy)
    assert seen["scripted"] and seen["random"] and seen["engine"]  # it was made to evict everywhere


def chain(policy: Policy, blocks: list[int]) -> None:
    """``blocks`` cached as one prefix chain (depth 1, 2, ...), as the pool reports it."""
    for depth, b in enumerate(blocks, 1):
        policy.describe(b, depth, blocks[depth - 2] if depth > 1 else None)


def test_a_chain_is_peeled_from_its_tail():
    p = Policy()
    chain(p, [0, 1, 2, 3])
    for b in (3, 2, 1, 0):  # the order BlockPool.free adds a request's blocks in
        p.add(b)
    order = []
    while len(p):
        b = p.pop()
        order.append(b)
        p.forget(b)  # the pool drops the content of what it evicts
    assert order == [3, 2, 1, 0]  # never a parent while its child is still cached


def test_the_shallowest_leaf_goes_first_and_the_clock_ages_the_deep_one():
    p = Policy()
    chain(p, [0, 1, 2, 3, 4])  # a deep chain: its leaf (depth 5) is dear to recompute
    for b in (10, 11, 12):
        chain(p, [b])  # one-block prompts (depth 1)
    for b in (4, 3, 2, 1, 0, 10, 11, 12):
        p.add(b)
    assert [p.pop() for _ in range(3)] == [10, 11, 12]  # cheap leaves first, in the order they were freed
    rounds, next_block = 0, 100
    while 4 in p:  # churn: each round two more one-block prompts are freed and two blocks evicted
        rounds += 1
        assert rounds <= 10, "the deep leaf is never evicted: without ageing it would stay forever"
        for _ in range(2):
            chain(p, [next_block])
            p.add(next_block)
            next_block += 1
        for _ in range(2):
            p.forget(p.pop())
    # each eviction lifts the clock by at most the victim's depth (1): the depth-5 leaf outlives 3 rounds
    assert rounds == 4


def test_orphans_go_before_reachable_blocks():
    p = Policy()
    chain(p, [0, 1, 2])
    chain(p, [5, 6])
    for b in (6, 5, 2, 1):  # block 0 stays in use (say, a running request) ...
        p.add(b)
    p.forget(0)  # ... until its content is discarded: 1 and 2 can no longer be reached by a lookup
    order = []
    while len(p):
        order.append(p.pop())
        p.forget(order[-1])
    assert order == [2, 1, 6, 5]  # the orphans (cost 0) before the reachable chain, each from its tail


def test_blocks_never_described_are_least_recently_freed_first():
    p = Policy()
    for b in (7, 3, 9):
        p.add(b)
    p.remove(3)
    p.add(3)
    assert [p.pop(), p.pop(), p.pop(), p.pop()] == [7, 9, 3, None]


def test_through_the_pool_hooks():
    """The pool reports depth and parent when blocks are registered; the policy then evicts the short chain."""
    pool = BlockPool(5, policy=Policy())
    deep, short = pool.allocate(3), pool.allocate(1)
    for depth, b in enumerate(deep, 1):
        pool.register(b, bytes([depth]), depth, deep[depth - 2] if depth > 1 else None)
    pool.register(short[0], b"short", 1, None)
    pool.free(deep)
    pool.free(short)
    (fresh,) = pool.allocate(1)  # the never-used block first
    (victim,) = pool.allocate(1)
    assert fresh not in deep + short and victim == short[0]
    assert all(pool.lookup(bytes([d])) == b for d, b in enumerate(deep, 1))  # the deep chain is still cached
    pool.free([fresh, victim])
    assert pool.is_empty()


def test_keeps_a_long_prefix_that_lru_evicts():
    """One long prompt, then short ones on a pool too small for all: the long prefix survives under recompute_cost
    (most of it comes from the cache when it returns) while lru gave it up; the tokens are the same."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    long_prompt = "copy:abcdefghijklmnopqrstuvwx="
    shorts = ["1+2=", "3+4=", "5+6=", "7+8=", "9+1=", "2+3="]
    cached, tokens = {}, {}
    for policy in ("lru", "recompute_cost"):
        llm = build_llm([f"cache.kv_policy={policy}", "cache.block_size=4", "cache.num_blocks=14",
                         "engine.max_num_seqs=1"])
        first = llm.generate(long_prompt, params)[0]
        for s in shorts:
            llm.generate(s, params)
        again = llm.generate(long_prompt, params)[0]
        cached[policy], tokens[policy] = again.num_cached_tokens, (first.token_ids, again.token_ids)
        assert_drained(llm, policy)
    assert cached["recompute_cost"] >= 24 > cached["lru"], cached
    assert tokens["recompute_cost"] == tokens["lru"]
