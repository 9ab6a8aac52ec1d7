"""Tenant quotas through the Python API: the admit stage enforces them, a refusal names the quota and leaves
nothing behind (no queue entry, no KV block, no quota used), the engine settles what a request held when it ends,
and other tenants are never affected.

One demo engine serves every test; each test installs a fresh :class:`TenantLedger` with a clock it moves by
hand, so the token buckets refill only when a test says so."""

from __future__ import annotations

import pytest
from _engine_util import assert_pool_empty, greedy

from litellm_pipeline import LLM, SamplingParams
from litellm_pipeline.engine.tenants import TenantLedger, TenantPolicy
from litellm_pipeline.errors import (
    InvalidRequestError,
    OverloadedError,
    RateLimitedError,
)
from litellm_pipeline.telemetry.prometheus import PrometheusSink

PROMPT = "12+345="


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def llm():
    return LLM(overrides=["+recipe=generate", "device.threads=1"])


@pytest.fixture
def quotas(llm):
    """``quotas(**policy)``: tenant ``acme`` gets that policy (every other tenant has none); returns the ledger,
    whose ``clock.t`` a test advances."""
    rt = llm.engine.rt

    def install(**policy) -> TenantLedger:
        rt.tenants = TenantLedger({"acme": TenantPolicy("acme", **policy)}, clock=Clock())
        return rt.tenants

    yield install
    for rid in list(llm.engine.requests):
        llm.engine.abort(rid)
    rt.tenants = None


def run(llm, *reqs):
    while llm.engine.has_unfinished():
        llm.engine.step()
    return reqs


def prompt_len(llm) -> int:
    return len(llm.tokenizer.encode(PROMPT))


def test_requests_per_minute(llm, quotas):
    ledger = quotas(requests_per_minute=2)
    llm.generate(PROMPT, greedy(2), tenant="acme")
    llm.generate(PROMPT, greedy(2), tenant="acme")
    with pytest.raises(RateLimitedError) as err:
        llm.generate(PROMPT, greedy(2), tenant="acme")
    e = err.value
    assert e.quota == "requests_per_minute" and e.status_code == 429
    assert "tenant 'acme' is over its requests_per_minute quota (2)" in str(e)
    assert e.retry_after_s == pytest.approx(30.0)  # one request refills in 60 s / 2
    assert_pool_empty(llm)
    # another tenant (none configured) is not affected, nor is the default tenant
    assert llm.generate(PROMPT, greedy(2), tenant="other")[0].finished
    assert llm.generate(PROMPT, greedy(2))[0].finished
    ledger.clock.t += 30.0  # the bucket refilled one request
    assert llm.generate(PROMPT, greedy(2), tenant="acme")[0].finished
    assert_pool_empty(llm)


def test_tokens_are_reserved_at_admission_and_the_unused_part_comes_back(llm, quotas):
    ledger = quotas(tokens_per_minute=40)  # the demo model's context is 64 tokens: keep requests below it
    n = prompt_len(llm)
    params = SamplingParams(max_tokens=20, temperature=0.0)  # greedy, stops at EOS: fewer than 20
    req = llm.engine.add_request(PROMPT, params, tenant="acme")
    assert ledger.level("acme", "tokens_per_minute") == 40 - (n + 20)  # prompt + max_tokens reserved
    run(llm, req)
    used = n + len(req.output_ids)
    assert len(req.output_ids) < 20
    assert ledger.level("acme", "tokens_per_minute") == 40 - used  # reconciled to what it used
    # the next one asks for more than is left: 429 naming the quota, retry when the bucket holds enough
    left = 40 - used
    ask = left - n + 1
    with pytest.raises(RateLimitedError) as err:
        llm.engine.add_request(PROMPT, SamplingParams(max_tokens=ask), tenant="acme")
    assert err.value.quota == "tokens_per_minute" and f"needs {n + ask} tokens" in str(err.value)
    assert err.value.retry_after_s == pytest.approx(1 / (40 / 60))
    assert ledger.level("acme", "tokens_per_minute") == left and ledger.in_flight("acme") == 0
    assert_pool_empty(llm)


