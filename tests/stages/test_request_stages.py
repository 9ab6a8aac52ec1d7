"""Request-level stages (admit, select_tier) run before the request exists in the engine: a request any of
them rejects leaves nothing behind — no queue entry, no blocks, no generator draw, no id."""

from __future__ import annotations

import pytest

from litellm_pipeline import LLM, SamplingParams
from litellm_pipeline.errors import InvalidRequestError

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
HOT = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)  # unseeded: draws from the engine's rng


@pytest.fixture
def llm(hf_checkpoint):
    # fresh per test: the engine's id counter and seed generator are part of what is checked
    return LLM(model=str(hf_checkpoint("mixtral")), dtype="float32", num_blocks=8, block_size=4)


BAD = [
    (dict(prompt=[]), "prompt", "is empty"),
    (dict(prompt=[10**6]), "prompt", "outside the vocabulary"),
    (dict(prompt=list(range(1, 40)) * 100), "prompt", "model's context"),
    (dict(prompt=[1, 2, 3], params=SamplingParams(max_tokens=200)), "params.max_tokens", "KV blocks"),
    (dict(prompt=[1, 2, 3], tier="no-such-tier"), "tier", "unknown tier 'no-such-tier'; known tiers: fast"),
]


def _state(llm: LLM):
    eng = llm.engine
    sched = eng.rt.scheduler
    return (dict(eng.requests), list(sched.waiting), list(sched.running), eng.rt.pool.num_free)


@pytest.mark.parametrize("kwargs, field, text", BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_rejection_leaves_nothing(llm, kwargs, field, text):
    eng = llm.engine
    before = _state(llm)
    kw = dict(kwargs)
    prompt = kw.pop("prompt")
    params = kw.pop("params", GREEDY)
    with pytest.raises(InvalidRequestError) as info:
        eng.add_request(prompt, params, **kw)
    assert info.value.field == field and text in str(info.value)
    assert _state(llm) == before
    # no id was used up and no seed was drawn: what comes next is what would have come without it
    req = eng.add_request([1, 2, 3], HOT)
    assert req.request_id == "req-0"
    while not req.finished:
        eng.step()
    fresh = LLM(model=llm.cfg.model.path, dtype="float32", num_blocks=8, block_size=4)
    ref = fresh.engine.add_request([1, 2, 3], HOT)
    while not ref.finished:
        fresh.engine.step()
    assert req.output_ids == ref.output_ids
    assert eng.rt.pool.is_empty() and not eng.requests


def test_rejected_request_id_is_free_to_use(llm):
    with pytest.raises(InvalidRequestError, match="tier"):
        llm.engine.add_request([1, 2], GREEDY, request_id="mine", tier="nope")
    (out,) = llm.generate([1, 2], GREEDY, request_id="mine")
    assert out.request_id == "mine" and out.finished


def test_duplicate_request_id_is_rejected_and_the_first_keeps_running(llm):
    first = llm.engine.add_request([1, 2, 3], GREEDY, request_id="dup")
    with pytest.raises(InvalidRequestError) as info:
        llm.engine.add_request([4, 5], GREEDY, request_id="dup")
    assert info.value.field == "request_id" and "already in use" in str(info.value)
    while not first.finished:
        llm.engine.step()
    assert len(first.output_ids) == 4 and llm.engine.rt.pool.is_empty()


def test_select_tier_uses_the_request_tier_or_the_configured_default(llm):
    outs = llm.generate([[1, 2, 3], [1, 2, 3]], GREEDY)
    assert [o.tier for o in outs] == ["balanced", "balanced"]
    assert llm.generate([1, 2, 3], GREEDY, tier="fast")[0].tier == "fast"
