"""Liveness: with work pending, every step makes progress or the engine says why — tiny pools, swap
preemption with a warm tier, sessions pinning most of the pool, a request that could never be scheduled."""

from __future__ import annotations

import pytest
from _engine_util import alone, assert_pool_empty, events, greedy
from hf_models import random_prompts

from litellm_pipeline import SamplingParams


@pytest.mark.parametrize(
    "config, lengths, max_tokens",
    [
        (dict(block_size=4, num_blocks=6), [9, 11, 7, 10, 12, 8, 9, 11, 7, 10, 12, 8], 12),
        (dict(block_size=4, num_blocks=4), [5, 6], 10),
        (dict(block_size=4, num_blocks=5, max_num_batched_tokens=4), [9, 11, 6], 8),
    ],
    ids=["12-requests-6-blocks", "2-requests-4-blocks", "chunked-5-blocks"],
)
def test_swap_preemption_in_a_tiny_pool_finishes_everything(make_llm, config, lengths, max_tokens):
    small = make_llm("llama", **config, **{"engine.preemption": "swap", "cache.warm_blocks": 64})
    ref = make_llm("llama")
    prompts = random_prompts(lengths, seed=41)
    params = greedy(max_tokens)
    before = events(small).counts["preempted"]
    outs = small.generate(prompts, params)  # the watchdog fails the test if steps stop making progress
    assert events(small).counts["preempted"] > before, "the pool was meant to be too small"
    for p, o in zip(prompts, outs):
        assert o.token_ids == alone(ref, p, params).token_ids and o.finish_reason == "length"
    assert_pool_empty(small)
    assert small.engine.rt.kv.warm.pool.is_empty()


def test_waiting_requests_never_hold_hot_blocks(make_llm, monkeypatch):
    small = make_llm("llama", block_size=4, num_blocks=6, **{"engine.preemption": "swap", "cache.warm_blocks": 64})
    sched = small.engine.rt.scheduler
    original = sched.schedule

    def schedule():
        plan = original()
        assert all(not r.block_ids for r in sched.waiting), "a waiting request holds hot blocks"
        return plan

    monkeypatch.setattr(sched, "schedule", schedule)
    small.generate(random_prompts([9, 11, 7, 10, 12, 8], seed=42), greedy(12))
    assert_pool_empty(small)


def test_pinned_sessions_give_way_to_a_live_request(make_llm):
    llm = make_llm("llama", block_size=4, num_blocks=8)
    ref = make_llm("llama")
    sink = events(llm)
    turn = llm.generate(random_prompts([22], seed=43)[0], greedy(6), session_id="chat-a")[0]
    assert llm.engine.rt.pool.num_free == 2  # the finished turn pins 6 full blocks
    other = random_prompts([20], seed=44)[0]
    steps = sink.counts["step"]
    out = llm.generate(other, greedy(8))[0]  # needs 7 blocks: the session must be released, at once
    assert out.token_ids == alone(ref, other, greedy(8)).token_ids
    assert sink.counts["step"] - steps == 8  # one prefill step and 7 decode steps: no idle spinning
    assert "chat-a" not in llm.engine.rt.kv.sessions and turn.finish_reason == "length"
    assert_pool_empty(llm)


def test_sessions_are_released_least_recently_used_first(make_llm):
    llm = make_llm("llama", block_size=4, num_blocks=12)
    for sid, seed in (("old", 45), ("new", 46)):
        llm.generate(random_prompts([17], seed=seed)[0], greedy(4), session_id=sid)  # 5 pinned blocks each
    llm.generate(random_prompts([20], seed=47)[0], greedy(4))  # needs 6: one session must go
    assert list(llm.engine.rt.kv.sessions) == ["new"]
    assert llm.engine.end_session("new")
    assert_pool_empty(llm)


def test_a_request_that_can_never_be_scheduled_ends_with_the_reason(make_llm):
    llm = make_llm("llama", block_size=4, num_blocks=8)
    pool = llm.engine.rt.pool
    held = pool.allocate(6)  # blocks held outside any request (as a leak would): only 2 can be freed
    try:
        req = llm.engine.add_request([5, 6, 7, 8, 9, 10, 11, 12, 13], greedy(4))
        outs = llm.engine.step()
        assert [o.request_id for o in outs] == [req.request_id]
        (out,) = outs
        assert out.finished and out.finish_reason == "error"
        assert "cannot be scheduled: it needs 3 KV blocks for its 9 tokens but only 2 of 8 can be freed" in out.error
        assert not llm.engine.has_unfinished()
    finally:
        pool.free(held)
    assert_pool_empty(llm)
    ok = llm.generate([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert ok.finish_reason in ("stop", "length") and ok.error is None


def test_run_steps_until_its_requests_finish_and_names_them_if_the_engine_stalls(make_llm, monkeypatch):
    """Engine.run (the tasks' one step loop): final outputs in the order given, as alone, with on_finish seeing
    each as it finishes, a request finished before the call returned as it is, and others in flight run along;
    an engine whose steps produce nothing raises naming the requests waiting instead of spinning forever."""
    from litellm_pipeline.errors import InternalError

    llm = make_llm("llama")
    engine = llm.engine
    prompts = random_prompts([9, 4, 13], seed=43)
    wants = [alone(llm, p, greedy(n)) for p, n in zip(prompts, (6, 2, 9))]
    early = engine.add_request(prompts[1], greedy(2))
    while not early.finished:
        engine.step()
    other = engine.add_request(prompts[0], greedy(3))
    reqs = [engine.add_request(prompts[0], greedy(6)), early, engine.add_request(prompts[2], greedy(9))]
    seen = []
    outs = engine.run(reqs, on_finish=lambda o: seen.append(o.request_id))
    assert [o.request_id for o in outs] == [r.request_id for r in reqs]
    assert [(o.token_ids, o.text, o.finished) for o in outs] == [(w.token_ids, w.text, True) for w in wants]
    assert sorted(seen) == sorted([reqs[0].request_id, reqs[2].request_id])  # not the one finished before
    engine.run([other])
    assert other.finished and len(other.output_ids) == 3
    assert_pool_empty(llm)

    stuck = engine.add_request(prompts[0], greedy(4))
    monkeypatch.setattr(engine, "step", lambda: [])
    with pytest.raises(InternalError, match=rf"no progress for 1001 steps; waiting: \['{stuck.request_id}'\]"):
        engine.run([stuck])
    monkeypatch.undo()
    engine.abort(stuck.request_id)
    assert_pool_empty(llm)