def test_a_request_larger_than_the_token_quota_is_a_400(llm, quotas):
    ledger = quotas(tokens_per_minute=50)
    n = prompt_len(llm)
    with pytest.raises(InvalidRequestError) as err:
        llm.engine.add_request(PROMPT, SamplingParams(max_tokens=50), tenant="acme")
    assert err.value.field == "params.max_tokens"
    assert (f"the prompt ({n} tokens) + max_tokens (50) = {n + 50} tokens exceeds tenant 'acme''s tokens_per_minute "
            f"quota of 50, so it could never be admitted: lower max_tokens to at most {50 - n}") in str(err.value)
    assert ledger.level("acme", "tokens_per_minute") == 50  # nothing was taken
    assert llm.generate(PROMPT, greedy(50 - n), tenant="acme")[0].finished  # the largest that fits runs
    quotas(tokens_per_minute=5)
    with pytest.raises(InvalidRequestError, match=f"prompt: is {n} tokens, which tenant 'acme''s tokens_per_minute"):
        llm.engine.add_request(PROMPT, greedy(1), tenant="acme")
    assert_pool_empty(llm)


def test_max_concurrent(llm, quotas):
    ledger = quotas(max_concurrent=2)
    a = llm.engine.add_request(PROMPT, greedy(3), tenant="acme")
    b = llm.engine.add_request(PROMPT, greedy(3), tenant="acme")
    with pytest.raises(RateLimitedError) as err:
        llm.engine.add_request(PROMPT, greedy(3), tenant="acme")
    assert err.value.quota == "max_concurrent" and "2 requests in flight (at most 2)" in str(err.value)
    other = llm.engine.add_request(PROMPT, greedy(3), tenant="other")  # others are not limited by acme's cap
    run(llm, a, b, other)
    assert a.finished and b.finished and other.finished and ledger.in_flight("acme") == 0
    c = llm.engine.add_request(PROMPT, greedy(3), tenant="acme")  # both ended: room again
    run(llm, c)
    assert_pool_empty(llm)


def test_max_queued_is_a_503(llm, quotas):
    quotas(max_queued=1)
    a = llm.engine.add_request(PROMPT, greedy(3), tenant="acme")  # waits for the next step
    with pytest.raises(OverloadedError) as err:
        llm.engine.add_request(PROMPT, greedy(3), tenant="acme")
    e = err.value
    assert e.status_code == 503 and e.quota == "max_queued" and e.retry_after_s == 1.0
    assert "tenant 'acme''s queue is full: 1 requests wait for a batch slot (max_queued 1)" in str(e)
    llm.engine.step()  # a runs now: the queue is empty again
    b = llm.engine.add_request(PROMPT, greedy(3), tenant="acme")
    run(llm, a, b)
    assert_pool_empty(llm)


def test_spend_is_charged_at_finish_and_blocks_until_refilled(llm, quotas):
    ledger = quotas(max_spend=0.005, spend_window_s=100.0)
    (out,) = llm.generate(PROMPT, greedy(8), tenant="acme")
    cost = out.cost.monetary
    assert cost > 0.005  # this one request overshoots the cap: it was admitted while the bucket was full
    assert ledger.level("acme", "max_spend") == pytest.approx(0.005 - cost)
    with pytest.raises(RateLimitedError) as err:
        llm.generate(PROMPT, greedy(8), tenant="acme")
    e = err.value
    assert e.quota == "max_spend" and "used up its max_spend quota (0.005 monetary units per 100 s)" in str(e)
    owed = cost - 0.005
    assert e.retry_after_s == pytest.approx(owed / (0.005 / 100), rel=1e-3)
    ledger.clock.t += e.retry_after_s  # paid back: admitted again
    assert llm.generate(PROMPT, greedy(2), tenant="acme")[0].finished
    assert_pool_empty(llm)


def test_a_later_stage_rejecting_gives_everything_back(llm, quotas):
    ledger = quotas(requests_per_minute=5, tokens_per_minute=500, max_concurrent=1)
    with pytest.raises(InvalidRequestError, match="tier: unknown tier 'turbo'"):
        llm.engine.add_request(PROMPT, greedy(4), tenant="acme", tier="turbo")  # select_tier refuses after admit
    assert ledger.level("acme", "requests_per_minute") == 5
    assert ledger.level("acme", "tokens_per_minute") == 500 and ledger.in_flight("acme") == 0
    # a request wrong in itself is refused before the quotas are even asked
    with pytest.raises(InvalidRequestError, match="prompt: is empty"):
        llm.engine.add_request([], greedy(4), tenant="acme")
    assert ledger.level("acme", "requests_per_minute") == 5
    assert llm.generate(PROMPT, greedy(2), tenant="acme")[0].finished  # max_concurrent 1 is free
    assert_pool_empty(llm)


