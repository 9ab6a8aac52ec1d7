"""engine.deterministic: a request's tokens and logprobs are bit-identical whatever shares its steps.

Each target request runs alone, then inside batches of 2, 8 and 64 requests, in shuffled arrival orders,
with a small token budget so other requests' prompt chunks share the target's steps (and its own prompt is
chunked differently), greedy and seeded sampling, dense and MoE; for the MoE model the other requests run at
other tiers, so the steps carry per-token expert limits. Everything is compared with ``==``, not a tolerance.
"""

from __future__ import annotations

import random

import pytest
from _engine_util import assert_pool_empty
from hf_models import random_prompts

from litellm_pipeline import SamplingParams
from litellm_pipeline.errors import ConfigError
from litellm_pipeline.request_spec import RequestSpec

TARGETS = random_prompts([5, 23, 41], seed=401)
PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5),
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=11, max_tokens=10, ignore_eos=True, logprobs=5),
}
TIERS = ("fast", "balanced", "deep", "max")


def _fill(n: int, seed: int, tiered: bool) -> list[RequestSpec]:
    rng = random.Random(seed)
    prompts = random_prompts([rng.randint(3, 60) for _ in range(n)], seed=seed)
    specs = []
    for i, p in enumerate(prompts):
        sp = SamplingParams(temperature=rng.choice([0.0, 1.0]), seed=rng.randint(0, 99), max_tokens=rng.randint(2, 14),
                            ignore_eos=True, logprobs=rng.choice([None, 2]))
        specs.append(RequestSpec(prompt=p, params=sp, tier=rng.choice(TIERS) if tiered else None))
    return specs


def _result(out) -> tuple:
    return out.token_ids, out.logprobs


@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen2_moe"])  # qwen2_moe: a gated shared expert
def test_tokens_and_logprobs_are_bit_identical_in_any_batch(make_llm, arch):
    llm = make_llm(arch, **{"engine.deterministic": True, "max_num_batched_tokens": 48})
    tiered = arch != "llama"
    for kind, params in PARAMS.items():
        solo = [_result(llm.generate(RequestSpec(prompt=p, params=params, tier="balanced"))[0]) for p in TARGETS]
        for size, seed in ((2, 1), (8, 2), (64, 3)):
            batch = [RequestSpec(prompt=p, params=params, tier="balanced") for p in TARGETS][:size]
            batch += _fill(size - len(batch), seed, tiered)
            order = list(range(len(batch)))
            random.Random(seed).shuffle(order)
            outs = llm.generate([batch[i] for i in order])
            got = {i: _result(o) for i, o in zip(order, outs)}
            for t in range(min(size, len(TARGETS))):
                assert got[t] == solo[t], f"{arch} {kind}: target {t} differs in a batch of {size}"
    assert_pool_empty(llm)


def test_the_default_mode_is_not_batch_invariant_where_the_gemm_differs(make_llm):
    """The check above can fail: without the mode, a prompt prefilled with others (one big GEMM) gets
    logprobs that differ in the last bits from the ones it gets alone, on at least one of these prompts."""
    llm = make_llm("llama", max_num_batched_tokens=2048)
    params = PARAMS["greedy"]
    prompts = random_prompts([40, 52, 61, 37, 44], seed=402)
    solo = [_result(llm.generate(p, params)[0]) for p in prompts]
    together = [_result(o) for o in llm.generate(prompts, params)]
    assert any(a[1] != b[1] for a, b in zip(solo, together))
    assert all(a[0] == b[0] for a, b in zip(solo, together))  # same tokens, different last bits


def test_deterministic_mode_refuses_an_attention_that_depends_on_the_batch(make_llm):
    with pytest.raises(ConfigError, match=r"engine.deterministic.*cpu_paged.*'sdpa'"):
        make_llm("llama", **{"engine.deterministic": True, "pipeline.stages.decode.params.attention": "sdpa"})


def test_the_demo_model_in_bfloat16_is_bit_identical_in_any_batch():
    """The shipped checkpoint (bf16 MoE) with requests of every tier around the targets."""
    from litellm_pipeline import LLM
    from litellm_pipeline.demo.skills import heldout

    llm = LLM(dtype="bfloat16", max_num_batched_tokens=24, **{"engine.deterministic": True})
    prompts = [e.prompt for e in heldout(8, seed=5)]
    targets, others = prompts[:3], prompts[3:]
    params = PARAMS["seeded"]
    solo = [_result(llm.generate(RequestSpec(prompt=p, params=params, tier="deep"))[0]) for p in targets]
    rng = random.Random(9)
    batch = [RequestSpec(prompt=p, params=params, tier="deep") for p in targets]
    batch += [RequestSpec(prompt=rng.choice(others), params=PARAMS["greedy"], tier=rng.choice(TIERS)) for _ in range(29)]
    order = list(range(len(batch)))
    rng.shuffle(order)
    got = {i: _result(o) for i, o in zip(order, llm.generate([batch[i] for i in order]))}
    assert [got[i] for i in range(3)] == solo
    assert_pool_empty(llm)


def test_preemption_and_prefix_hits_keep_the_bits(make_llm):
    """A tiny KV pool (requests are preempted and recomputed) and shared prefixes (KV from the prefix cache)."""
    llm = make_llm("mixtral", **{"engine.deterministic": True, "max_num_batched_tokens": 32, "num_blocks": 20,
                                 "block_size": 4})
    params = PARAMS["seeded"]
    solo = [_result(llm.generate(RequestSpec(prompt=p, params=params, tier="balanced"))[0]) for p in TARGETS]
    shared = [TARGETS[i % 3][: 4 * (1 + i % 3)] + p for i, p in enumerate(random_prompts([6] * 12, seed=403))]
    batch = [RequestSpec(prompt=p, params=params, tier="balanced") for p in TARGETS]
    batch += [RequestSpec(prompt=p, params=PARAMS["greedy"], tier=TIERS[i % 4]) for i, p in enumerate(shared)]
    sched = llm.engine.rt.scheduler
    preempted = []
    original = sched.preempt
    sched.preempt = lambda req: (preempted.append(req.request_id), original(req))[1]
    try:
        outs = llm.generate(batch)
    finally:
        sched.preempt = original
    assert preempted  # the pool really was too small
    assert [_result(o) for o in outs[:3]] == solo
    assert_pool_empty(llm)
