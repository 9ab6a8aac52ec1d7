"""Tenants over HTTP: API keys (401), quotas (429 with Retry-After naming the quota, 503 for a full tenant queue,
400 for a request no quota could ever take), per-tenant prefix caches, and rejections in /metrics. Every refusal
leaves the other tenants' requests untouched and the KV pool empty."""

from __future__ import annotations

import contextlib
import json
import os
import time

import httpx
import openai
import pytest
from _server_util import PLUGIN_STAGES, start_server, wait_pool_empty
from server_stages import slow_steps
from test_metrics_and_health import scrape, value

from litellm_pipeline.server.auth import digest

KEYS = {"acme": "sk-acme-test", "beta": "sk-beta-test", "limited": "sk-limited-test", "queued": "sk-queued-test",
        "small": "sk-small-test", "pair": "sk-pair-test"}
BETA_ENV = "LITELLM_PIPELINE_TEST_KEY_BETA"
SHORT = {"prompt": "12+345=", "max_tokens": 4, "temperature": 0}


def key_override(tenant: str) -> str:
    return f"+tenants.{tenant}.api_key_sha256=['{digest(KEYS[tenant])}']"


@pytest.fixture(scope="module")
def server():
    overrides = [key_override("acme"), f"+tenants.beta.api_key_env={BETA_ENV}",
                 key_override("limited"), "+tenants.limited.requests_per_minute=2",
                 key_override("queued"), "+tenants.queued.max_queued=1",
                 key_override("small"), "+tenants.small.tokens_per_minute=20",
                 key_override("pair"), "+tenants.pair.requests_per_minute=3",
                 "engine.max_num_seqs=2", *PLUGIN_STAGES]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(BETA_ENV, KEYS["beta"])  # read (and hashed) once, when the app is built
        live = start_server(overrides)
    yield live
    live.stop()


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def test_requests_without_a_known_key_get_401(server):
    with server.client() as client:
        cases = [({}, "no API key: send it in the header 'Authorization: Bearer <key>'"),
                 ({"Authorization": "Bearer sk-wrong"}, "invalid API key"),
                 ({"Authorization": "Bearer " + digest(KEYS["acme"])}, "invalid API key"),  # the digest is no key
                 ({"Authorization": f"Basic {KEYS['acme']}"}, "the Authorization header must be 'Bearer <key>'"),
                 ({"Authorization": "Bearer"}, "the Authorization header must be 'Bearer <key>'")]
        for headers, message in cases:
            resp = client.post("/v1/completions", json=SHORT, headers=headers)
            assert resp.status_code == 401, (headers, resp.text)
            err = resp.json()["error"]
            assert err == {"message": message, "type": "authentication_error", "param": None,
                           "code": "invalid_api_key"}
            assert resp.headers["WWW-Authenticate"] == "Bearer"
            assert "sk-wrong" not in resp.text
        # the key is checked before the body: a bad body without a key is still a 401
        assert client.post("/v1/completions", json={"prompt": 5, "max_tokens": "x"}).status_code == 401
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers=auth("acme")).status_code == 200
        # health and metrics stay open (probes and scrapers carry no key)
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
        # and a good key is served as before
        assert client.post("/v1/completions", json=SHORT, headers=auth("acme")).status_code == 200
    wait_pool_empty(server.engine)


def test_keys_from_digests_and_environment_name_their_tenants(server):
    with server.client() as client:
        before = scrape(client)
        finish = {}
        for tenant in ("acme", "beta"):
            c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[tenant], timeout=30.0, max_retries=0)
            resp = c.completions.create(model="demo", prompt="12+345=", max_tokens=4, temperature=0)
            assert resp.choices[0].text == "357"
            finish[tenant] = resp.choices[0].finish_reason
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="sk-nobody", max_retries=0).models.list()
        after = scrape(client)
    for tenant in ("acme", "beta"):  # the engine saw each request under its key's tenant
        key = dict(finish_reason=finish[tenant], tenant=tenant, tier="balanced")
        moved = value(after, "request_success_total", **key) - value(before, "request_success_total", **key)
        assert moved == 1, tenant
    wait_pool_empty(server.engine)


