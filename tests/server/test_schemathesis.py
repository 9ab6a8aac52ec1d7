"""schemathesis against the server's own OpenAPI schema (``/openapi.json``): every operation gets a few generated
requests, valid (positive) and invalid (negative), from a fixed derandomized seed. None may get a 5xx, a refused
``/v1`` request must get an OpenAI error body, and afterwards the server must still answer correctly with no
request in flight and every KV block back.

It drives the schema's Hypothesis strategies directly (``APIOperation.as_strategy``) instead of schemathesis' pytest
plugin, whose fixture-based loader (``schemathesis.pytest.from_fixture``) needs a pytest internal that pytest 9
removed; the server is a real one, so the schema is only known once a fixture has started it.

It runs against the ``chat_server`` of conftest.py (the demo model with a chat template, otherwise as shipped):
the ``demo_server`` carries a plugin stage that fails prompts holding ``boom`` with a 500 on purpose."""

from __future__ import annotations

from collections import Counter

import schemathesis
from _server_util import wait_pool_empty
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

EXAMPLES = 8  # per operation and mode; the whole run takes a few seconds
OPERATIONS = {"GET /health", "GET /metrics", "GET /v1/models", "GET /v1/models/{model_id}", "POST /v1/completions",
              "POST /v1/chat/completions"}


def run_operation(op, mode: GenerationMode, base_url: str, statuses: Counter) -> None:
    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def check(case) -> None:
        resp = case.call(base_url=base_url, timeout=30)
        statuses[(case.operation.label, resp.status_code)] += 1
        assert resp.status_code < 500, (
            f"{case.method} {case.formatted_path} -> {resp.status_code}: {resp.text[:500]}\n"
            f"body: {str(case.body)[:500]}")
        if case.path.startswith("/v1/") and resp.status_code >= 400:
            assert set(resp.json()["error"]) >= {"message", "type", "param", "code"}, resp.text

    check()


def test_no_generated_request_gets_a_server_error(chat_server):
    schema = schemathesis.openapi.from_url(chat_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} == OPERATIONS
    statuses: Counter = Counter()
    for op in operations:
        # negative cases need something schema-checked to break: the bodies (a free path string has nothing)
        modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE] if op.body else [GenerationMode.POSITIVE]
        for mode in modes:
            run_operation(op, mode, chat_server.url, statuses)
    sent = Counter()
    for (label, _), n in statuses.items():
        sent[label] += n
    assert set(sent) == OPERATIONS, statuses  # every operation was called
    # the generation endpoints got a full set of positive and negative bodies, refused by name (400), never a 5xx
    for label in ("POST /v1/completions", "POST /v1/chat/completions"):
        assert sent[label] >= 2 * EXAMPLES and statuses[(label, 400)] > 0, statuses
    with chat_server.client() as client:
        assert client.get("/health").json()["status"] == "ok"
        resp = client.post("/v1/completions", json={"prompt": "12+345=", "max_tokens": 4, "temperature": 0})
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "357"
    wait_pool_empty(chat_server.engine)