def test_aborts_settle_what_the_request_used(llm, quotas):
    ledger = quotas(requests_per_minute=5, tokens_per_minute=500, max_spend=10.0)
    n = prompt_len(llm)
    queued = llm.engine.add_request(PROMPT, greedy(10), tenant="acme")
    llm.engine.abort(queued.request_id)  # nothing computed yet: refunded in full
    assert ledger.level("acme", "requests_per_minute") == 5 and ledger.level("acme", "tokens_per_minute") == 500
    started = llm.engine.add_request(PROMPT, greedy(10), tenant="acme")
    for _ in range(3):
        llm.engine.step()
    made = len(started.output_ids)
    assert 0 < made < 10
    llm.engine.abort(started.request_id)  # ran: the request counts, its unused tokens come back, its cost is owed
    assert ledger.level("acme", "requests_per_minute") == 4
    assert ledger.level("acme", "tokens_per_minute") == 500 - (n + made)
    price = started.tierset.price
    assert ledger.level("acme", "max_spend") == pytest.approx(10.0 - price.of(n, made))
    assert ledger.in_flight("acme") == 0
    assert_pool_empty(llm)


def test_generate_is_all_or_nothing_for_quotas_too(llm, quotas):
    ledger = quotas(requests_per_minute=2)
    with pytest.raises(RateLimitedError):
        llm.generate([PROMPT, "rev:abc=", "copy:x="], greedy(2), tenant="acme")  # the third is over
    assert ledger.level("acme", "requests_per_minute") == 2  # the two admitted were aborted unrun: refunded
    assert len(llm.generate([PROMPT, "rev:abc="], greedy(2), tenant="acme")) == 2
    assert_pool_empty(llm)


def test_rejections_are_counted_by_quota(llm, quotas):
    sink = PrometheusSink()
    llm.engine.bus.subscribe(sink)
    try:
        ledger = quotas(requests_per_minute=1)
        llm.generate(PROMPT, greedy(2), tenant="acme")
        for _ in range(2):
            with pytest.raises(RateLimitedError):
                llm.generate(PROMPT, greedy(2), tenant="acme")
        ledger.clock.t += 60  # one request again, for a request select_tier refuses (its class is the reason)
        with pytest.raises(InvalidRequestError):
            llm.generate(PROMPT, greedy(2), tenant="acme", tier="turbo")
    finally:
        llm.engine.bus.unsubscribe(sink)
    got = {(m.name, s.labels.get("reason"), s.labels.get("tenant")): s.value
           for m in sink.registry.collect() for s in m.samples if s.name.endswith("request_rejected_total")}
    assert got[("litellm_pipeline:request_rejected", "requests_per_minute", "acme")] == 2
    assert got[("litellm_pipeline:request_rejected", "InvalidRequestError", "acme")] == 1
    assert_pool_empty(llm)


def test_a_group_no_quota_can_ever_take_whole_is_refused_naming_it(quotas):
    """``check_group``: the choices of one API request, each fine alone, that could never all be in at once."""
    ledger = quotas(max_concurrent=2, requests_per_minute=5, tokens_per_minute=100)
    ledger.check_group("acme", [30, 30])  # fits every quota
    ledger.check_group("acme", [500])  # one request: reserve() judges it alone
    ledger.check_group("nobody", [500] * 9)  # a tenant without quotas
    ledger.check_group("acme", [150, 10])  # one of them too big alone: reserve() names its max_tokens
    for tokens, prompts, field, words in (
            ([10] * 3, 1, "n", ["3 engine requests at once (n=3)", "max_concurrent quota of 2"]),
            ([10] * 3, 3, "prompt", ["(3 prompts)", "max_concurrent quota of 2", "ask for fewer"]),
            ([60, 50], 1, "n", ["tokens_per_minute quota of 100: together they need 110", "lower max_tokens"])):
        with pytest.raises(InvalidRequestError) as exc:
            ledger.check_group("acme", tokens, prompts=prompts)
        assert exc.value.field == field and all(w in str(exc.value) for w in words), str(exc.value)
    wide = quotas(max_concurrent=10, requests_per_minute=3)
    with pytest.raises(InvalidRequestError, match=r"4 engine requests at once \(2 prompts x n=2\).*requests_per_minute"):
        wide.check_group("acme", [1] * 4, prompts=2)
    assert wide.in_flight("acme") == 0 and wide.level("acme", "requests_per_minute") == 3  # nothing taken
