"""Replayable prefixes, hot/warm KV tiers, swap preemption and sessions, end to end through the engine."""

from __future__ import annotations

import time

import pytest
from _engine_util import events
from hf_models import random_prompts

from litellm_pipeline import LLM, SamplingParams
from litellm_pipeline.telemetry import BlocksPromoted, RequestPreempted

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def run(llm, prompt, params=GREEDY, **kw):
    req = llm.engine.add_request(prompt, params, **kw)
    while True:
        for out in llm.engine.step():
            if out.request_id == req.request_id and out.finished:
                return out


@pytest.fixture(scope="module")
def ckpt(hf_checkpoint):
    return str(hf_checkpoint("mixtral"))


@pytest.fixture(scope="module")
def fresh(ckpt):
    """Reference outputs from an engine without any prefix cache."""
    llm = LLM(model=ckpt, **{"cache.enable_prefix_caching": False})
    return lambda prompt, params=GREEDY: run(llm, prompt, params).token_ids


def test_prefix_hit_skips_prefill_and_keeps_output(ckpt, fresh):
    llm = LLM(model=ckpt, block_size=16)
    shared = random_prompts((70,), seed=11)[0]
    a = run(llm, shared + [40, 41, 42])
    assert a.num_cached_tokens == 0
    b = run(llm, shared + [50, 51])
    assert b.num_cached_tokens == 64  # 4 full blocks of the 70 shared tokens
    assert b.token_ids == fresh(shared + [50, 51])
    again = run(llm, shared + [40, 41, 42])  # whole prompt cached but one block recomputed for logits
    assert again.num_cached_tokens == 64 and again.token_ids == a.token_ids
    assert llm.engine.rt.pool.is_empty()


def test_tenants_never_share_blocks(ckpt):
    llm = LLM(model=ckpt, block_size=16)
    p = random_prompts((40,), seed=12)[0]
    run(llm, p, tenant="tenant-a")
    assert run(llm, p, tenant="tenant-b").num_cached_tokens == 0
    assert run(llm, p, tenant="tenant-a").num_cached_tokens == 32


def test_moe_tiers_never_share_blocks_dense_tiers_do(ckpt, hf_checkpoint):
    """A MoE model's K/V depends on the experts that computed it: a request at another TierSet recomputes the
    prefix and gets its own tier's tokens; the same tier finds it. A dense model's tiers route nothing: they share."""
    llm = LLM(model=ckpt, block_size=16)
    p = random_prompts((40,), seed=81)[0]
    run(llm, p, tier="fast")  # fills the cache with K/V computed by one expert per token
    balanced = run(llm, p, tier="balanced")
    assert balanced.num_cached_tokens == 0
    alone = run(LLM(model=ckpt, **{"cache.enable_prefix_caching": False}), p, tier="balanced")
    assert balanced.token_ids == alone.token_ids
    assert run(llm, p, tier="fast").num_cached_tokens == run(llm, p, tier="balanced").num_cached_tokens == 32
    assert llm.engine.rt.pool.is_empty()
    dense = LLM(model=str(hf_checkpoint("llama")), block_size=16)
    run(dense, p, tier="fast")
    assert run(dense, p, tier="balanced").num_cached_tokens == 32


def test_prefix_caching_can_be_turned_off(ckpt):
    llm = LLM(model=ckpt, **{"cache.enable_prefix_caching": False})
    p = random_prompts((40,), seed=13)[0]
    run(llm, p)
    assert run(llm, p).num_cached_tokens == 0


def test_evicted_prefix_comes_back_from_the_warm_tier(ckpt, fresh):
    llm = LLM(model=ckpt, block_size=8, num_blocks=12, **{"cache.warm_blocks": 16})
    kv = llm.engine.rt.kv
    sink = events(llm)
    shared = random_prompts((40,), seed=14)[0]
    run(llm, shared + [7])  # 5 full blocks cached in the hot pool
    for filler in random_prompts((80, 80), seed=15):  # pressure: evicts them, warm keeps them
        run(llm, filler, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert sink.counts["evicted"] > 0 and sink.counts["demoted"] > 0 and kv.warm.pool.num_cached > 0
    assert kv.hot.lookup(kv.block_hashes(llm.engine.add_request(shared, GREEDY), 8)[0]) is None
    llm.engine.abort(next(iter(llm.engine.requests)))
    out = run(llm, shared + [9])
    assert out.num_cached_tokens == 40
    assert sink.total(BlocksPromoted, "num_blocks") == 5
    assert out.token_ids == fresh(shared + [9])
    assert llm.engine.rt.pool.is_empty() and kv.warm.num_held == 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_outputs(ckpt, fresh, mode):
    llm = LLM(model=ckpt, block_size=4, num_blocks=24, **{"engine.preemption": mode, "cache.warm_blocks": 64})
    prompts = random_prompts((20, 28, 12, 33), seed=16)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    sink = events(llm)
    outs = llm.generate(prompts, params)
    modes = {e.mode for e in sink.of(RequestPreempted)}
    assert modes == {mode}, f"preemptions by {modes}, expected only {mode}"
    assert [o.token_ids for o in outs] == [fresh(p, params) for p in prompts]
    assert llm.engine.rt.pool.is_empty() and llm.engine.rt.kv.warm.num_held == 0


def test_session_keeps_the_conversation_hot(ckpt):
    llm = LLM(model=ckpt, block_size=8, **{"cache.session_ttl_s": 0.5})
    pool = llm.engine.rt.pool
    turn1 = random_prompts((30,), seed=18)[0]
    out1 = run(llm, turn1, session_id="chat-1")
    assert not pool.is_empty()  # pinned for the next turn
    turn2 = turn1 + out1.token_ids + [60, 61, 62]
    out2 = run(llm, turn2, session_id="chat-1")
    assert out2.num_cached_tokens == (len(turn1) + len(out1.token_ids)) // 8 * 8
    assert llm.engine.end_session("chat-1") and pool.is_empty()
    run(llm, turn1, session_id="chat-2")
    time.sleep(0.6)
    llm.engine.rt.scheduler.schedule()  # each step first expires old sessions
    assert pool.is_empty()