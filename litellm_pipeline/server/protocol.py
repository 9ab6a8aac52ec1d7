"""The request bodies of the OpenAI-compatible API, as pydantic models (FastAPI validates and documents them).

These models check *types* (strictly: ``true`` is not a number, ``1.5`` is not an integer, ``"0.5"`` is not a
float) and the shape of the prompt or messages. Value *ranges* of the sampling fields are
:class:`~litellm_pipeline.sampling.SamplingParams`' job, so the limits live in one place; the request is turned
into :class:`~litellm_pipeline.request_spec.RequestSpec` objects by :mod:`litellm_pipeline.server.specs`.

Beyond OpenAI's fields a body may carry the runtime's own: ``tier``, ``budget`` (a BudgetSpec mapping),
``session_id``, ``priority``, ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, and
vLLM's structured-output extras: ``structured_outputs`` (``{"json"|"regex"|"choice"|"grammar"|"json_object"|<a
constraint kind>: value}``) and the older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.
Unknown fields are refused (a typo like ``max_token`` must not be silently ignored); OpenAI fields this server
does not implement are refused by name unless they hold their neutral value.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["CompletionRequest", "ChatCompletionRequest", "ChatMessage", "StreamOptions", "ResponseFormat", "Tool",
           "NamedToolChoice"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


# OpenAI fields not implemented here, with the values that mean "not used" (those are accepted)
_NEUTRAL: dict[str, tuple] = {
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "logit_bias": (None, {}),
    "functions": (None, []),
    "function_call": (None, "none"),
}


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: OpenAI's structured outputs."""

    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None  # outputs always validate against the schema here, strict or not

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("type json_schema needs json_schema: {name, schema}")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema: only allowed with type json_schema (got type {self.type})")
        return self


class FunctionDef(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object; None: no arguments
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class _Common(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None: the served model
    n: int = Field(default=1, ge=1)  # the server's cap (server.max_n) is checked when the specs are built
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # accepted and ignored (OpenAI's end-user id)
    # the runtime's own fields
    tier: str | None = None
    budget: dict[str, Any] | None = None
    session_id: str | None = None
    priority: int = 0
    num_speculative_tokens: int | None = Field(default=None, ge=0)  # speculative decoding: 0 off, fewer drafted
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    # structured output (litellm_pipeline/constraints): at most one of these per request
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # refused unless neutral (see _NEUTRAL)
    echo: Any = None
    suffix: Any = None
    best_of: Any = None
    logit_bias: Any = None
    functions: Any = None
    function_call: Any = None

    @field_validator("n", "stream", "priority", mode="before")
    @classmethod
    def _null_is_default(cls, v: Any, info) -> Any:
        """OpenAI's API takes null for its optional fields: null means the default."""
        return cls.model_fields[info.field_name].default if v is None else v

    @field_validator(*_NEUTRAL, mode="before")
    @classmethod
    def _not_implemented(cls, v: Any, info) -> Any:
        if not any(v == ok and type(v) is type(ok) for ok in _NEUTRAL[info.field_name]):
            raise ValueError("is not supported by this server")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of either (one choice set each)."""

    prompt: Any
    max_tokens: int | None = None  # None: 16, or what the context leaves
    logprobs: int | None = None  # the top-k alternatives per token (0: only the sampled token's)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        def is_ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(v, str) or is_ids(v):  # [] is an empty id list: the engine says the prompt is empty
            return v
        if isinstance(v, list) and v and all(isinstance(p, str) or (is_ids(p) and p) for p in v):
            return v
        raise ValueError("must be a string, a list of token ids, or a non-empty list of strings / token-id lists")


class TextPart(_Strict):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _only_text(self):
        if self.type != "text" or self.text is None:
            raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
        return self


# the roles OpenAI's chat API knows; a template renders only these, so another one is refused by name
ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ToolCallFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: ChatRole
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def as_template_message(self) -> dict[str, Any]:
        """The message as chat templates read it (text parts joined by newlines, as vLLM does)."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(p.text or "" for p in content)
        msg: dict[str, Any] = {"role": self.role, "content": content if content is not None else ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls is not None:
            # templates read the arguments as a mapping (vLLM and transformers' chat templates do)
            msg["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``: ``messages`` rendered with the checkpoint's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens; both accepted
    max_completion_tokens: int | None = None  # None: what the context leaves
    logprobs: bool = False
    top_logprobs: int | None = None  # needs logprobs: true
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}; None: "auto" with tools
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("logprobs", "add_generation_prompt", mode="before")
    @classmethod
    def _chat_null_is_default(cls, v: Any, info) -> Any:
        return cls.model_fields[info.field_name].default if v is None else v

    @model_validator(mode="after")
    def _consistent(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or ()]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice: names function {self.tool_choice.function.name!r}, which tools do not "
                                 f"define (defined: {', '.join(names) or 'none'})")
        elif self.tool_choice in ("auto", "required") and not self.tools:
            raise ValueError(f"tool_choice: {self.tool_choice!r} needs tools")
        if self.tools:
            seen = [t.function.name for t in self.tools]
            dup = sorted({n for n in seen if seen.count(n) > 1})
            if dup:
                raise ValueError(f"tools: function names must be unique (repeated: {', '.join(dup)})")
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise ValueError(
                f"max_tokens: {self.max_tokens} and max_completion_tokens {self.max_completion_tokens} disagree "
                "(send one of them)"
            )
        return self

