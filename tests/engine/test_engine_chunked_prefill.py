"""Chunked prefill: prompts longer than the step budget are computed over several steps, interleaved
with the decodes of running requests, and give the tokens of an unchunked run."""

from __future__ import annotations

from _engine_util import alone, assert_pool_empty, greedy, record_schedules, run_engine
from hf_models import random_prompts

BUDGET = 16


def test_chunked_equals_unchunked(make_llm, monkeypatch):
    chunked = make_llm("llama", max_num_batched_tokens=BUDGET)
    ref = make_llm("llama")
    lengths = [17, 40, 75, 130, 4]
    prompts = random_prompts(lengths, seed=21)
    params = [greedy(n) for n in (10, 6, 12, 8, 14)]
    plans = record_schedules(monkeypatch, chunked)
    outs = chunked.generate(prompts, params)
    for i, (p, sp, o) in enumerate(zip(prompts, params, outs)):
        assert o.token_ids == alone(ref, p, sp).token_ids, f"prompt {i} (length {lengths[i]})"
        assert len(o.token_ids) == sp.max_tokens
    assert plans and max(sum(n for _, n in plan) for plan in plans) <= BUDGET
    # the 130-token prompt was split into chunks: at least 8 steps each computed part of it
    long_id = outs[3].request_id
    assert sum(1 for plan in plans for rid, n in plan if rid == long_id and n > 1) >= 8
    for i, p in enumerate(prompts):  # one by one, too
        assert alone(chunked, p, params[i]).token_ids == outs[i].token_ids
    assert_pool_empty(chunked)


def test_decode_continues_while_long_prompt_prefills(make_llm, monkeypatch):
    llm = make_llm("llama", max_num_batched_tokens=BUDGET)
    ref = make_llm("llama")
    eng = llm.engine
    short_p, long_p = random_prompts([5, 200], seed=22)
    short_sp, long_sp = greedy(40), greedy(4)
    short = eng.add_request(short_p, short_sp)
    for _ in range(3):
        eng.step()
    assert len(short.output_ids) == 3
    long = eng.add_request(long_p, long_sp)
    plans = record_schedules(monkeypatch, llm)
    mixed_steps = 0
    while long.num_computed < len(long_p):
        before = long.num_computed
        outs = {o.request_id: o for o in eng.step()}
        plan = dict(plans[-1])
        assert len(outs[short.request_id].delta_token_ids) == 1, "the decoding request stalled"
        assert plan[short.request_id] == 1
        if long.num_computed < len(long_p):
            assert long.request_id not in outs, "a token was sampled before the prompt was complete"
            assert 0 < long.num_computed - before == plan[long.request_id] <= BUDGET - 1
            mixed_steps += 1
        else:
            assert len(outs[long.request_id].delta_token_ids) == 1  # the last chunk samples the first token
    assert mixed_steps >= 12  # 200 tokens at <= 15 per step
    final, _ = run_engine(eng, [short.request_id, long.request_id])
    assert final[short.request_id].token_ids == alone(ref, short_p, short_sp).token_ids
    assert final[long.request_id].token_ids == alone(ref, long_p, long_sp).token_ids
    assert_pool_empty(llm)
