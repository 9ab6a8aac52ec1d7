"""ConstraintSpec: what a request asks its output to match, as every front end describes it.

A request carries at most one constraint, written as a one-key mapping from a registered ``constraint`` kind to
its value (vLLM's ``structured_outputs`` shape)::

    {"json_schema": {...}}         a JSON Schema (a dict or its JSON text)
    {"json_object": True}          any JSON object
    {"regex": "[0-9]{3}-[0-9]{4}"}  a regular expression, matched in full
    {"choice": ["yes", "no"]}      exactly one of these strings
    {"grammar": 'root ::= "a"+'}   an EBNF / GBNF grammar whose start rule is ``root``

The value is canonicalised here (JSON text of a schema is parsed, so ``{"a":1}`` and ``{"a": 1}`` are one spec)
and checked against the size limits when it is compiled (:mod:`~litellm_pipeline.constraints.compiler`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping

from litellm_pipeline.errors import InvalidRequestError

__all__ = ["ConstraintSpec", "to_constraint"]


@dataclass(frozen=True)
class ConstraintSpec:
    """One constraint: the registry name of its kind and the kind's value (plain JSON data)."""

    kind: str
    value: Any

    @property
    def text(self) -> str:
        """The canonical JSON text of kind and value: what size limits count and the compile cache keys on."""
        return json.dumps([self.kind, self.value], sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    @property
    def key(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def _json_value(kind: str, value: Any) -> Any:
    if kind == "json_schema" and isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError("constraint.json_schema", f"is not valid JSON: {exc}") from None
    if isinstance(value, tuple):
        return list(value)
    return value


def to_constraint(value: Any) -> ConstraintSpec | None:
    """A front end's constraint as a :class:`ConstraintSpec` (None stays None).

    Takes a spec, or a mapping with exactly one key (the kind). Whether the kind is registered and its value
    valid is decided when it is compiled; here only the shape is checked."""
    if value is None or isinstance(value, ConstraintSpec):
        return value
    if not isinstance(value, Mapping):
        raise InvalidRequestError(
            "constraint", f"must be a mapping of one kind to its value, e.g. {{'regex': '[0-9]+'}} "
            f"(got {type(value).__name__})")
    if len(value) != 1:
        raise InvalidRequestError(
            "constraint", f"must name exactly one kind (got {len(value)}: {', '.join(map(str, value)) or 'none'})")
    (kind, val), = value.items()
    if not isinstance(kind, str):
        raise InvalidRequestError("constraint", f"the kind must be a string (got {kind!r})")
    val = _json_value(kind, val)
    try:
        json.dumps(val, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"constraint.{kind}", f"must be plain JSON data: {exc}") from None
    return ConstraintSpec(kind, val)
