"""API request -> :class:`RequestSpec` objects: the only thing the server hands the engine.

The server tokenizes here (text with the tokenizer's post-processor, exactly as ``Engine.add_request`` would;
chat renders the template and tokenizes without adding special tokens again, as ``transformers`` does) because
OpenAI's contract needs the prompt length before anything runs: an explicit ``max_tokens`` that does not fit
beside the prompt is a 400 naming both numbers, where the engine alone would silently cap it. Everything else
(empty prompts, ids outside the vocabulary, a prompt as long as the context, unknown tiers, budgets) is the
engine's request stages' to reject.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

from litellm_pipeline.errors import InvalidRequestError, InvalidValueError
from litellm_pipeline.request_spec import RequestSpec
from litellm_pipeline.sampling import SamplingParams
from litellm_pipeline.server.protocol import ChatCompletionRequest, CompletionRequest
from litellm_pipeline.server.tools import ToolMode, body_constraint, tool_mode
from litellm_pipeline.text.tokenizer import Tokenizer, TokenizerError, not_unicode

__all__ = ["Choice", "Limits", "completion_specs", "chat_specs", "COMPLETION_DEFAULT_MAX_TOKENS"]

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: whatever the context leaves)
_SEED_MAX = 2**64 - 1
# body field -> SamplingParams field, for the fields passed through unchanged when given
_PASSED = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "stop", "top_k", "min_p",
           "repetition_penalty", "ignore_eos", "stop_token_ids")
_FIELD = re.compile(r"^(\w+)")


@dataclass(frozen=True)
class Limits:
    """What the request is checked against: the model's context and the server's caps."""

    max_model_len: int
    max_n: int
    max_prompts: int


@dataclass(frozen=True)
class Choice:
    """One engine request of an API request: OpenAI's ``index`` (prompt * n + j) and which prompt it answers."""

    index: int
    prompt_index: int
    spec: RequestSpec
    tools: ToolMode | None = None  # chat with tools: how its text is read back as tool calls


def completion_specs(body: CompletionRequest, tok: Tokenizer, limits: Limits, tenant: str = "") -> list[Choice]:
    prompts = body.prompt if _is_prompt_list(body.prompt) else [body.prompt]
    if len(prompts) > limits.max_prompts:
        raise InvalidRequestError(
            "prompt", f"{len(prompts)} prompts in one request; this server takes at most {limits.max_prompts} "
            "(server.max_prompts)")
    ids = []
    for p in prompts:
        if p == "":
            raise InvalidRequestError("prompt", "is empty: it must hold at least one token")
        try:
            ids.append(tok.encode(p) if isinstance(p, str) else list(p))
        except TokenizerError as exc:
            raise InvalidRequestError("prompt" if len(prompts) == 1 else f"prompt[{len(ids)}]", str(exc)) from None
    return _choices(body, ids, body.max_tokens, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS, body.logprobs,
                    limits, tenant, constraint=body_constraint(body))


