"""Engine outputs -> OpenAI response bodies and stream chunks (plain dicts; FastAPI serialises them).

A :class:`ChoiceState` follows one engine request through its deltas: the text so far, the logprobs entries
of the tokens that arrived (OpenAI's completions and chat formats differ), and the final output with its cost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable

from litellm_pipeline.engine.request import RequestOutput
from litellm_pipeline.server.tools import ToolCallReader
from litellm_pipeline.text.tokenizer import Tokenizer

__all__ = ["ChoiceState", "TokenText", "usage", "completion_body", "chat_body", "chunk"]


class TokenText:
    """Each token id's text as logprobs show it (special tokens included), memoised per id: as it reads after
    other text (``token_text(i)``), or at the start of a text (``token_text.at_start(i)``, for a completion's
    first token: the engine's text is ``decode(output_ids)``). A sentencepiece word token ("▁world") reads
    " world" after other text, but its decoder drops the space at the start; so a token is decoded after an
    anchor token (one that reads as a single letter or digit) and the anchor's text cut off. Byte-level tokens
    read the same either way. A completion's tokens so join to its text."""

    def __init__(self, tok: Tokenizer):
        anchor = _anchor(tok)
        alone = lru_cache(maxsize=1 << 16)(lambda i: tok.decode([i], skip_special_tokens=False))

        def after_text(i: int) -> str:
            if anchor is None:
                return alone(i)
            head, head_text = anchor
            both = tok.decode([head, i], skip_special_tokens=False)
            return both[len(head_text):] if both.startswith(head_text) else alone(i)

        self.at_start: Callable[[int], str] = alone
        self._text: Callable[[int], str] = lru_cache(maxsize=1 << 16)(after_text)

    def __call__(self, token_id: int) -> str:
        return self._text(token_id)


def _anchor(tok: Tokenizer) -> tuple[int, str] | None:
    """A token id that is its text alone (one letter or digit) and that text; None if the vocabulary has none."""
    for ch in "a0x":
        # "a" may encode as a word start ("▁a") or as "▁" then "a"
        for i in tok.encode(ch, add_special_tokens=False):
            if tok.decode([i], skip_special_tokens=False) == ch:
                return i, ch
    return None


# what a token a constraint masked out (log-probability -inf) reports: JSON has no -inf, and vLLM says -9999
MIN_LOGPROB = -9999.0


def _logprob(v: float) -> float:
    return max(float(v), MIN_LOGPROB)


@dataclass
class ChoiceState:
    """One choice (one engine request) of an API request."""

    index: int
    prompt_index: int
    chat: bool
    top_k: int | None  # logprobs asked for (alternatives per token), None: no logprobs
    text: str = ""
    final: RequestOutput | None = None
    # completions format
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    # chat format
    content: list[dict[str, Any]] = field(default_factory=list)
    reader: ToolCallReader | None = None  # chat with tools: the text read back as tool calls
    tool_deltas: list[dict[str, Any]] = field(default_factory=list)  # the stream deltas of the latest add()
    listed: int = 0  # output tokens whose logprobs were given

    def add(self, out: RequestOutput, token_text: TokenText) -> tuple[str, dict | None]:
        """Take one delta; returns its text and its logprobs in this choice's format (None if not asked)."""
        self.text += out.delta_text
        if out.finished:
            self.final = out
        if self.reader is not None:
            self.tool_deltas = self.reader.feed(out.delta_text) + (self.reader.finish() if out.finished else [])
        if self.top_k is None or out.logprobs is None:
            return out.delta_text, None
        # out.logprobs is the request's whole (growing) list; a token is given once its part of the text is out
        entries, offsets = [], []
        for i, start, end in self._ready(out):
            entries.append(self._entry(out.token_ids[i], out.logprobs[i], token_text.at_start if i == 0 else token_text,
                                       self.text[start:end]))
            offsets.append(start)
        if self.chat:
            self.content += entries
            return out.delta_text, {"content": entries}
        delta = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for (token, lp, top), at in zip(entries, offsets):
            for key, value in zip(delta, (token, lp, top, at)):
                delta[key].append(value)
        for key in delta:
            getattr(self, key).extend(delta[key])
        return out.delta_text, delta

    def _ready(self, out: RequestOutput) -> list[tuple[int, int, int]]:
        """``(index, start, end)`` of the output tokens not given yet whose part of the text is out: ``text[start:end]``
        (the engine's offsets; a token whose text the detokenizer still holds back waits, as its text does). Once
        finished, the tokens that start at or after the text's end are never given: the end-of-sequence or stop
        token that ended it, and what a stop string cut off. So the tokens join to the text."""
        offsets, ends, n = out.text_offsets, out.text_ends, len(self.text)
        got, i = [], self.listed
        while i < len(out.token_ids):
            start, end = offsets[i], ends[i]
            if out.finished:
                if start >= n:
                    break
                end = n if end is None else min(end, n)
            elif end is None or end > n:
                break
            got.append((i, start, end))
            i += 1
        self.listed = len(out.token_ids) if out.finished else i
        return got

    def _entry(self, token_id: int, lps: dict[int, float], token_text: TokenText, text: str | None = None):
        """One token's logprobs: ``text`` its part of the output text (default: how the token reads alone);
        the alternatives read as tokens do."""
        token = token_text(token_id) if text is None else text
        lp = _logprob(lps.get(token_id, float("-inf")))
        # the engine's dict holds the sampled token and the top k; the top k are the k highest
        top = sorted(lps.items(), key=lambda kv: -kv[1])[: self.top_k]
        if not self.chat:
            # keyed by text, as OpenAI's format is: of tokens that read alike, the likeliest keeps the key
            alts: dict[str, float] = {}
            for t, v in top:
                alts.setdefault(token_text(t), _logprob(v))
            return token, lp, alts
        return {"token": token, "logprob": lp, "bytes": list(token.encode()),
                "top_logprobs": [{"token": token_text(t), "logprob": _logprob(v), "bytes": list(token_text(t).encode())}
                                 for t, v in top]}

    def logprobs_body(self) -> dict | None:
        if self.top_k is None:
            return None
        if self.chat:
            return {"content": self.content}
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}

    @property
    def finish_reason(self) -> str | None:
        reason = self.final.finish_reason if self.final is not None else None
        if reason == "stop" and self.reader is not None and self.reader.calls:
            return "tool_calls"
        return reason

    def message(self) -> dict[str, Any]:
        """The chat choice's message: its text, or its tool calls (and, for "auto", the text around them)."""
        if self.reader is None:
            return {"role": "assistant", "content": self.text}
        msg: dict[str, Any] = {"role": "assistant", "content": self.reader.content or None}
        if self.reader.calls:
            msg["tool_calls"] = self.reader.calls
        elif self.reader.mode.kind != "auto":  # a forced call that did not complete (e.g. max_tokens): the text
            msg["content"] = self.text
        return msg

    @property
    def cost(self) -> dict | None:
        return self.final.cost.as_dict() if self.final is not None and self.final.cost is not None else None


