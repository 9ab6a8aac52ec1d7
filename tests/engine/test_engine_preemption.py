"""Preemption by recompute: a cache too small for the whole batch gives the same tokens as a large one."""

from __future__ import annotations

import pytest
from _engine_util import alone, assert_pool_empty, events, greedy
from hf_models import random_prompts

from litellm_pipeline import SamplingParams


@pytest.mark.parametrize(
    "config",
    [
        dict(block_size=4, num_blocks=16),
        dict(block_size=4, num_blocks=16, max_num_batched_tokens=8),  # preempted while prefilling in chunks
    ],
    ids=["whole-prompts", "chunked"],
)
def test_preemption_recompute_matches_unconstrained(make_llm, config):
    small = make_llm("llama", **config)
    ref = make_llm("llama")
    lengths = [10, 14, 18, 22, 13]
    prompts = random_prompts(lengths, seed=31)
    params = [greedy(20) for _ in range(4)] + [SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True)]
    before = events(small).counts["preempted"]
    outs = small.generate(prompts, params)
    assert events(small).counts["preempted"] > before, "the cache was meant to be too small for the batch"
    for i, (p, sp, o) in enumerate(zip(prompts, params, outs)):
        assert o.token_ids == alone(ref, p, sp).token_ids, f"request {i} changed after preemption"
        assert o.finish_reason == "length" and len(o.token_ids) == 20
    assert_pool_empty(small)


def test_preemption_mid_stream_via_engine(make_llm):
    """Requests arriving one per step into a full cache; every one finishes with its unconstrained tokens."""
    small = make_llm("llama", block_size=4, num_blocks=16)
    ref = make_llm("llama")
    eng = small.engine
    prompts = random_prompts([6, 30, 9, 17, 25, 3], seed=32)
    params = [greedy(n) for n in (30, 12, 24, 16, 20, 28)]
    before = events(small).counts["preempted"]
    ids = []
    for p, sp in zip(prompts, params):
        ids.append(eng.add_request(p, sp).request_id)
        eng.step()
        pool = eng.rt.pool
        held = sum(len(eng.requests[r].block_ids) for r in ids if r in eng.requests)
        assert pool.num_blocks - pool.num_free == held  # every held block belongs to a live request
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
    assert events(small).counts["preempted"] > before
    for rid, p, sp in zip(ids, prompts, params):
        assert final[rid].token_ids == alone(ref, p, sp).token_ids
    assert_pool_empty(small)
