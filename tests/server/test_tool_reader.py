"""ToolCallReader: the text of a choice read back as OpenAI tool calls, whole or in any split into deltas."""

from __future__ import annotations

import json

import pytest

from litellm_pipeline.server.tools import ToolCallReader, ToolMode

AUTO = ToolMode("auto", ("get_time", "get_weather"))
TEXT = ('Let me check. <tool_call>{"name": "get_time", "arguments": {"zone": 2}}</tool_call>'
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call> and <tool_c')


def _read(mode, text, cuts):
    reader = ToolCallReader(mode)
    deltas, at = [], 0
    for cut in [*cuts, len(text)]:
        deltas += reader.feed(text[at:cut])
        at = cut
    return reader, deltas + reader.finish()


@pytest.mark.parametrize("cuts", [[], [3, 20, 21, 22, 60], list(range(1, len(TEXT)))])
def test_auto_reads_hermes_blocks_whatever_the_split(cuts):
    reader, deltas = _read(AUTO, TEXT, cuts)
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", ())]
    # a block naming no given tool, and an unfinished tag, stay text
    assert content == reader.content == ('Let me check. <tool_call>{"name": "nope", "arguments": {}}</tool_call>'
                                         ' and <tool_c')
    (call,) = calls
    assert call["index"] == 0 and call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"]) == {"zone": 2}
    assert reader.calls == [{k: v for k, v in call.items() if k != "index"}]


def test_auto_holds_back_only_what_may_open_a_tag():
    reader = ToolCallReader(AUTO)
    assert reader.feed("abc <tool") == [{"content": "abc "}]
    assert reader.feed("box") == [{"content": "<toolbox"}]


@pytest.mark.parametrize("cuts", [[], [1, 2, 30, 31], list(range(1, 80))])
def test_required_emits_each_call_once_complete(cuts):
    text = '[{"name":"get_time","parameters":{"zone":1}},{"name":"get_weather","parameters":{"city":"x"}}]'
    reader, deltas = _read(ToolMode("required", ("get_time", "get_weather")), text, cuts)
    calls = [c for d in deltas for c in d["tool_calls"]]
    assert [c["index"] for c in calls] == [0, 1]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"zone": 1}, {"city": "x"}]


def test_named_streams_arguments_as_they_come():
    reader, deltas = _read(ToolMode("named", ("f",)), '{"a":1}', [2, 5])
    first, *rest = deltas
    assert first["tool_calls"][0]["function"] == {"name": "f", "arguments": ""} and first["tool_calls"][0]["id"]
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in rest) == '{"a":1}'
    assert reader.calls[0]["function"]["arguments"] == '{"a":1}'
