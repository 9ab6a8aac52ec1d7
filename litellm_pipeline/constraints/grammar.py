"""The grammar engine behind the built-in constraints: xgrammar, over the checkpoint's own vocabulary.

:class:`Grammars` turns JSON schemas, regexes and EBNF grammars into compiled grammars for one tokenizer; a
:class:`GrammarMatcher` follows one request's output through a compiled grammar and writes its token bitmask.
The vocabulary comes from ``tokenizer.json``: xgrammar reads the decoder there to tell byte-level BPE (GPT-2,
Llama 3, Qwen) from SentencePiece-style byte fallback (Llama 2, Mistral) and from plain tokens.

xgrammar is imported when the first constraint is compiled, not with the package: a server that never sees one
does not pay for it.
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

import torch

from litellm_pipeline.text.tokenizer import Tokenizer

__all__ = ["Grammars", "GrammarConstraint", "GrammarMatcher", "bitmask_words"]

# "[05:16:22] /project/cpp/json_schema_converter.cc:5082: " before xgrammar's own message
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def bitmask_words(vocab_size: int) -> int:
    """32-bit words per row of a token bitmask over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def engine_message(exc: BaseException) -> str:
    """xgrammar's error text without its C++ source location."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _CPP_PREFIX.sub("", text)


def _length_as_pattern(schema: Any) -> Any:
    """``schema`` with every string's ``minLength``/``maxLength`` (and no ``pattern`` or ``format``) written as
    the equivalent ``pattern``: xgrammar's rule for string lengths lets raw control characters into the string
    (invalid JSON), its rule for patterns does not."""
    if not isinstance(schema, (dict, list)):
        return schema
    root = json.loads(json.dumps(schema))  # a copy the loop below may edit
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(x for x in node if isinstance(x, (dict, list)))
            continue
        if (node.get("type") == "string" and ("minLength" in node or "maxLength" in node)
                and "pattern" not in node and "format" not in node
                and all(type(node.get(k, 0)) is int and node.get(k, 0) >= 0 for k in ("minLength", "maxLength"))):
            lo, hi = node.pop("minLength", 0), node.pop("maxLength", "")
            node["pattern"] = f"^[\\s\\S]{{{lo},{hi}}}$"
        stack.extend(x for x in node.values() if isinstance(x, (dict, list)))
    return root


# The UTF-8 decoder's states between tokens: 0 = at a character boundary; the others wait for continuation bytes
# (1, 2 or 3 of 80..BF; or after E0, ED, F0, F4 a first continuation byte of a narrower range).
_UTF8_LEAD = {**{b: 0 for b in range(0x80)}, **{b: 1 for b in range(0xC2, 0xE0)}, 0xE0: 4,
              **{b: 2 for b in range(0xE1, 0xF0) if b != 0xED}, 0xED: 5, 0xF0: 6,
              **{b: 3 for b in range(0xF1, 0xF4)}, 0xF4: 7}
_UTF8_CONT = {1: (0x80, 0xBF, 0), 2: (0x80, 0xBF, 1), 3: (0x80, 0xBF, 2), 4: (0xA0, 0xBF, 1), 5: (0x80, 0x9F, 1),
              6: (0x90, 0xBF, 2), 7: (0x80, 0x8F, 2)}
_UTF8_STATES = 8


def _utf8_step(state: int, data: bytes) -> int:
    """The decoder's state after ``data`` from ``state``; -1 if ``data`` is not valid UTF-8 there."""
    for b in data:
        if state == 0:
            state = _UTF8_LEAD.get(b, -1)
        else:
            lo, hi, nxt = _UTF8_CONT[state]
            state = nxt if lo <= b <= hi else -1
        if state < 0:
            return -1
    return state


class Utf8Guard:
    """Which tokens keep a byte-level output valid UTF-8, per decoder state.

    xgrammar checks the characters of a grammar, but its byte automaton lets some invalid sequences through
    (a surrogate's bytes, or F0 followed by 80): a byte-level model could write them, and the text would then
    hold U+FFFD replacements, breaking a string's length limit. The guard narrows each mask to the tokens that
    continue valid UTF-8; it is built once per vocabulary (only tokens with bytes past ASCII need the walk)."""

    def __init__(self, decoded: Sequence[bytes], stop_ids: Sequence[int], vocab_size: int):
        import numpy as np

        words = bitmask_words(vocab_size)
        nxt = np.full((_UTF8_STATES, vocab_size), -1, dtype=np.int8)
        stops = set(stop_ids)
        for t, data in enumerate(decoded[:vocab_size]):
            if t in stops:
                nxt[0, t] = 0  # the output may end only at a character boundary
            elif not data:
                nxt[:, t] = np.arange(_UTF8_STATES)  # writes nothing (the grammar decides about it)
            elif max(data) < 0x80:
                nxt[0, t] = 0
            else:
                for state in range(_UTF8_STATES):
                    nxt[state, t] = _utf8_step(state, data)
        allowed = np.zeros((_UTF8_STATES, words * 32), dtype=bool)
        allowed[:, :vocab_size] = nxt >= 0
        bits = (allowed.reshape(_UTF8_STATES, words, 32).astype(np.int64) << np.arange(32)).sum(-1)
        self.masks = torch.from_numpy(bits.astype(np.uint32).view(np.int32))  # [states, words], xgrammar's layout
        self.next = nxt.tolist()

    def step(self, state: int, token: int) -> int:
        return self.next[state][token]


