"""Abort: the request's KV blocks come back at once and the other requests are untouched."""

from __future__ import annotations

from _engine_util import alone, assert_pool_empty, greedy, run_engine
from hf_models import random_prompts


def test_abort_mid_generation(llama):
    eng, pool = llama.engine, llama.engine.rt.pool
    prompts = random_prompts([30, 50, 70], seed=41)
    sp = greedy(20)
    reqs = [eng.add_request(p, sp) for p in prompts]
    for _ in range(4):
        eng.step()
    victim = reqs[1]
    assert len(victim.output_ids) == 4
    nblocks = len(victim.block_ids)
    assert nblocks > 0
    free_before = pool.num_free
    out = eng.abort(victim.request_id)
    assert pool.num_free == free_before + nblocks, "the aborted request's blocks were not freed at once"
    assert victim.block_ids == []
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert out.token_ids == victim.output_ids and len(out.token_ids) == 4
    assert eng.abort(victim.request_id) is None  # a second abort is a no-op
    assert pool.num_free == free_before + nblocks
    final, per_step = run_engine(eng, [reqs[0].request_id, reqs[2].request_id])
    assert all(victim.request_id not in step for step in per_step), "an aborted request still produced output"
    for i in (0, 2):
        assert final[reqs[i].request_id].token_ids == alone(llama, prompts[i], sp).token_ids
    assert_pool_empty(llama)


def test_abort_unknown_and_waiting(llama):
    eng, pool = llama.engine, llama.engine.rt.pool
    assert eng.abort("no-such-request") is None
    p = random_prompts([12], seed=42)[0]
    req = eng.add_request(p, greedy(5), request_id="waiting-one")
    assert req in eng.rt.scheduler.waiting and pool.is_empty()  # not scheduled yet: holds no blocks
    out = eng.abort("waiting-one")
    assert out.finish_reason == "abort" and out.token_ids == []
    assert req not in eng.rt.scheduler.waiting
    assert eng.step() == []
    # the id is free again
    again = eng.add_request(p, greedy(5), request_id="waiting-one")
    final, _ = run_engine(eng, [again.request_id])
    assert final["waiting-one"].token_ids == alone(llama, p, greedy(5)).token_ids
    assert_pool_empty(llama)


def test_abort_while_prefilling_in_chunks(make_llm):
    llm = make_llm("llama", max_num_batched_tokens=16)
    ref = make_llm("llama")
    eng, pool = llm.engine, llm.engine.rt.pool
    short_p, long_p = random_prompts([8, 150], seed=43)
    short = eng.add_request(short_p, greedy(24))
    long = eng.add_request(long_p, greedy(8))
    for _ in range(4):
        eng.step()
    assert 0 < long.num_computed < len(long_p) and long.output_ids == []
    nblocks, free_before = len(long.block_ids), pool.num_free
    assert nblocks > 0
    eng.abort(long.request_id)
    assert pool.num_free == free_before + nblocks
    final, _ = run_engine(eng, [short.request_id])
    assert final[short.request_id].token_ids == alone(ref, short_p, greedy(24)).token_ids
    assert_pool_empty(llm)


def test_generate_interrupted_aborts_its_requests(llama, monkeypatch):
    """An exception raised inside generate's stepping (e.g. KeyboardInterrupt) frees every request."""
    eng = llama.engine
    real_step, calls = eng.step, []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(eng, "step", step)
    prompts = random_prompts([10, 20], seed=44)
    try:
        llama.generate(prompts, greedy(10))
    except KeyboardInterrupt:
        pass
    else:  # pragma: no cover
        raise AssertionError("the interrupt was swallowed")
    assert_pool_empty(llama)
