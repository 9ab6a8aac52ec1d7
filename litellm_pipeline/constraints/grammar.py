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

from litellm_pipeline.constraints.utf8 import Utf8Guard
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
