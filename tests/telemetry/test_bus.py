"""The event bus: sinks chosen in config (``telemetry=none|memory``), typed events from the engine,
scheduler and KV manager, nothing published when no sink listens."""

from __future__ import annotations

import pytest

from litellm_pipeline import LLM, SamplingParams
from litellm_pipeline.errors import ConfigError, InvalidRequestError
from litellm_pipeline.telemetry import (
    EventBus,
    FirstToken,
    MemorySink,
    NullSink,
    PrefixLookup,
    RequestAborted,
    RequestAdmitted,
    RequestArrived,
    RequestFinished,
    RequestRejected,
    RequestScheduled,
    StepFinished,
    TokensGenerated,
)

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def path(hf_checkpoint):
    return str(hf_checkpoint("mixtral"))


def test_default_bus_is_disabled_and_never_called(path, monkeypatch):
    llm = LLM(model=path)
    bus = llm.engine.bus
    assert not bus.enabled and bus.sinks == ()
    assert llm.engine.rt.scheduler.bus is bus and llm.engine.rt.kv.bus is bus
    calls = []
    monkeypatch.setattr(bus, "publish", lambda e: calls.append(e))
    llm.generate([[1, 2, 3], [4, 5, 6, 7]], GREEDY)
    assert calls == []


def test_memory_sink_sees_the_request_lifecycle(path):
    llm = LLM(model=path, overrides=["telemetry=memory"], block_size=4)
    sink = llm.engine.bus.sink(MemorySink)
    assert isinstance(sink, MemorySink) and sink.events.maxlen == 100000
    prompt = list(range(1, 11))
    (out,) = llm.generate(prompt, GREEDY, tier="fast", tenant="acme", request_id="r1")
    kinds = [e.kind for e in sink.events if getattr(e, "request_id", "r1") == "r1" and e.kind not in ("step", "tokens")]
    assert kinds == ["arrived", "admitted", "tier_selected", "prefix_lookup", "scheduled", "first_token", "costed",
                     "finished"]
    (fin,) = sink.of(RequestFinished)
    assert (fin.reason, fin.prompt_tokens, fin.output_tokens, fin.cached_tokens, fin.tier, fin.tenant) == (
        "length", 10, 5, 0, "fast", "acme"
    )
    assert fin.latency_s >= sink.of(FirstToken)[0].ttft_s >= sink.of(RequestScheduled)[0].queue_time_s >= 0
    assert sink.of(RequestAdmitted)[0].prompt_tokens == 10 and sink.of(RequestArrived)[0].tenant == "acme"
    tokens = sink.of(TokensGenerated)  # one per step after the first token, the gap before each token
    assert [e.request_ids for e in tokens] == [("r1",)] * 4 and all(e.gaps_s[0] >= 0 for e in tokens)
    assert {(e.tenants, e.tiers) for e in tokens} == {(("acme",), ("fast",))}
    steps = sink.of(StepFinished)
    assert len(steps) == 5 and steps[0].prefill_tokens == 10 and steps[0].decode_tokens == 0
    assert all(s.batch_size == 1 and s.duration_s > 0 for s in steps)
    assert sum(s.decode_tokens for s in steps) == 4  # the 5th token is sampled, never fed back
    assert steps[-1].num_running == 0 and steps[-1].free_blocks == llm.engine.rt.pool.num_blocks

    sink.clear()
    (again,) = llm.generate(prompt, GREEDY, tier="fast", tenant="acme")  # the same tier: its K/V is the same
    (hit,) = sink.of(PrefixLookup)
    assert (hit.hit_tokens, hit.miss_tokens) == (8, 2) and again.num_cached_tokens == 8


def test_rejections_and_aborts_are_published(path):
    llm = LLM(model=path, overrides=["telemetry=memory"])
    sink = llm.engine.bus.sink(MemorySink)
    with pytest.raises(InvalidRequestError):
        llm.engine.add_request([1, 2], GREEDY, tier="nope", tenant="t")
    (rej,) = sink.of(RequestRejected)
    assert rej.error == "InvalidRequestError" and "tier: unknown tier 'nope'" in rej.reason and rej.tenant == "t"
    assert not sink.of(RequestAdmitted)
    req = llm.engine.add_request([1, 2, 3], GREEDY)
    llm.engine.step()
    llm.engine.abort(req.request_id)
    (ab,) = sink.of(RequestAborted)
    assert ab.request_id == req.request_id and ab.output_tokens == 1
    assert not sink.of(RequestFinished) and llm.engine.rt.pool.is_empty()


def test_unknown_sink_and_bad_params_are_config_errors(path):
    with pytest.raises(ConfigError, match=r"telemetry.sinks\[0\]: .*'statsd'.*memory.*none"):
        LLM(model=path, **{"telemetry.sinks": ["statsd"]})
    with pytest.raises(ConfigError, match="params given for \\['memory'\\]"):
        LLM(model=path, **{"telemetry.params": {"memory": {"max_events": 5}}})
    with pytest.raises(ConfigError, match="max_events: must be >= 1"):
        LLM(model=path, overrides=["telemetry=memory", "telemetry.params.memory.max_events=0"])


def test_memory_sink_keeps_the_latest_events_but_counts_all():
    sink = MemorySink(max_events=3)
    bus = EventBus([NullSink(), sink])
    assert bus.enabled and bus.sinks == (sink,)
    for i in range(5):
        bus.publish(RequestAborted(f"r{i}", "", i))
    assert sink.counts["aborted"] == 5 and [e.request_id for e in sink.events] == ["r2", "r3", "r4"]
    assert sink.total(RequestAborted, "output_tokens") == 2 + 3 + 4
    bus.unsubscribe(sink)
    assert not bus.enabled
    assert not EventBus([NullSink()]).enabled
