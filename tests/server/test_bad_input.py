"""Every bad input gets a 4xx (or, for a failure inside the engine, a 500 with an error id) and a JSON error body
naming the problem, while a good request in flight at the same moment finishes exactly as it would alone."""

from __future__ import annotations

import json
import re
import threading

import httpx
import pytest
from _server_util import wait_pool_empty
from server_stages import MARKER, slow_steps

from litellm_pipeline import SamplingParams

GOOD_PROMPT, GOOD_TOKENS = "copy:abc=", 40
C, CHAT = "/v1/completions", "/v1/chat/completions"
CASES = {
    # name: (path, body, status, param, fragments of the message)
    "invalid-json": (C, b'{"prompt": "1+2=",', 400, None, ["not valid JSON"]),
    "not-an-object": (C, b'["1+2="]', 400, None, ["must be a JSON object", "got an array"]),
    "null-body": (C, b"null", 400, None, ["must be a JSON object", "got null"]),
    "missing-prompt": (C, {"model": "demo"}, 400, "prompt", ["required"]),
    "prompt-wrong-type": (C, {"prompt": {"text": "1+2="}}, 400, "prompt", ["must be a string", "token ids"]),
    "temperature-wrong-type": (C, {"prompt": "1+2=", "temperature": "hot"}, 400, "temperature", ["number", "'hot'"]),
    "temperature-bool": (C, {"prompt": "1+2=", "temperature": True}, 400, "temperature", ["number", "True"]),
    "max-tokens-float": (C, {"prompt": "1+2=", "max_tokens": 1.5}, 400, "max_tokens", ["integer", "1.5"]),
    "unknown-field": (C, {"prompt": "1+2=", "max_token": 3}, 400, "max_token", ["unknown"]),
    "unsupported-field": (C, {"prompt": "1+2=", "echo": True}, 400, "echo", ["not supported"]),
    "temperature-negative": (C, {"prompt": "1+2=", "temperature": -1}, 400, "temperature", [">= 0", "100", "-1"]),
    "top-p-zero": (C, {"prompt": "1+2=", "top_p": 0}, 400, "top_p", ["> 0", "<= 1", "got 0"]),
    "top-p-above-one": (C, {"prompt": "1+2=", "top_p": 1.5}, 400, "top_p", ["> 0", "<= 1", "1.5"]),
    "n-over-cap": (C, {"prompt": "1+2=", "n": 5}, 400, "n", ["<= 4", "got 5", "server.max_n"]),
    "too-many-prompts": (C, {"prompt": ["1+2="] * 4}, 400, "prompt", ["4 prompts", "at most 3"]),
    "max-tokens-zero": (C, {"prompt": "1+2=", "max_tokens": 0}, 400, "max_tokens", [">= 1", "got 0"]),
    "max-tokens-beyond-context": (C, {"prompt": "1+2=", "max_tokens": 100}, 400, "max_tokens", ["100", "64"]),
    "prompt-plus-max-tokens": (C, {"prompt": "12+345=", "max_tokens": 60}, 400, "max_tokens",
                               ["prompt (8 tokens)", "max_tokens (60)", "68", "context of 64", "at most 56"]),
    "prompt-fills-context": (C, {"prompt": "1" * 70}, 400, "prompt", ["71 tokens", "context is 64"]),
    "ids-outside-vocab": (C, {"prompt": [5, 999, 7]}, 400, "prompt", ["outside the vocabulary", "47", "999"]),
    "negative-id": (C, {"prompt": [5, -1]}, 400, "prompt", ["outside the vocabulary", "-1"]),
    "empty-text": (C, {"prompt": ""}, 400, "prompt", ["empty"]),
    "empty-body": (C, b"", 400, None, ["the request body is empty", "JSON object"]),
    # JSON's \\ud800 escapes can carry half a UTF-16 pair, which is no Unicode text
    "lone-surrogate": (C, b'{"prompt": "\\ud800abc"}', 400, "prompt",
                       ["not valid Unicode", "lone surrogate U+D800 at character 0"]),
    "lone-surrogate-in-a-list": (C, b'{"prompt": ["1+2=", "ab\\udfff"]}', 400, "prompt[1]",
                                 ["not valid Unicode", "U+DFFF at character 2"]),
    "empty-ids": (C, {"prompt": []}, 400, "prompt", ["empty"]),
    "unknown-model": (C, {"model": "gpt-9", "prompt": "1+2="}, 404, "model", ["'gpt-9'", "does not exist", "'demo'"]),
    "unknown-tier": (C, {"prompt": "1+2=", "tier": "turbo"}, 400, "tier",
                     ["unknown tier 'turbo'", "fast", "balanced", "deep", "max"]),
    "impossible-budget": (C, {"prompt": "1+2=", "budget": {"monetary_cost_units": 1e-9}}, 400, "budget",
                          ["cannot be met", "monetary_cost_units"]),
    "invalid-budget": (C, {"prompt": "1+2=", "budget": {"latency_cost_ms": -1}}, 400, "budget",
                       ["latency_cost_ms", "> 0"]),
    "stream-options-without-stream": (C, {"prompt": "1+2=", "stream_options": {"include_usage": True}}, 400,
                                      "stream_options", ["stream is true"]),
    "oversized-body": (C, {"prompt": "1" * 5000}, 413, None, ["5013 bytes", "at most 4096", "server.max_body_bytes"]),
    # declared far past the limit: answered without reading it
    "huge-body": (C, {"prompt": "1" * 400_000}, 413, None, ["400013 bytes", "at most 4096"]),
    "chat-assistant-last": (CHAT, {"messages": [{"role": "user", "content": "1+2="},
                                                {"role": "assistant", "content": "3"}]}, 400, "messages",
                            ["the demo model answers the last message", "must be a user message"]),
    "chat-unknown-role": (CHAT, {"messages": [{"role": "wizard", "content": "1+2="}]}, 400, "messages[0].role",
                          ["'wizard'", "'user'", "'assistant'"]),
    "chat-empty-messages": (CHAT, {"messages": []}, 400, "messages", ["at least 1"]),
    "chat-image-part": (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
                        "messages[0].content[0]", ["only text content parts"]),
    "chat-top-logprobs-alone": (CHAT, {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
                                "top_logprobs", ["logprobs set to true"]),
    "engine-fault": (C, {"prompt": f"{MARKER} 1+2=", "max_tokens": 4}, 500, None,
                     ["injected plugin fault", "error id"]),
}


class GoodRequest:
    """A long greedy streaming completion, read in a thread; ``started`` is set once its first token arrived."""

    def __init__(self, url: str):
        self.url, self.chunks, self.error = url, [], None
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"prompt": GOOD_PROMPT, "max_tokens": GOOD_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": True}
        try:
            with httpx.stream("POST", self.url + C, json=body, timeout=60) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self.chunks.append(json.loads(line[6:]))
                        self.started.set()
        except Exception as exc:  # reported by the test, not lost in the thread
            self.error = exc
        finally:
            self.started.set()

    def text(self) -> tuple[str, str | None]:
        self.thread.join(timeout=60)
        assert self.error is None, f"the good request failed: {self.error!r}"
        choices = [c["choices"][0] for c in self.chunks]
        return "".join(c["text"] for c in choices), choices[-1]["finish_reason"]


@pytest.fixture
def slow(demo_server):
    """Steps of 20 ms while the test runs, so the good request is still in flight when the bad one is answered."""
    with slow_steps(demo_server, 0.02):
        yield


@pytest.fixture(scope="module")
def good_reference(reference):
    (ref,) = reference.generate(GOOD_PROMPT, SamplingParams(max_tokens=GOOD_TOKENS, temperature=0, ignore_eos=True))
    return ref.text


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_and_a_concurrent_request_is_unaffected(demo_server, slow, good_reference, case):
    path, body, status, param, fragments = CASES[case]
    good = GoodRequest(demo_server.url)
    good.thread.start()
    assert good.started.wait(30)
    with demo_server.client() as client:
        resp = client.post(path, content=body) if isinstance(body, bytes) else client.post(path, json=body)
        assert len(demo_server.engine.requests) == 1, "the good request was no longer in flight: no overlap"
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    err = resp.json()["error"]
    assert err["param"] == param and set(err) >= {"message", "type", "param", "code"}
    for fragment in fragments:
        assert fragment in err["message"], f"{fragment!r} missing from {err['message']!r}"
    if status == 500:
        assert err["type"] == "server_error" and re.fullmatch(r"[0-9a-f]{12}", err["error_id"])
        assert f"error id {err['error_id']}" in err["message"]
    else:
        assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert good.text() == (good_reference, "length")
    wait_pool_empty(demo_server.engine)


@pytest.mark.parametrize("body, param, fragments", [
    ({"logprobs": True, "top_logprobs": 25}, "top_logprobs", ["<= 20", "got 25"]),
    ({"max_completion_tokens": 0}, "max_completion_tokens", [">= 1", "got 0"]),
    ({"max_completion_tokens": 61}, "max_completion_tokens", ["prompt (4 tokens)", "(61) = 65", "context of 64"]),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_tokens", ["disagree"]),
    ({"messages": [{"role": "user", "content": "1" * 70}]}, "messages", ["rendered prompt is 71 tokens"]),
])
def test_chat_errors_use_the_chat_field_names(chat_server, body, param, fragments):
    with chat_server.client() as client:
        resp = client.post(CHAT, json={"messages": [{"role": "user", "content": "abc"}], **body})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param
    for fragment in fragments:
        assert fragment in err["message"], f"{fragment!r} missing from {err['message']!r}"


@pytest.mark.parametrize("message, param, fragment", [
    (b'{"role": "user", "content": "a\\ud800"}', "messages[1].content",
     "text is not valid Unicode: a lone surrogate U+D800 at character 1"),
    (b'{"role": "user", "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": "\\udc00"}]}',
     "messages[1].content[1].text", "text is not valid Unicode: a lone surrogate U+DC00 at character 0"),
    (b'{"role": "user", "content": "hi", "name": "b\\ud801"}', "messages[1].name",
     "text is not valid Unicode: a lone surrogate U+D801 at character 1"),
    (b'{"role": "us\\ud801er", "content": "hi"}', "messages[1].role", "unable to parse raw data as a unicode string"),
])
def test_chat_message_that_is_not_unicode_text_is_refused(chat_server, message, param, fragment):
    """Named by the message, part and character where the client put it, not by where the template put it."""
    with chat_server.client() as client:
        resp = client.post(CHAT, content=b'{"messages": [{"role": "system", "content": "be brief"}, ' + message + b']}')
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and fragment in err["message"], err


def test_null_means_the_default_as_in_openais_api(demo_server, chat_server, reference):
    """n, stream, priority (and chat's logprobs) sent as JSON null are served as if left out."""
    (ref,) = reference.generate("12+345=", SamplingParams(max_tokens=6, temperature=0))
    with demo_server.client() as client:
        resp = client.post(C, json={"prompt": "12+345=", "max_tokens": 6, "temperature": 0, "n": None,
                                    "stream": None, "priority": None})
    assert resp.status_code == 200, resp.text
    assert [c["text"] for c in resp.json()["choices"]] == [ref.text]
    with chat_server.client() as client:
        body = {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 3, "temperature": 0}
        plain = client.post(CHAT, json=body)
        nulls = client.post(CHAT, json={**body, "n": None, "stream": None, "logprobs": None})
    assert plain.status_code == nulls.status_code == 200, nulls.text
    got = nulls.json()["choices"]
    assert len(got) == 1 and got[0]["logprobs"] is None
    assert got[0]["message"] == plain.json()["choices"][0]["message"]


def test_engine_fault_in_a_stream_ends_it_with_an_error_event(demo_server):
    body = {"prompt": f"{MARKER} 1+2=", "max_tokens": 4, "stream": True}
    with demo_server.client() as client:
        resp = client.post(C, json=body)
    assert resp.status_code == 200  # the fault happens after the stream started
    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_error" and "injected plugin fault" in err["message"] and err["error_id"]
    wait_pool_empty(demo_server.engine)


@pytest.mark.parametrize("content_type", [
    "application/x-www-form-urlencoded",  # curl's -d
    "text/plain;charset=UTF-8",  # a browser's fetch of a string body
])
def test_a_body_of_another_type_is_read_as_json(demo_server, reference, content_type):
    """Whatever type a client gave the body, it is still taken as the JSON it is."""
    (ref,) = reference.generate("12+345=", SamplingParams(max_tokens=6, temperature=0))
    with demo_server.client() as client:
        resp = client.post(C, content=b'{"prompt": "12+345=", "max_tokens": 6, "temperature": 0}',
                           headers={"content-type": content_type})
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == ref.text


def test_unknown_route_is_a_json_404(demo_server):
    with demo_server.client() as client:
        resp = client.get("/v1/nothing-here")
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"


def test_oversized_headers_get_a_json_431_and_the_server_keeps_serving():
    from _server_util import start_server

    live = start_server([], max_header_bytes=2048)
    try:
        with live.client() as client:
            resp = client.post("/v1/completions", json={"prompt": "12+3=", "max_tokens": 2},
                               headers={"X-Padding": "a" * 3000})
            assert resp.status_code == 431 and resp.headers["content-type"] == "application/json"
            err = resp.json()["error"]
            assert err["code"] == "headers_too_large" and "server.max_header_bytes" in err["message"]
            assert "at most 2048" in err["message"]
            ok = client.post("/v1/completions", json={"prompt": "12+3=", "max_tokens": 2, "temperature": 0})
            assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
        assert live.engine.rt.pool.is_empty()
    finally:
        live.stop()
