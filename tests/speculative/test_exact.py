"""Greedy output with speculation is token for token the output without it: every proposer, every family, the demo
model at every tier; the KV blocks all come back."""

from __future__ import annotations

import pytest
from _engine_util import assert_pool_empty, greedy
from hf_models import ARCHS, random_prompts

from litellm_pipeline import LLM, SamplingParams
from litellm_pipeline.demo import demo_checkpoint

MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
DEMO_PROMPTS = ["copy:abc12x=", "rev:hello=", "sort:39174=", "12+345=", "a3,b7,c1;b", "copy:zz9y8x7w="]


def _prompts():
    ps = random_prompts([5, 12, 9], seed=7)
    ps.append(ps[0] * 3)  # repeats itself: prompt lookup finds something
    return ps


def _proposers(arch, hf_checkpoint):
    out = [("ngram", []), ("draft", [f"speculative.model={hf_checkpoint(arch, seed=1)}"])]
    if arch in MOE:
        out.append(("tier", ["speculative.params.tier=fast"]))
    return out


def _llm(path, *overrides, **kw):
    return LLM(model=str(path), dtype="float32", device="cpu", overrides=list(overrides), **kw)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equal_for_every_proposer_and_family(arch, hf_checkpoint):
    path = hf_checkpoint(arch)
    tier = "max" if arch in MOE else None
    kw = {"tier": tier} if tier else {}
    sp = greedy(24)
    ref = [o.token_ids for o in _llm(path, **kw).generate(_prompts(), sp)]
    for method, extra in _proposers(arch, hf_checkpoint):
        llm = _llm(path, f"speculative={method}", "speculative.disable_by_batch_size=null",
                   "speculative.adaptive=false", *extra, **kw)
        batched = llm.generate(_prompts(), sp)
        assert [o.token_ids for o in batched] == ref, (arch, method)
        alone = [llm.generate(p, sp)[0] for p in _prompts()]
        assert [o.token_ids for o in alone] == ref, (arch, method, "alone")
        drafted = sum(o.num_draft_tokens for o in batched + alone)
        assert drafted > 0, (arch, method)  # it did speculate
        assert all(o.num_accepted_tokens <= o.num_draft_tokens for o in batched)
        assert_pool_empty(llm)
        if method == "draft":
            prop = llm.engine.speculator.proposer
            assert prop.pool.num_free == prop.pool.num_blocks and not prop._seqs


def test_draft_of_itself_accepts_everything(hf_checkpoint):
    path = hf_checkpoint("qwen3")
    llm = _llm(path, "speculative=draft", f"speculative.model={path}", "speculative.k=3", "speculative.adaptive=false")
    out = llm.generate(_prompts()[0], greedy(20))[0]
    assert out.num_draft_tokens > 0 and out.num_accepted_tokens == out.num_draft_tokens
    # 20 tokens: the first from the prompt's step, then 4 steps of 3 drafted + 1 (17), then a draft of 2 that
    # ends at max_tokens with its bonus token: 14 drafted, all kept
    assert out.num_draft_tokens == 14 and len(out.token_ids) == 20


@pytest.mark.parametrize("tier", ["fast", "balanced", "deep", "max"])
def test_demo_model_at_every_tier(tier):
    sp = SamplingParams(temperature=0, max_tokens=20)
    ref = [o.token_ids for o in LLM(tier=tier).generate(DEMO_PROMPTS, sp)]
    for method, extra in [("ngram", []), ("tier", []), ("draft", [f"speculative.model={demo_checkpoint()}"])]:
        llm = LLM(tier=tier, overrides=[f"speculative={method}", "speculative.disable_by_batch_size=null",
                                        "speculative.adaptive=false", *extra])
        outs = llm.generate(DEMO_PROMPTS, sp)
        assert [o.token_ids for o in outs] == ref, (tier, method)
        if method == "tier" and tier != "fast":
            assert sum(o.num_accepted_tokens for o in outs) > 0
        if method == "tier" and tier == "fast":  # its own tier is the draft tier: nothing to gain, no draft
            assert sum(o.num_draft_tokens for o in outs) == 0
        assert_pool_empty(llm)
