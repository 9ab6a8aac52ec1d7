"""The built-in constraint kinds (registry kind ``constraint``): JSON schema, JSON object, regex, choice, grammar.

Each is built once per engine as ``cls(grammars)`` and compiles a request's value into a grammar through
:class:`~litellm_pipeline.constraints.grammar.Grammars`; a plugin kind may compile to a grammar the same way
(``grammars.ebnf(...)``) or return its own :class:`~litellm_pipeline.registry.interfaces.CompiledConstraint`.
"""

from __future__ import annotations

import json
from typing import Any

from litellm_pipeline.constraints.grammar import GrammarConstraint, Grammars
from litellm_pipeline.registry import register

# a JSON schema nested deeper than this is refused before it is compiled (compile time grows with the depth)
MAX_SCHEMA_DEPTH = 32
MAX_CHOICES = 4096


def _depth(value: Any) -> int:
    """Nesting depth of JSON data, without recursion (a hostile schema may be nested thousands deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return deepest


class _GrammarKind:
    def __init__(self, grammars: Grammars):
        self.grammars = grammars


@register("constraint", "json_schema")
class JsonSchema(_GrammarKind):
    """A JSON Schema (draft 2020-12 subset xgrammar supports: types, properties, required, items, enum, const,
    anyOf/oneOf, $ref/$defs, string length and pattern, number ranges). Properties the schema does not list are
    refused (OpenAI's ``strict: true``); give ``{"schema": ..., "strict": false}`` to follow
    ``additionalProperties`` instead."""

    def compile(self, value: Any) -> GrammarConstraint:
        strict = True
        if isinstance(value, dict) and set(value) <= {"schema", "strict"} and "schema" in value:
            strict = value.get("strict", True)
            if not isinstance(strict, bool):
                raise ValueError(f"'strict' must be true or false (got {strict!r})")
            value = value["schema"]
        if not isinstance(value, (dict, bool)):
            raise ValueError(f"a JSON schema must be an object or a boolean (got {type(value).__name__})")
        depth = _depth(value)
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the schema is nested {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are allowed")
        return self.grammars.json_schema(value, strict=strict)


@register("constraint", "json_object")
class JsonObject(_GrammarKind):
    """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``); the value must be true."""

    def compile(self, value: Any) -> GrammarConstraint:
        if value is not True:
            raise ValueError(f"the value of json_object must be true (got {value!r})")
        return self.grammars.json_schema({"type": "object"}, strict=False)


@register("constraint", "regex")
class Regex(_GrammarKind):
    """A regular expression the whole output must match (no anchors needed; lookaround and backreferences are
    not regular and are refused)."""

    def compile(self, value: Any) -> GrammarConstraint:
        if not isinstance(value, str) or not value:
            raise ValueError(f"a regex must be a non-empty string (got {value!r})")
        return self.grammars.regex(value)


@register("constraint", "choice")
class Choice(_GrammarKind):
    """Exactly one of a list of strings."""

    def compile(self, value: Any) -> GrammarConstraint:
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        if len(value) > MAX_CHOICES:
            raise ValueError(f"choice lists {len(value)} strings; at most {MAX_CHOICES} are allowed")
        # JSON string escapes are EBNF string escapes
        alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(value))
        return self.grammars.ebnf(f"root ::= {alts}")


@register("constraint", "grammar")
class Grammar(_GrammarKind):
    """An EBNF grammar (GBNF, as llama.cpp writes it) whose start rule is ``root``."""

    def compile(self, value: Any) -> GrammarConstraint:
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"a grammar must be a non-empty string of EBNF rules (got {value!r})")
        return self.grammars.ebnf(value)
