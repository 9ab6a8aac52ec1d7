"""Structured output through a real server and the official ``openai`` client: ``response_format`` (json_object,
json_schema, ``beta.chat.completions.parse`` with a pydantic model) on both endpoints, vLLM's extras, tool calls
(named, required, auto) streamed and not, and the 400s of bad schemas, regexes and grammars. The model is a tiny
random-weight checkpoint with a byte-level vocabulary: nothing but the constraint makes its output valid."""

from __future__ import annotations

import json
import os
import time
from typing import Literal

import httpx
import jsonschema
import pytest
from _server_util import start_server, wait_pool_empty, with_chat_template
from pydantic import BaseModel, Field

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM reads its price map from the package

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
          "required": ["name", "age", "pets"]}
# a chat template that renders tools the way Qwen's does (Hermes tool-call blocks)
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}:{{ c.function.arguments.zone }}</tool_call>"
    "{% endfor %}\n{% endfor %}<|assistant|>"
)


@pytest.fixture(scope="module")
def server(hf_checkpoint):
    live = start_server([f"model.path={hf_checkpoint('llama')}"], model_name="tiny")
    yield live
    live.stop()


@pytest.fixture(scope="module")
def tool_server(hf_checkpoint, tmp_path_factory):
    path = with_chat_template(hf_checkpoint("llama"), tmp_path_factory.mktemp("tools") / "ckpt", TOOL_TEMPLATE)
    live = start_server([f"model.path={path}"], model_name="tiny")
    yield live
    live.stop()


def _chat(**kw):
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 120, **kw}


def test_json_schema_response_format_on_both_endpoints(server):
    client = server.openai()
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(3):
        chat = client.chat.completions.create(**_chat(response_format=rf, temperature=1.0, seed=seed))
        (c,) = chat.choices
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), PERSON)
        comp = client.completions.create(model="tiny", prompt=f"person {seed}:", max_tokens=120, temperature=0.8,
                                         seed=seed, extra_body={"response_format": rf})
        jsonschema.validate(json.loads(comp.choices[0].text), PERSON)
    wait_pool_empty(server.engine)


def test_json_object_mode(server):
    resp = server.openai().chat.completions.create(**_chat(response_format={"type": "json_object"}, temperature=0))
    (c,) = resp.choices
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:  # any object may be long: cut short it is an object's start
        assert c.finish_reason == "length" and c.message.content.startswith("{")


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    legs: int = Field(ge=0, le=8)
    indoor: bool


def test_openai_beta_parse_with_a_pydantic_model(server):
    client = server.openai()
    for seed in range(2):
        completion = client.beta.chat.completions.parse(
            model="tiny", messages=[{"role": "user", "content": "a pet"}], response_format=Pet, max_tokens=80,
            temperature=1.0, seed=seed)
        parsed = completion.choices[0].message.parsed
        assert isinstance(parsed, Pet)
        assert Pet.model_validate_json(completion.choices[0].message.content) == parsed


def test_vllm_extras_regex_choice_grammar(server):
    client = server.openai()
    r = client.completions.create(model="tiny", prompt="phone:", max_tokens=20, temperature=1.0, seed=1,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}})
    assert __import__("re").fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].text)
    r = client.chat.completions.create(**_chat(temperature=1.0, seed=2, extra_body={"guided_choice": ["red", "green"]}))
    assert r.choices[0].message.content in ("red", "green")
    grammar = 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'
    r = client.completions.create(model="tiny", prompt="sum:", max_tokens=30, temperature=1.0, seed=3,
                                  extra_body={"structured_outputs": {"grammar": grammar}})
    text = r.choices[0].text
    assert r.choices[0].finish_reason == "length" or __import__("re").fullmatch(r"\([0-9]+(\+[0-9]+)*\)", text), text
    r = client.completions.create(model="tiny", prompt="j:", max_tokens=120, temperature=0.5, seed=4,
                                  extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_streamed_structured_output_joins_to_valid_json(server):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    chunks = list(server.openai().chat.completions.create(**_chat(response_format=rf, temperature=1.0, seed=7,
                                                                  stream=True)))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) > 3  # really streamed
    jsonschema.validate(json.loads(text), PERSON)
    assert chunks[-1].choices[0].finish_reason == "stop"


def _check_call(call, tools=TOOLS):
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])


def test_named_tool_choice_returns_valid_arguments(server):
    client = server.openai()
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        resp = client.chat.completions.create(**_chat(tools=TOOLS, tool_choice=choice, temperature=1.0, seed=seed))
        (c,) = resp.choices
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather"
        _check_call(call)


