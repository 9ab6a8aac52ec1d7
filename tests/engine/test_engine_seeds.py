"""Seeded sampling is a property of the request: the batch around it does not change its tokens."""

from __future__ import annotations

from _engine_util import alone, assert_pool_empty, greedy
from hf_models import random_prompts

from litellm_pipeline import SamplingParams

N = 24


def seeded(seed, temperature=0.8) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=N, ignore_eos=True)


def test_seed_reproducible_alone_and_batched(make_llm):
    llm = make_llm("llama")
    prompt, *others = random_prompts([20, 7, 33, 12], seed=71)
    solo = alone(llm, prompt, seeded(7))
    assert alone(llm, prompt, seeded(7)).token_ids == solo.token_ids
    assert solo.token_ids != alone(llm, prompt, greedy(N)).token_ids  # it really sampled
    other_params = [seeded(1), SamplingParams(temperature=1.0, max_tokens=N, ignore_eos=True), seeded(None, 0.5)]
    batch = llm.generate([prompt, *others], [seeded(7), *other_params])
    assert batch[0].token_ids == solo.token_ids
    batch = llm.generate([*others, prompt], [*other_params, seeded(7)])  # another row position
    assert batch[-1].token_ids == solo.token_ids
    assert_pool_empty(llm)


def test_seed_reproducible_with_moe_and_mixed_steps(make_llm):
    llm = make_llm("mixtral")
    eng = llm.engine
    prompt, *others = random_prompts([20, 7, 33, 12], seed=72)
    solo = alone(llm, prompt, seeded(7))
    ids = [eng.add_request(p, seeded(None, 1.0)).request_id for p in others[:2]]
    eng.step()
    eng.step()
    rid = eng.add_request(prompt, seeded(7)).request_id
    ids.append(eng.add_request(others[2], seeded(3)).request_id)
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
    assert final[rid].token_ids == solo.token_ids
    assert_pool_empty(llm)


def test_different_seeds_differ(make_llm):
    llm = make_llm("llama")
    prompt = random_prompts([20], seed=73)[0]
    outs = [alone(llm, prompt, seeded(s)).token_ids for s in (7, 8, 9)]
    assert len({tuple(o) for o in outs}) == 3
    # in one batch, the same prompt with different seeds
    batch = llm.generate([prompt] * 3, [seeded(7), seeded(8), seeded(9)])
    assert [b.token_ids for b in batch] == outs
    assert_pool_empty(llm)