def test_tenants_never_share_cached_kv_blocks(server):
    # BOS + 38 characters (unique to this run): two full 16-token blocks a repeat can take from the prefix cache
    body = {"prompt": f"copy:{time.monotonic_ns() % 10**9:09d}abcdefghijklmnopqrstuvw=", "max_tokens": 2,
            "temperature": 0}

    def cached(tenant: str) -> int:
        with server.client() as client:
            resp = client.post("/v1/completions", json=body, headers=auth(tenant))
        assert resp.status_code == 200, resp.text
        usage = resp.json()["usage"]
        assert usage["prompt_tokens"] == 39
        return usage["prompt_tokens_details"]["cached_tokens"]

    assert cached("acme") == 0
    assert cached("beta") == 0  # the same prompt, another tenant: nothing of acme's KV is reused
    assert cached("acme") == 32  # acme repeating it hits its own cache
    assert cached("beta") == 32
    wait_pool_empty(server.engine)


def test_over_a_quota_is_429_with_retry_after_and_the_quota(server):
    with server.client() as client:
        before = scrape(client)
        for _ in range(2):
            assert client.post("/v1/completions", json=SHORT, headers=auth("limited")).status_code == 200
        resp = client.post("/v1/completions", json=SHORT, headers=auth("limited"))
        assert resp.status_code == 429
        err = resp.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "requests_per_minute"
        assert "tenant 'limited' is over its requests_per_minute quota (2); retry in" in err["message"]
        assert 29 <= int(resp.headers["Retry-After"]) <= 30  # one request refills in 30 s
        # nobody else is affected
        assert client.post("/v1/completions", json=SHORT, headers=auth("acme")).status_code == 200
        after = scrape(client)
    moved = value(after, "request_rejected_total", reason="requests_per_minute", tenant="limited") - value(
        before, "request_rejected_total", reason="requests_per_minute", tenant="limited")
    assert moved == 1
    # the official client sees OpenAI's rate-limit error
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS["limited"], timeout=30.0, max_retries=0)
    with pytest.raises(openai.RateLimitError):
        c.completions.create(model="demo", prompt="1+2=", max_tokens=2)
    wait_pool_empty(server.engine)


def test_a_request_over_the_token_quota_is_a_400(server):
    with server.client() as client:
        resp = client.post("/v1/completions", json={**SHORT, "max_tokens": 30}, headers=auth("small"))
        assert resp.status_code == 400
        err = resp.json()["error"]
        assert err["param"] == "max_tokens" and "tokens_per_minute quota of 20" in err["message"]
        assert client.post("/v1/completions", json=SHORT, headers=auth("small")).status_code == 200
        # each choice fits alone, but the choices of one request are admitted together: no wait would let 2 in
        before = server.engine.rt.tenants.level("small", "tokens_per_minute")
        resp = client.post("/v1/completions", json={**SHORT, "n": 2}, headers=auth("small"))
        assert resp.status_code == 400 and "Retry-After" not in resp.headers
        err = resp.json()["error"]
        assert err["param"] == "n" and "runs 2 engine requests at once (n=2)" in err["message"]
        assert "tokens_per_minute quota of 20: together they need 24 tokens" in err["message"]
        assert err["message"].endswith("ask for fewer or lower max_tokens")
        assert server.engine.rt.tenants.level("small", "tokens_per_minute") >= before  # nothing was taken
        resp = client.post("/v1/completions", json={**SHORT, "prompt": ["1+2=", "3+4="], "n": 2},
                           headers=auth("limited"))
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "n"
        assert "4 engine requests at once (2 prompts x n=2)" in resp.json()["error"]["message"]
        assert "requests_per_minute quota of 2" in resp.json()["error"]["message"]
        # several prompts, no n: the prompts are what to cut
        resp = client.post("/v1/completions", json={**SHORT, "prompt": ["1+2=", "3+4=", "5+6="]},
                           headers=auth("limited"))
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
        assert "3 engine requests at once (3 prompts)" in resp.json()["error"]["message"]
        # one choice already too big alone: its own max_tokens is named, not n
        resp = client.post("/v1/completions", json={**SHORT, "max_tokens": 30, "n": 2}, headers=auth("small"))
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"
    wait_pool_empty(server.engine)


@pytest.fixture
def slow(server):
    with slow_steps(server, 0.02):
        yield


def finish_of(stream: httpx.Response) -> str | None:
    """Read a streamed completion to its end; its finish_reason (None if the stream broke off)."""
    finish = None
    for line in stream.iter_lines():
        if line.startswith("data: {"):
            choices = json.loads(line[6:]).get("choices") or [{}]
            finish = choices[0].get("finish_reason") or finish
    return finish