def test_required_tool_choice_returns_calls_of_the_given_tools(server):
    client = server.openai()
    names = set()
    for seed in range(4):
        resp = client.chat.completions.create(**_chat(tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
                                                      parallel_tool_calls=False, max_tokens=150))
        (c,) = resp.choices
        assert c.finish_reason == "tool_calls", c
        (call,) = c.message.tool_calls  # parallel_tool_calls false: exactly one
        _check_call(call)
        names.add(call.function.name)
    assert names <= {"get_weather", "get_time"}


def test_tool_calls_stream_as_openai_streams_them(server):
    client = server.openai()
    for tool_choice in ({"type": "function", "function": {"name": "get_time"}}, "required"):
        stream = client.chat.completions.create(**_chat(tools=TOOLS, tool_choice=tool_choice, temperature=1.0,
                                                        seed=5, stream=True, max_tokens=150))
        calls: dict[int, dict] = {}
        finish = None
        for ch in stream:
            if not ch.choices:
                continue
            d = ch.choices[0].delta
            for tc in d.tool_calls or ():
                entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert entry["id"] is None, "a call's id comes once, in its first delta"
                    entry["id"], entry["name"] = tc.id, tc.function.name
                entry["arguments"] += tc.function.arguments or ""
            finish = ch.choices[0].finish_reason or finish
        assert finish == "tool_calls" and calls
        params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for entry in calls.values():
            assert entry["id"].startswith("call_")
            jsonschema.validate(json.loads(entry["arguments"]), params[entry["name"]])


def test_auto_tool_choice_needs_a_template_that_knows_tools(server):
    with server.client() as http:
        r = http.post("/v1/chat/completions", json=_chat(tools=TOOLS, tool_choice="auto"))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "tool_choice" and "renders tools" in err["message"]


CLOCK = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer"}}}}}]


def test_auto_tool_choice_renders_tools_and_reads_hermes_calls(tool_server):
    client = tool_server.openai()
    plain = client.chat.completions.create(**_chat(max_tokens=2))
    with_tools = client.chat.completions.create(**_chat(max_tokens=2, tools=CLOCK))
    # the template wrote the tool into the prompt (one token per byte here)
    assert with_tools.usage.prompt_tokens >= plain.usage.prompt_tokens + len('<tools>{"function":</tools>')
    # the model's text holds a Hermes block (a grammar makes this random model write one): a tool call comes back
    grammar = ('root ::= "ok " "<tool_call>" "{\\"name\\":\\"get_time\\",\\"arguments\\":{\\"zone\\":" [1-9] "}}" '
               '"</tool_call>"')
    for stream in (False, True):
        resp = client.chat.completions.create(**_chat(tools=CLOCK, temperature=1.0, seed=1, stream=stream,
                                                      extra_body={"structured_outputs": {"grammar": grammar}}))
        if stream:
            content, calls, finish = "", [], None
            for ch in resp:
                if ch.choices:
                    content += ch.choices[0].delta.content or ""
                    calls += ch.choices[0].delta.tool_calls or []
                    finish = ch.choices[0].finish_reason or finish
            (call,) = calls
            name, args = call.function.name, call.function.arguments
        else:
            (c,) = resp.choices
            content, finish = c.message.content, c.finish_reason
            (call,) = c.message.tool_calls
            name, args = call.function.name, call.function.arguments
        assert content == "ok " and finish == "tool_calls"
        assert name == "get_time" and 1 <= json.loads(args)["zone"] <= 9