def usage(choices: list[ChoiceState]) -> dict[str, Any]:
    """Token counts: each prompt once (whatever ``n``), every choice's generated tokens."""
    prompts: dict[int, RequestOutput] = {}
    completion = 0
    for c in choices:
        if c.final is None:
            continue
        prompts.setdefault(c.prompt_index, c.final)
        completion += len(c.final.token_ids)
    prompt = sum(len(o.prompt_token_ids) for o in prompts.values())
    cached = sum(o.num_cached_tokens for o in prompts.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _head(rid: str, obj: str, model: str, created: int) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model}


def completion_body(rid: str, model: str, choices: list[ChoiceState]) -> dict[str, Any]:
    return {**_head(rid, "text_completion", model, int(time.time())),
            "choices": [{"index": c.index, "text": c.text, "logprobs": c.logprobs_body(),
                         "finish_reason": c.finish_reason, "cost": c.cost} for c in choices],
            "usage": usage(choices)}


def chat_body(rid: str, model: str, choices: list[ChoiceState]) -> dict[str, Any]:
    return {**_head(rid, "chat.completion", model, int(time.time())),
            "choices": [{"index": c.index, "message": c.message(),
                         "logprobs": c.logprobs_body(), "finish_reason": c.finish_reason, "cost": c.cost}
                        for c in choices],
            "usage": usage(choices)}


def chunk(rid: str, model: str, created: int, chat: bool, choices: list[dict[str, Any]],
          usage_body: dict | None = None, with_usage: bool = False) -> dict[str, Any]:
    """One server-sent event's body. With ``stream_options.include_usage`` every chunk has ``usage``: null,
    except the last, which has no choices and the totals (OpenAI's layout)."""
    body = {**_head(rid, "chat.completion.chunk" if chat else "text_completion", model, created), "choices": choices}
    if with_usage:
        body["usage"] = usage_body
    return body
