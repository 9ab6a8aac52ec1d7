"""RequestSpec: one description of a request that every front end takes, checked when it is made."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from litellm_pipeline import LLM, BudgetSpec, RequestSpec, SamplingParams
from litellm_pipeline.engine.async_engine import AsyncEngine
from litellm_pipeline.errors import InvalidRequestError
from litellm_pipeline.request_spec import FIELDS, to_spec

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def full_spec(request_id: str) -> RequestSpec:
    """A spec whose every field differs from its default (the test below checks that it does)."""
    return RequestSpec(
        prompt=(5, 6, 7, 8),
        params=PARAMS,
        tier="fast",
        budget=BudgetSpec(latency_cost_ms=5000, monetary_cost_units=2.5),
        tenant="acme",
        priority=3,
        session_id=f"session-{request_id}",
        request_id=request_id,
        constraint={"regex": "[0-9a-z]{1,6}"},
        num_speculative_tokens=2,
    )


@pytest.fixture(scope="module")
def llm(hf_checkpoint):
    return LLM(model=str(hf_checkpoint("mixtral")), dtype="float32")


@pytest.fixture
def seen(llm, monkeypatch):
    """Every Request the scheduler is given, as the engine built it."""
    got = []
    sched = llm.engine.rt.scheduler
    original = sched.add

    def add(req):
        got.append(req)
        original(req)

    monkeypatch.setattr(sched, "add", add)
    yield got
    for req in got:
        if req.session_id:
            llm.engine.end_session(req.session_id)
    assert llm.engine.rt.pool.is_empty()


def assert_same_spec(req, spec: RequestSpec) -> None:
    for name in FIELDS:
        assert getattr(req.spec, name) == getattr(spec, name), f"field {name!r} was not passed through"
    # and the engine-side request reads them
    assert (req.tier, req.tenant, req.priority, req.session_id, req.budget) == (
        spec.tier, spec.tenant, spec.priority, spec.session_id, spec.budget
    )
    ks = req.tierset.experts_per_layer  # the cache key: the tenant and, in a MoE model, the TierSet's routing
    assert req.salt == (f"{spec.tenant}\x00{ks}\x00{req.tierset.allowed_experts}" if ks else spec.tenant)
    assert req.request_id == spec.request_id and req.tierset.name == spec.tier


def test_every_field_differs_from_its_default():
    spec = full_spec("x")
    default = RequestSpec(prompt=(5, 6, 7, 8))
    same = [f for f in FIELDS if f != "prompt" and getattr(spec, f) == getattr(default, f)]
    assert not same, f"the test spec leaves {same} at their defaults"


def test_engine_add_request_takes_a_spec(llm, seen):
    spec = full_spec("eng-1")
    req = llm.engine.add_request(spec)
    assert_same_spec(seen[-1], spec)
    while not req.finished:
        llm.engine.step()
    assert req.output_ids and req.finish_reason == "length"


def test_engine_add_request_takes_every_field_as_a_keyword(llm, seen):
    spec = full_spec("eng-2")
    kw = {f: getattr(spec, f) for f in FIELDS if f not in ("prompt", "params")}
    req = llm.engine.add_request(list(spec.prompt), spec.params, **kw)
    assert_same_spec(seen[-1], spec)
    while not req.finished:
        llm.engine.step()


def test_llm_generate_takes_a_spec_and_every_field(llm, seen):
    spec = full_spec("llm-1")
    (out,) = llm.generate(spec)
    assert out.request_id == "llm-1" and out.tier == "fast"
    assert_same_spec(seen[-1], spec)
    spec2 = full_spec("llm-2")
    kw = {f: getattr(spec2, f) for f in FIELDS if f not in ("prompt", "params")}
    (out2,) = llm.generate(list(spec2.prompt), spec2.params, **kw)
    assert_same_spec(seen[-1], spec2)
    assert out2.token_ids == out.token_ids


def test_llm_stream_takes_a_spec_and_every_field(llm, seen):
    spec = full_spec("stream-1")
    deltas = list(llm.stream(spec))
    assert deltas[-1].finish_reason == "length"
    assert_same_spec(seen[-1], spec)
    spec2 = full_spec("stream-2")
    kw = {f: getattr(spec2, f) for f in FIELDS if f not in ("prompt", "params")}
    assert [t for d in llm.stream(list(spec2.prompt), spec2.params, **kw) for t in d.token_ids] == [
        t for d in deltas for t in d.token_ids
    ]
    assert_same_spec(seen[-1], spec2)


def test_async_engine_generate_takes_a_spec_and_every_field(llm, seen):
    spec, spec2 = full_spec("async-a"), full_spec("async-b")
    kw = {f: getattr(spec2, f) for f in FIELDS if f not in ("prompt", "params")}

    async def main():
        async with AsyncEngine(llm.engine) as aeng:
            a = [o async for o in aeng.generate(spec)]
            b = [o async for o in aeng.generate(list(spec2.prompt), spec2.params, **kw)]
            return a, b

    a, b = asyncio.run(asyncio.wait_for(main(), 60))
    assert a[-1].finished and b[-1].finished and a[-1].token_ids == b[-1].token_ids
    assert_same_spec(seen[-2], spec)
    assert_same_spec(seen[-1], spec2)


def test_llm_generate_applies_keyword_fields_to_every_prompt(llm, seen):
    outs = llm.generate([[5, 6, 7], "hello"], PARAMS, tier="max", tenant="t1", priority=2)
    assert [o.tier for o in outs] == ["max", "max"]
    assert [(r.tenant, r.priority) for r in seen] == [("t1", 2), ("t1", 2)]
    with pytest.raises(ValueError, match="request_id"):
        llm.generate([[5, 6], [7, 8]], PARAMS, request_id="same")


@pytest.mark.parametrize(
    "kwargs, field, text",
    [
        (dict(prompt=None), "prompt", "must be a string or a list of token ids (got NoneType)"),
        (dict(prompt=3.5), "prompt", "got float"),
        (dict(prompt={"prompt": "hi"}), "prompt", "got dict"),
        (dict(prompt=[1.9, 6.7]), "prompt", "token ids must be integers (got 1.9)"),
        (dict(prompt=[True, 5]), "prompt", "token ids must be integers (got True)"),
        (dict(prompt=b"abc"), "prompt", "got bytes"),
        (dict(prompt=""), "prompt", "is empty: it must hold at least one token"),  # not a BOS alone
        (dict(prompt=[1], params=3), "params", "must be a SamplingParams or a mapping of its fields (got int)"),
        (dict(prompt=[1], params={"max_tokens": 0}), "params", "max_tokens: must be >= 1 (got 0)"),
        (dict(prompt=[1], budget={"latency_cost_ms": -1}), "budget", "latency_cost_ms: must be > 0"),
        (dict(prompt=[1], budget="cheap"), "budget", "must be a BudgetSpec"),
        (dict(prompt=[1], tier=""), "tier", "must be a non-empty string or None"),
        (dict(prompt=[1], tier=3), "tier", "must be a non-empty string or None (got 3)"),
        (dict(prompt=[1], session_id=["chat-1"]), "session_id", "(got ['chat-1'])"),
        (dict(prompt=[1], request_id=7), "request_id", "(got 7)"),
        (dict(prompt=[1], tenant=None), "tenant", "must be a string (got None)"),
        (dict(prompt=[1], priority=1.5), "priority", "must be an integer (got 1.5)"),
        (dict(prompt=[1], priority=True), "priority", "must be an integer (got True)"),
    ],
)
def test_bad_field_is_named(kwargs, field, text):
    with pytest.raises(InvalidRequestError) as info:
        RequestSpec(**kwargs)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ") and text in str(info.value)
    assert info.value.status_code == 400


def test_spec_normalises_and_is_frozen():
    spec = RequestSpec([1, 2, 3], params={"max_tokens": 4}, budget={"monetary_cost_units": 1})
    assert spec.prompt == (1, 2, 3) and spec.params == SamplingParams(max_tokens=4)
    assert spec.budget == BudgetSpec(monetary_cost_units=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.tier = "max"  # type: ignore[misc]


def test_to_spec_replaces_fields_of_a_spec_and_rejects_unknown_keywords():
    spec = RequestSpec("hi", tier="fast")
    assert to_spec(spec) is spec
    assert to_spec(spec, PARAMS, tier="max") == RequestSpec("hi", PARAMS, tier="max")
    with pytest.raises(TypeError, match="unknown request field.*'salt'.*RequestSpec fields: prompt, params"):
        to_spec("hi", salt="x")


@pytest.mark.parametrize("prompts, text", [({"prompt": "hi"}, "got dict"), (None, "got NoneType"), (7, "got int"),
                                            (b"hi", "got bytes")])
def test_llm_generate_refuses_what_is_not_a_prompt_list(llm, prompts, text):
    with pytest.raises(InvalidRequestError, match=f"^prompts: must be a prompt or a list of prompts \\({text}\\)"):
        llm.generate(prompts, PARAMS)
    assert llm.engine.rt.pool.is_empty() and not llm.engine.requests


def test_a_tensor_prompt_is_refused():
    import torch

    with pytest.raises(InvalidRequestError, match=r"^prompt: must be a string or a list of token ids \(got Tensor\)"):
        RequestSpec(torch.tensor([1, 2, 3]))
