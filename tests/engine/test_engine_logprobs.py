"""Logprobs: per generated token, a dict holding the sampled token and the top-n, all <= 0."""

from __future__ import annotations

import math

import pytest
from _engine_util import alone, assert_pool_empty, greedy
from hf_models import hf_generate, random_prompts

from litellm_pipeline import SamplingParams


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_logprobs_greedy(make_llm, hf_checkpoint, arch):
    llm = make_llm(arch)
    prompts = random_prompts([9, 26], seed=91)
    outs = llm.generate(prompts, greedy(12, logprobs=3))
    ref = hf_generate(hf_checkpoint(arch), prompts, 12)
    for out, (ref_ids, ref_lps) in zip(outs, ref):
        assert out.token_ids == ref_ids
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        for tok, entry, ref_lp in zip(out.token_ids, out.logprobs, ref_lps):
            assert isinstance(entry, dict) and tok in entry and len(entry) >= 3
            assert all(v <= 0 for v in entry.values())
            assert sum(math.exp(v) for v in entry.values()) <= 1 + 1e-5
            assert entry[tok] == max(entry.values())  # greedy picks the most likely token
            assert abs(entry[tok] - ref_lp) < 1e-3
    # batched logprobs equal the ones alone
    for p, out in zip(prompts, outs):
        solo = alone(llm, p, greedy(12, logprobs=3))
        for a, b in zip(solo.logprobs, out.logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[k] - b[k]) < 1e-4 for k in a)
    assert alone(llm, prompts[0], greedy(4)).logprobs is None
    assert_pool_empty(llm)


def test_logprobs_sampled_and_zero(llama):
    prompt = random_prompts([14], seed=92)[0]
    sp = SamplingParams(temperature=1.5, seed=3, max_tokens=16, ignore_eos=True, logprobs=3)
    out = alone(llama, prompt, sp)
    g = alone(llama, prompt, greedy(16, logprobs=3))
    assert out.token_ids != g.token_ids  # it really sampled
    assert len(out.logprobs) == len(out.token_ids) == 16
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and 3 <= len(entry) <= 4 and all(v <= 0 for v in entry.values())
    # logprobs are of the raw distribution (before temperature): the first step's top-3 match greedy's
    top3 = lambda e: sorted(e, key=e.get, reverse=True)[:3]  # noqa: E731
    assert top3(out.logprobs[0]) == top3(g.logprobs[0])
    for k in top3(g.logprobs[0]):
        assert abs(out.logprobs[0][k] - g.logprobs[0][k]) < 1e-5
    out0 = alone(llama, prompt, greedy(5, logprobs=0))
    assert [list(e) for e in out0.logprobs] == [[t] for t in out0.token_ids]
    assert_pool_empty(llama)


def test_text_offsets_say_where_each_token_s_text_starts(llama):
    """With logprobs, ``text_offsets[k]`` is where token k's text starts: the length of what the streaming
    detokenizer made of the tokens before it, plus what came out with token k from bytes held back before it (a
    character split across tokens starts at its first byte, the token after it after it)."""
    from litellm_pipeline.text.detokenizer import IncrementalDetokenizer

    leads = []
    for seed in (93, 94):
        prompt = random_prompts([11], seed=seed)[0]
        out = alone(llama, prompt, greedy(24, logprobs=0))
        detok, text, want = IncrementalDetokenizer(llama.tokenizer, prompt), "", []
        for t in out.token_ids:
            before = len(text)
            text += detok.add(t)
            want.append(min(before + detok.last_lead, len(text)))
            leads.append(detok.last_lead)
        assert out.text_offsets == want and out.text == text + detok.flush()
    assert any(leads)  # these outputs have tokens that come out after held bytes
    assert alone(llama, prompt, greedy(3)).text_offsets is None  # only with logprobs
    assert_pool_empty(llama)