def chat_specs(body: ChatCompletionRequest, tok: Tokenizer, limits: Limits, tenant: str = "") -> list[Choice]:
    for i, m in enumerate(body.messages):
        parts = [("content", m.content)] if isinstance(m.content, str) else [
            (f"content[{j}].text", p.text) for j, p in enumerate(m.content or ())]
        for key, text in [*parts, ("name", m.name)]:  # (the role: pydantic refuses it already)
            problem = not_unicode(text) if text is not None else None
            if problem is not None:
                raise InvalidRequestError(f"messages[{i}].{key}", problem)
    messages = [m.as_template_message() for m in body.messages]
    mode = tool_mode(body, template_knows_tools(tok))
    constraint = body_constraint(body, mode)
    extra = {}
    if body.tools and body.tool_choice != "none" and template_knows_tools(tok):
        extra["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt, **extra)
    except TokenizerError as exc:
        if not tok.chat_templates:
            raise InvalidRequestError(
                "messages", "this model has no chat template (its tokenizer_config.json / chat_template.jinja "
                "define none): use /v1/completions with a plain prompt") from None
        raise InvalidRequestError("messages", str(exc)) from None
    ids = tok.encode(text, add_special_tokens=False)  # the template wrote the special tokens it wants
    if not ids:
        raise InvalidRequestError("messages", "the chat template rendered them to an empty prompt")
    key = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _choices(body, [ids], asked, key, None, logprobs, limits, tenant, logprobs_key="top_logprobs",
                    constraint=constraint, tools=mode)


def template_knows_tools(tok: Tokenizer) -> bool:
    """Whether the chat template renders a ``tools`` list (a "tool_use" template, or one that reads ``tools``)."""
    return "tool_use" in tok.chat_templates or "tools" in tok.chat_templates.get("default", "")


def _is_prompt_list(p: Any) -> bool:
    return isinstance(p, list) and bool(p) and not isinstance(p[0], int)


def _choices(body, prompts: list[list[int]], asked: int | None, key: str, default: int | None,
             logprobs: int | None, limits: Limits, tenant: str, logprobs_key: str = "logprobs",
             constraint=None, tools: ToolMode | None = None) -> list[Choice]:
    if body.n > limits.max_n:
        raise InvalidRequestError("n", f"must be <= {limits.max_n} (got {body.n}): the server's cap (server.max_n)")
    base = uuid.uuid4().hex[:16]
    fields = {k: v for k in _PASSED if (v := getattr(body, k)) is not None}
    if logprobs is not None:
        fields["logprobs"] = logprobs
    extra = dict(tier=body.tier, budget=body.budget, tenant=tenant, priority=body.priority,
                 session_id=body.session_id, constraint=constraint, num_speculative_tokens=body.num_speculative_tokens)
    out = []
    for i, ids in enumerate(prompts):
        max_tokens = _max_tokens(asked, key, default, len(ids), limits.max_model_len)
        for j in range(body.n):
            seed = body.seed
            if seed is not None and j:  # n choices from one seed must differ, and each be reproducible
                seed = seed + j if seed + j <= _SEED_MAX else seed - j
            params = _params({**fields, "max_tokens": max_tokens, "seed": seed},
                             {"max_tokens": key, "logprobs": logprobs_key})
            out.append(Choice(i * body.n + j, i, RequestSpec(ids, params, request_id=f"{base}-{i}-{j}", **extra),
                              tools))
    return out


def _max_tokens(asked: int | None, key: str, default: int | None, n_prompt: int, max_len: int) -> int:
    room = max_len - n_prompt
    if asked is None:  # a default never makes a request fail: it shrinks to what the context leaves
        return max(1, min(default, room) if default is not None else room)
    if asked >= 1 and room >= 1 and asked > room:
        raise InvalidRequestError(
            key, f"the prompt ({n_prompt} tokens) + {key} ({asked}) = {n_prompt + asked} tokens exceeds the "
            f"model's context of {max_len} tokens: lower {key} to at most {room}")
    return asked  # < 1 is SamplingParams' to refuse; a prompt that fills the context, the engine's


def _params(fields: dict[str, Any], api_names: dict[str, str]) -> SamplingParams:
    """SamplingParams of the fields; an invalid one is an InvalidRequestError under the API's name for it
    (chat's ``max_completion_tokens`` and ``top_logprobs`` are SamplingParams' ``max_tokens`` and ``logprobs``)."""
    try:
        return SamplingParams.model_validate(fields)
    except InvalidValueError as exc:
        message = "; ".join(str(exc).splitlines())  # one line per field, each "field: what is allowed (got x)"
        named = _FIELD.match(message)
        name = named.group(1) if named else "params"
        if api_names.get(name, name) != name:
            name, message = api_names[name], api_names[name] + message[len(name):]
        prefix = f"{name}: "
        raise InvalidRequestError(name, message[len(prefix):] if message.startswith(prefix) else message) from None
