"""Structured output on the API: which constraint a body asks for, and how tool calls come back.

A body asks for at most one of ``response_format`` (json_object / json_schema), vLLM's ``structured_outputs`` or
``guided_*`` extras, and, on chat, a ``tool_choice`` that forces a call. Tool calls are generated under a
constraint and read back from the text:

* a named function (``tool_choice: {"type": "function", "function": {"name": F}}``): the output is F's
  arguments object, constrained by its ``parameters`` schema;
* ``"required"``: the output is a JSON array of ``{"name": ..., "parameters": {...}}`` objects, one of the tools
  each (at least one; exactly one with ``parallel_tool_calls: false``), as vLLM constrains it;
* ``"auto"`` (the default when tools are given): the tools go to the chat template, which must render them, and
  the model decides; calls written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the Hermes
  format of Qwen2.5/Qwen3 and others) are returned as tool calls, the text around them as content.

:class:`ToolCallReader` reads the text as it streams and hands out OpenAI deltas: argument text as it comes for a
named function, each call once it is complete otherwise.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from litellm_pipeline.constraints.spec import ConstraintSpec, to_constraint
from litellm_pipeline.errors import InvalidRequestError
from litellm_pipeline.server.protocol import ChatCompletionRequest, NamedToolChoice

__all__ = ["ToolMode", "body_constraint", "tool_mode", "ToolCallReader", "TOOL_CALL_OPEN", "TOOL_CALL_CLOSE"]

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
# vLLM's structured_outputs keys -> constraint kinds (any registered kind name is taken as itself)
_VLLM_KEYS = {"json": "json_schema"}
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolMode:
    """How a chat body's tools shape the output: ``named`` (one function's arguments), ``required`` (a JSON
    array of calls) or ``auto`` (the model's text, with Hermes tool-call blocks)."""

    kind: str
    names: tuple[str, ...]  # the tools' function names (named: just the one)


def _json_schema_value(schema: Any) -> Any:
    return schema if schema is not None else _ANY_OBJECT


def tool_mode(body: ChatCompletionRequest, template_knows_tools: bool) -> ToolMode | None:
    if not body.tools or body.tool_choice == "none":
        return None
    names = tuple(t.function.name for t in body.tools)
    if isinstance(body.tool_choice, NamedToolChoice):
        return ToolMode("named", (body.tool_choice.function.name,))
    if body.tool_choice == "required":
        return ToolMode("required", names)
    if not template_knows_tools:
        raise InvalidRequestError(
            "tool_choice", "'auto' needs a chat template that renders tools, and this model's does not: give "
            "tool_choice 'required' or a named function (both constrain the output to a call)")
    return ToolMode("auto", names)


def _tool_constraint(body: ChatCompletionRequest, mode: ToolMode) -> ConstraintSpec | None:
    params = {t.function.name: _json_schema_value(t.function.parameters) for t in body.tools}
    if mode.kind == "named":
        return ConstraintSpec("json_schema", params[mode.names[0]])
    if mode.kind == "required":
        call = [{"type": "object", "properties": {"name": {"const": n}, "parameters": params[n]},
                 "required": ["name", "parameters"]} for n in mode.names]
        array = {"type": "array", "items": call[0] if len(call) == 1 else {"anyOf": call}, "minItems": 1}
        if body.parallel_tool_calls is False:
            array["maxItems"] = 1
        return ConstraintSpec("json_schema", array)
    return None


def body_constraint(body: Any, mode: ToolMode | None = None) -> ConstraintSpec | None:
    """The one constraint a body asks for (None: free text); two at once is a 400 naming both."""
    asked: list[tuple[str, ConstraintSpec]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        asked.append(("response_format", ConstraintSpec("json_object", True)))
    elif rf is not None and rf.type == "json_schema":
        asked.append(("response_format", ConstraintSpec("json_schema", rf.json_schema.schema_)))
    if body.structured_outputs is not None:
        so = {_VLLM_KEYS.get(k, k): v for k, v in body.structured_outputs.items() if v is not None}
        if so:
            try:
                asked.append(("structured_outputs", to_constraint(so)))
            except InvalidRequestError as exc:
                raise InvalidRequestError("structured_outputs", exc.message.split(": ", 1)[-1]) from None
    for key, kind in _GUIDED.items():
        value = getattr(body, key)
        if value is not None:
            asked.append((key, to_constraint({kind: value})))
    if mode is not None:
        spec = _tool_constraint(body, mode)
        if spec is not None:
            asked.append(("tool_choice", spec))
    if len(asked) > 1:
        raise InvalidRequestError(asked[1][0], f"a request takes one structured-output constraint; it also has "
                                  f"{asked[0][0]}")
    return asked[0][1] if asked else None


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallReader:
    """Reads one choice's text (whole or in deltas) as tool calls in ``mode``'s format."""

    mode: ToolMode
    text: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool_calls, complete ones
    content: str = ""  # auto: the text outside tool-call blocks
    _scan: int = 0  # where the next unread call starts in text
    _named_started: bool = False

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """OpenAI stream deltas (``{"content": ...}`` or ``{"tool_calls": [...]}``) for this text delta."""
        self.text += delta
        if self.mode.kind == "named":
            out = []
            if not self._named_started:
                self._named_started = True
                self.calls.append({"id": _call_id(), "type": "function",
                                   "function": {"name": self.mode.names[0], "arguments": ""}})
                call = self.calls[0]
                out.append({"tool_calls": [{"index": 0, "id": call["id"], "type": "function",
                                            "function": {"name": call["function"]["name"], "arguments": ""}}]})
            self.calls[0]["function"]["arguments"] += delta
            if delta:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
            return out
        if self.mode.kind == "required":
            return [{"tool_calls": [c]} for c in self._read_array()]
        return self._read_auto(final=False)

    def finish(self) -> list[dict[str, Any]]:
        """Deltas for what the end of the text settles (auto: held-back text that was no tool call after all)."""
        if self.mode.kind == "named" and not self._named_started:
            return self.feed("")
        return self._read_auto(final=True) if self.mode.kind == "auto" else []

    def _emit(self, name: str, arguments: Any) -> dict[str, Any]:
        call = {"id": _call_id(), "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
        self.calls.append(call)
        return {"index": len(self.calls) - 1, **call}

    def _read_array(self) -> list[dict[str, Any]]:
        out = []
        decoder = json.JSONDecoder()
        while True:
            m = re.compile(r"\s*[\[,]\s*").match(self.text, self._scan)
            if m is None:
                return out
            try:
                obj, end = decoder.raw_decode(self.text, m.end())
            except json.JSONDecodeError:
                return out  # not complete yet
            self._scan = end
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                out.append(self._emit(obj["name"], obj.get("parameters", {})))

    def _read_auto(self, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            rest = self.text[self._scan:]
            start = rest.find(TOOL_CALL_OPEN)
            if start < 0:
                # hold back a tail that may be the start of an opening tag
                keep = 0 if final else next((k for k in range(min(len(rest), len(TOOL_CALL_OPEN) - 1), 0, -1)
                                             if TOOL_CALL_OPEN.startswith(rest[-k:])), 0)
                text = rest[:len(rest) - keep]
                if text:
                    self.content += text
                    out.append({"content": text})
                self._scan += len(text)
                return out
            if start:
                self.content += rest[:start]
                out.append({"content": rest[:start]})
                self._scan += start
                continue
            end = rest.find(TOOL_CALL_CLOSE)
            if end < 0:
                if final:  # an unclosed block: it stays text
                    self.content += rest
                    out.append({"content": rest})
                    self._scan += len(rest)
                return out
            body = rest[len(TOOL_CALL_OPEN):end]
            self._scan += end + len(TOOL_CALL_CLOSE)
            call = _parse_call(body, self.mode.names)
            if call is None:
                block = rest[:end + len(TOOL_CALL_CLOSE)]
                self.content += block
                out.append({"content": block})
            else:
                out.append({"tool_calls": [self._emit(*call)]})


def _parse_call(body: str, names: tuple[str, ...]) -> tuple[str, Any] | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return obj["name"], args
