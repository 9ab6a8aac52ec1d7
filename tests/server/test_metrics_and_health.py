"""``GET /metrics`` (Prometheus text format, counters that move with each request) and ``GET /health``
(200 serving, 503 while starting)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families
from server_stages import slow_steps

from litellm_pipeline.config.build import build_engine
from litellm_pipeline.config.compose import compose
from litellm_pipeline.server.app import build_app

NAMES = [
    "time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "num_requests_running", "num_requests_waiting", "kv_blocks_used",
    "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens",
    "request_success", "request_rejected", "tier_selections", "budget_infeasible", "budget_violations",
    "kv_cache_usage_perc", "kv_blocks_cached",
]


def scrape(client: httpx.Client) -> dict[tuple, float]:
    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(resp.text) for s in fam.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((f"litellm_pipeline:{name}", tuple(sorted(labels.items()))), 0.0)


def test_metrics_move_with_a_request(demo_server):
    # BOS + 22 characters = 23 prompt tokens: one full 16-token block, so the second identical request hits the prefix cache
    prompt = "copy:abcdefghijklmnop="
    tt = dict(tenant="default", tier="balanced")
    with demo_server.client() as client:
        before = scrape(client)
        families = {f.name for f in text_string_to_metric_families(client.get("/metrics").text)}
        missing = [name for name in NAMES if f"litellm_pipeline:{name}" not in families]
        assert not missing, f"not exposed: {missing}"
        usage = []
        for _ in range(2):
            resp = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                                        "ignore_eos": True})
            usage.append(resp.json()["usage"])
        client.post("/v1/completions", json={"prompt": "1+2=", "tier": "turbo"})  # refused
        after = scrape(client)

    def delta(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    prompt_tokens = usage[0]["prompt_tokens"]
    assert prompt_tokens == 23 and usage[1]["prompt_tokens_details"]["cached_tokens"] == 16
    assert delta("prompt_tokens_total", **tt) == 2 * prompt_tokens
    assert delta("generation_tokens_total", **tt) == 10
    assert delta("request_success_total", finish_reason="length", **tt) == 2
    assert delta("time_to_first_token_seconds_count", **tt) == 2
    assert delta("e2e_request_latency_seconds_count", **tt) == 2
    assert delta("request_queue_time_seconds_count", **tt) == 2
    assert delta("time_per_output_token_seconds_count", **tt) == 2
    assert delta("tier_selections_total", tier="balanced", mode="fixed") == 2
    assert delta("prefix_cache_queries_total") == 2 * prompt_tokens
    assert delta("prefix_cache_hits_total") == 16
    assert delta("request_rejected_total", reason="InvalidRequestError", tenant="default") == 1
    # idle again: nothing running or waiting, no block held
    assert value(after, "num_requests_running") == 0 and value(after, "num_requests_waiting") == 0
    assert value(after, "kv_blocks_used", pool="hot") == 0


# refusals at every layer: the gate (body too large), FastAPI's validation, a route (unknown model, empty prompt),
# the engine's request stages (unknown tier); (request, reason counted under)
REFUSED = [
    ({"content": b'{"prompt": "' + b"1" * 5000 + b'"}'}, "request_too_large"),
    ({"json": {"prompt": "1+2=", "max_tokens": -1}}, "InvalidRequestError"),
    ({"json": {"model": "gpt-9", "prompt": "1+2="}}, "NotFoundError"),
    ({"json": {"prompt": ""}}, "InvalidRequestError"),
    ({"json": {"prompt": "1+2=", "tier": "turbo"}}, "InvalidRequestError"),
    ({"json": {"messages": [{"role": "wizard", "content": "1+2="}]}, "chat": True}, "InvalidRequestError"),
]


def test_every_refused_request_is_counted_once(demo_server):
    with demo_server.client() as client:
        before = scrape(client)
        statuses = []
        for request, _ in REFUSED:
            path = "/v1/chat/completions" if request.pop("chat", False) else "/v1/completions"
            statuses.append(client.post(path, **request).status_code)
        assert client.get("/v1/models/gpt-9").status_code == 404
        assert client.get("/no-such-page").status_code == 404  # not an API request: not counted
        after = scrape(client)
    assert statuses == [413, 400, 404, 400, 400, 400]

    def delta(reason: str) -> float:
        return (value(after, "request_rejected_total", reason=reason, tenant="default")
                - value(before, "request_rejected_total", reason=reason, tenant="default"))

    assert delta("request_too_large") == 1 and delta("NotFoundError") == 2 and delta("InvalidRequestError") == 4
    rejected = [(k, v - before.get(k, 0.0)) for k, v in after.items() if k[0].endswith("request_rejected_total")]
    assert sum(d for _, d in rejected) == len(REFUSED) + 1


def test_kv_usage_is_a_fraction_and_no_created_series(demo_server):
    with demo_server.client() as client, slow_steps(demo_server, 0.05):
        done = threading.Thread(target=lambda: demo_server.client().post(
            "/v1/completions", json={"prompt": "copy:abcdefghijklmnopqrstuvwxyz=", "max_tokens": 30,
                                     "ignore_eos": True}))
        done.start()
        deadline = time.monotonic() + 30
        while not demo_server.engine.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # a few steps in: the step events have set the gauges
        busy = scrape(client)
        text = client.get("/metrics").text
        done.join(60)
    pool = demo_server.engine.rt.pool
    used = value(busy, "kv_blocks_used", pool="hot")
    assert used > 0 and value(busy, "kv_cache_usage_perc") == used / pool.num_blocks
    assert not [line for line in text.splitlines() if "_created" in line]


def test_health_is_ok_while_serving(demo_server):
    with demo_server.client() as client:
        resp = client.get("/health")
    assert resp.status_code == 200 and resp.json()["status"] == "ok"


def test_health_and_api_are_503_until_started():
    """An app whose lifespan has not run (the engine loop not started) is still starting."""
    engine = build_engine(compose(["+recipe=serve", "device.threads=1"]))
    app = build_app(engine, {"max_n": 2}, model_name="demo")

    async def main():
        transport = httpx.ASGITransport(app=app)  # runs no lifespan: the app stays "starting"
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return (await client.get("/health"),
                    await client.post("/v1/completions", json={"prompt": "1+2="}),
                    await client.get("/metrics"))

    health, api, metrics = asyncio.run(asyncio.wait_for(main(), 30))
    assert health.status_code == 503 and health.json()["status"] == "starting"
    assert api.status_code == 503 and "starting" in api.json()["error"]["message"]
    assert api.headers["retry-after"] == "1"
    assert metrics.status_code == 200  # scrapable before it serves
    assert not engine.requests