class GrammarMatcher:
    """One request's position in a compiled grammar (the :class:`~litellm_pipeline.registry.interfaces.Matcher`
    of the built-in kinds), with the UTF-8 guard of a byte vocabulary."""

    __slots__ = ("_m", "_guard", "_states")

    def __init__(self, matcher: Any, guard: Utf8Guard | None = None):
        self._m = matcher
        self._guard = guard
        self._states = [0]  # the UTF-8 decoder's state after each accepted token (rollback pops them)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)
        if self._guard is not None:
            bitmask[row] &= self._guard.masks[self._states[-1]]

    def accept(self, token: int) -> bool:
        if self._guard is not None:
            state = self._guard.step(self._states[-1], token)
            if state < 0 or not self._m.accept_token(token):
                return False
            self._states.append(state)
            return True
        return self._m.accept_token(token)

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)
        if self._guard is not None and num_tokens:
            del self._states[-num_tokens:]

    def is_terminated(self) -> bool:
        return self._m.is_terminated()


class GrammarConstraint:
    """A compiled grammar: makes a fresh matcher for every request that uses it."""

    __slots__ = ("compiled", "guard")

    def __init__(self, compiled: Any, guard: Utf8Guard | None = None):
        self.compiled = compiled
        self.guard = guard

    def matcher(self) -> GrammarMatcher:
        import xgrammar as xgr

        return GrammarMatcher(xgr.GrammarMatcher(self.compiled), self.guard)


def _encoded_vocab(tokenizer: Tokenizer, vocab_size: int) -> list[str]:
    vocab = tokenizer._tok.get_vocab(with_added_tokens=True)
    out = [""] * vocab_size  # ids the tokenizer does not name (padding rows of the model) stay unwritable
    for token, idx in vocab.items():
        if idx < vocab_size:
            out[idx] = token
    return out


class Grammars:
    """Compiles grammars for one tokenizer and model vocabulary (``vocab_size`` = the logits' width).

    ``stop_token_ids`` end a grammar: a matcher allows them only where the grammar may end. ``any_whitespace``:
    JSON may hold whitespace between its tokens; off, JSON is written compactly (``{"a":1}``), which keeps a
    model from looping on whitespace (vLLM's ``disable-any-whitespace``)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int],
                 any_whitespace: bool = False):
        import xgrammar as xgr

        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer._tok.to_str())
        self.info = xgr.TokenizerInfo(
            _encoded_vocab(tokenizer, vocab_size), meta["vocab_type"], vocab_size=vocab_size,
            stop_token_ids=sorted(stop_token_ids), add_prefix_space=meta["add_prefix_space"],
        )
        self.vocab_size = vocab_size
        self.any_whitespace = any_whitespace
        # plain-token vocabularies write whole characters; byte vocabularies need the guard
        self.guard = (Utf8Guard(self.info.decoded_vocab, sorted(stop_token_ids), vocab_size)
                      if meta["vocab_type"] != xgr.VocabType.RAW else None)
        # the engine keeps its own cache (keyed by the request's spec); one compile uses one thread
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    @property
    def vocab_type(self) -> str:
        return self.info.vocab_type.name.lower()

    def _compile(self, what: str, fn, *args, **kwargs) -> GrammarConstraint:
        try:
            return GrammarConstraint(fn(*args, **kwargs), self.guard)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"invalid {what}: {engine_message(exc)}") from None

    def json_schema(self, schema: dict | bool, strict: bool = True) -> GrammarConstraint:
        """Output that validates against ``schema``. ``strict``: objects hold no properties the schema does not
        list (OpenAI's ``strict: true``); otherwise ``additionalProperties`` is as the schema says."""
        return self._compile("JSON schema", self._compiler.compile_json_schema, json.dumps(_length_as_pattern(schema)),
                             any_whitespace=self.any_whitespace, strict_mode=strict,
                             separators=None if self.any_whitespace else (",", ":"))

    def regex(self, pattern: str) -> GrammarConstraint:
        return self._compile("regex", self._compiler.compile_regex, pattern)

    def ebnf(self, grammar: str, root: str = "root") -> GrammarConstraint:
        return self._compile("grammar", self._compiler.compile_grammar, grammar, root_rule_name=root)