def test_a_tool_turn_round_trips_through_the_template(tool_server):
    msgs = [{"role": "user", "content": "time?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": 2}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    client = tool_server.openai()
    resp = client.chat.completions.create(model="tiny", messages=msgs, tools=CLOCK, max_tokens=3)
    without = client.chat.completions.create(model="tiny", messages=msgs[::2], tools=CLOCK, max_tokens=3)
    # the assistant turn rendered with its call's arguments read as a mapping (one token per byte here)
    turn = "<|assistant|><tool_call>get_time:2</tool_call>"  # (the newline after a block tag is trimmed)
    assert resp.usage.prompt_tokens - without.usage.prompt_tokens == len(turn)


@pytest.mark.parametrize("body, param, words", [
    (_chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
     "constraint.json_schema", "Unsupported type"),
    (_chat(structured_outputs={"regex": "(a"}), "constraint.regex", "parenthesis"),
    (_chat(structured_outputs={"grammar": "root ::= undefined"}), "constraint.grammar", "undefined"),
    (_chat(guided_choice=[]), "constraint.choice", "non-empty"),
    (_chat(structured_outputs={"no_such_kind": 1}), "constraint", "unknown constraint 'no_such_kind'"),
    (_chat(response_format={"type": "json_object"}, guided_regex="a"), "guided_regex", "one structured-output"),
    (_chat(response_format={"type": "json_schema"}), "response_format", "needs json_schema"),
    (_chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "nope"),
    (_chat(tool_choice="required"), "tool_choice", "needs tools"),
])
def test_bad_constraints_get_a_400_naming_them(server, body, param, words):
    with server.client() as http:
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"], err
    assert param in (err.get("param") or "") + err["message"], err
    wait_pool_empty(server.engine)


def test_pathological_constraints_are_refused_quickly_and_the_server_keeps_serving(server):
    deep = {"type": "string"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    huge = {"enum": [f"value-{i}-" + "x" * 40 for i in range(4000)]}
    with server.client() as http:
        for body, words in ((_chat(guided_json=deep), "nested"), (_chat(guided_json=huge), "bytes of JSON")):
            t0 = time.monotonic()
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
            assert time.monotonic() - t0 < 5
        ok = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3})
        assert ok.status_code == 200


def test_slow_compile_times_out_with_a_400_and_others_keep_running(server, monkeypatch):
    from litellm_pipeline import registry
    from litellm_pipeline.constraints.kinds import Regex

    compiler = server.engine.rt.constraints
    monkeypatch.setattr(compiler, "settings", compiler.settings.__class__(compile_timeout_s=0.3))

    class Slow(Regex):
        def compile(self, value):
            time.sleep(1.0)
            return super().compile(value)

    registry.add("constraint", "slow_regex", Slow)
    try:
        with server.client() as http:
            free = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "y", "max_tokens": 2})
            assert free.status_code == 200
            t0 = time.monotonic()
            r = http.post("/v1/chat/completions", json=_chat(structured_outputs={"slow_regex": "[a-z]+"}))
            assert r.status_code == 400 and "longer than 0.3 s" in r.json()["error"]["message"], r.text
            assert time.monotonic() - t0 < 1.0
            # the same spec again: refused at once, not compiled again
            t0 = time.monotonic()
            r = http.post("/v1/chat/completions", json=_chat(structured_outputs={"slow_regex": "[a-z]+"}))
            assert r.status_code == 400 and time.monotonic() - t0 < 0.25
    finally:
        registry.remove("constraint", "slow_regex")
        compiler._kinds.pop("slow_regex", None)
    wait_pool_empty(server.engine)


def test_litellm_sdk_gets_tool_calls_and_json(server):
    litellm = pytest.importorskip("litellm")
    kw = dict(model="openai/tiny", api_base=server.url + "/v1", api_key="unused", max_tokens=120, temperature=1.0,
              seed=3, messages=[{"role": "user", "content": "weather?"}])
    resp = litellm.completion(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kw)
    (call,) = resp.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    resp = litellm.completion(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
                              **kw)
    jsonschema.validate(json.loads(resp.choices[0].message.content), PERSON)


def _strict_json(text: str):
    def refuse(const):
        raise AssertionError(f"{const} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_logprobs_of_masked_tokens_are_json_numbers(server):
    """Alternatives a constraint masked out have log-probability -inf, which JSON cannot carry: -9999 (vLLM's)."""
    chat = _chat(max_tokens=5, logprobs=True, top_logprobs=5, guided_choice=["yes", "no"])
    comp = {"model": "tiny", "prompt": "x", "max_tokens": 5, "logprobs": 5, "guided_choice": ["yes", "no"]}
    with server.client() as http:
        r = http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        entries = _strict_json(r.text)["choices"][0]["logprobs"]["content"]
        tops = [t["logprob"] for e in entries for t in e["top_logprobs"]]
        assert -9999.0 in tops and all(-9999.0 <= v <= 0 for v in tops)
        r = http.post("/v1/completions", json={**comp, "stream": True})
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: {")]
        tops = [v for ev in events for c in _strict_json(ev)["choices"] if c["logprobs"]
                for alts in c["logprobs"]["top_logprobs"] for v in alts.values()]
        assert -9999.0 in tops and all(-9999.0 <= v <= 0 for v in tops)