def test_a_full_tenant_queue_is_503(server, slow):
    long = {"prompt": "copy:abcdef=", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
    sched = server.engine.rt.scheduler
    with server.client() as client, contextlib.ExitStack() as stack:
        # acme fills both batch slots (engine.max_num_seqs=2) for about a second
        running = [stack.enter_context(client.stream("POST", "/v1/completions", json=long, headers=auth("acme")))
                   for _ in range(2)]
        deadline = time.monotonic() + 10
        while len(sched.running) < 2:
            assert time.monotonic() < deadline, "acme's requests did not start"
            time.sleep(0.005)
        # queued's first request waits for a slot; its second finds its queue (max_queued 1) full
        waiting = stack.enter_context(client.stream("POST", "/v1/completions", json=long, headers=auth("queued")))
        assert [r.status_code for r in (*running, waiting)] == [200, 200, 200]
        resp = client.post("/v1/completions", json=SHORT, headers=auth("queued"))
        assert resp.status_code == 503, resp.text
        err = resp.json()["error"]
        assert err["type"] == "service_unavailable_error" and err["code"] == "max_queued"
        assert "tenant 'queued''s queue is full: 1 requests wait for a batch slot (max_queued 1)" in err["message"]
        assert resp.headers["Retry-After"] == "1"
        # the requests already in flight, the waiting one included, run to their end
        assert [finish_of(r) for r in (*running, waiting)] == ["length"] * 3
    wait_pool_empty(server.engine)
    with server.client() as client:  # and with its queue drained, queued is served again
        assert client.post("/v1/completions", json=SHORT, headers=auth("queued")).status_code == 200
    wait_pool_empty(server.engine)


def test_the_default_open_mode_needs_no_key(demo_server):
    with demo_server.client() as client:
        assert client.post("/v1/completions", json=SHORT).status_code == 200
        assert client.post("/v1/completions", json=SHORT, headers={"Authorization": "Bearer anything"}
                           ).status_code == 200
    assert demo_server.engine.rt.tenants is None
    wait_pool_empty(demo_server.engine)


def test_env_keys_are_read_at_start(monkeypatch):
    from litellm_pipeline.config.schema import TenantSection
    from litellm_pipeline.errors import ConfigError
    from litellm_pipeline.server.auth import ApiKeys

    monkeypatch.delenv(BETA_ENV, raising=False)
    tenants = {"beta": TenantSection(api_key_env=BETA_ENV)}
    with pytest.raises(ConfigError, match=f"tenants.beta.api_key_env: the environment variable {BETA_ENV} is not set"):
        ApiKeys.from_config(tenants)
    keys = ApiKeys.from_config(tenants, environ={BETA_ENV: "k1"})
    assert keys.tenant("k1") == "beta" and keys.tenant("k2") is None
    with pytest.raises(ConfigError, match=r"tenants.b.api_key_sha256\[0\]: the same key as tenants.a.api_key_env"):
        ApiKeys.from_config({"a": TenantSection(api_key_env="K"), "b": TenantSection(api_key_sha256=[digest("k")])},
                            environ={"K": "k"})
    with pytest.raises(ConfigError, match="no tenant has an API key"):
        ApiKeys.from_config({"a": TenantSection(weight=2)})
    assert os.environ.get(BETA_ENV) is None


def test_choices_of_a_refused_request_cost_nothing_even_if_they_ran(server, monkeypatch):
    """Choice 0 of an n=2 request takes pair's last request and runs a step before choice 1 is submitted (the
    engine loop can take the lock between the two); choice 1 is refused (429). The API request failed, so
    choice 0 is aborted and all its quota comes back."""
    engine, ledger = server.engine, server.engine.rt.tenants
    real, ran = engine.add_request, []

    def add_then_step(spec, *args, **kw):
        req = real(spec, *args, **kw)
        if req.tenant == "pair" and req.request_id.endswith("-0-0"):
            engine.step()  # what the engine loop does when it wins the lock between two choices
            ran.append(len(req.output_ids))
        return req

    with server.client() as client:
        for _ in range(2):
            assert client.post("/v1/completions", json=SHORT, headers=auth("pair")).status_code == 200
        before = ledger.level("pair", "requests_per_minute")
        assert 1 <= before < 2, before  # room for one request, not two
        monkeypatch.setattr(engine, "add_request", add_then_step)
        resp = client.post("/v1/completions", json={**SHORT, "n": 2}, headers=auth("pair"))
        monkeypatch.undo()
        assert resp.status_code == 429 and resp.json()["error"]["code"] == "requests_per_minute"
        assert ran == [1]  # choice 0 was prefilled and sampled its first token
        # all of it back (plus what refilled meanwhile), not one request short
        assert ledger.level("pair", "requests_per_minute") >= before
        assert ledger.in_flight("pair") == 0
        assert client.post("/v1/completions", json=SHORT, headers=auth("pair")).status_code == 200
    wait_pool_empty(engine)
