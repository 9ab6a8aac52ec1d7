"""RequestSpec: the one description of a request that every front end builds and the engine takes.

``LLM.generate/stream``, ``AsyncEngine.generate``, ``Engine.add_request`` (and the HTTP server) accept a
``RequestSpec``, or a prompt plus keyword fields that are forwarded to it unchanged (:func:`to_spec`), so
the field list lives here only. A spec is checked when it is made: a wrong field raises
:class:`~litellm_pipeline.errors.InvalidRequestError` naming it, before anything reaches the engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, Union

from litellm_pipeline.budget.spec import BudgetSpec
from litellm_pipeline.constraints.spec import ConstraintSpec, to_constraint
from litellm_pipeline.errors import InvalidRequestError, InvalidValueError
from litellm_pipeline.sampling import SamplingParams

__all__ = ["RequestSpec", "Prompt", "to_spec"]

Prompt = Union[str, Sequence[int]]


def _check_prompt(prompt: Any) -> str | tuple[int, ...]:
    if isinstance(prompt, str):
        if not prompt:  # tokenized, it would be a BOS alone: nothing the caller wrote
            raise InvalidRequestError("prompt", "is empty: it must hold at least one token")
        return prompt
    if isinstance(prompt, (bytes, Mapping)) or not isinstance(prompt, Sequence):
        raise InvalidRequestError(
            "prompt", f"must be a string or a list of token ids (got {type(prompt).__name__})"
        )
    bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int)]
    if bad:
        raise InvalidRequestError("prompt", f"token ids must be integers (got {bad[0]!r})")
    return tuple(prompt)


def _check_model(name: str, cls: type, value: Any) -> Any:
    if value is None:
        return value
    if isinstance(value, cls):
        # validated again: pydantic's model_construct (or a copy) can make an instance that never was
        value = value.model_dump()
    if isinstance(value, Mapping):
        try:
            return cls.model_validate(dict(value))
        except InvalidValueError as exc:
            lines = str(exc).splitlines()
            raise InvalidRequestError(name, "; ".join(lines)) from None
    raise InvalidRequestError(name, f"must be a {cls.__name__} or a mapping of its fields (got {type(value).__name__})")


def _check_optional_str(name: str, value: Any, allow_empty: bool = False) -> None:
    if value is None:
        return
    if not isinstance(value, str) or (not allow_empty and value == ""):
        raise InvalidRequestError(name, f"must be a non-empty string or None (got {value!r})")


@dataclass(frozen=True)
class RequestSpec:
    """One request, as any front end describes it.

    * ``prompt`` — text (tokenized by the engine) or token ids (kept as a tuple).
    * ``params`` — :class:`SamplingParams` (or a mapping of its fields).
    * ``tier`` — a configured tier name; None lets the select_tier stage choose.
    * ``budget`` — a :class:`BudgetSpec` (or a mapping of its fields); None: no limit.
    * ``tenant`` — who sends it; tenants never share cached KV ("" = the default tenant).
    * ``priority`` — lower is served first by the ``priority`` scheduler.
    * ``session_id`` — keep this conversation's KV pinned after the request ends.
    * ``request_id`` — the caller's id; None lets the engine name it.
    * ``constraint`` — structured output: a :class:`ConstraintSpec` or a one-key mapping such as
      ``{"json_schema": {...}}``, ``{"regex": "..."}``, ``{"choice": [...]}``, ``{"grammar": "..."}`` or
      ``{"json_object": True}`` (:mod:`litellm_pipeline.constraints`); None: free text.
    * ``num_speculative_tokens`` — speculative decoding for this request: 0 turns it off, a number below the
      engine's ``speculative.k`` lowers it (a larger one is capped at it); None: the engine's setting.
    """

    prompt: Prompt
    params: SamplingParams = field(default_factory=SamplingParams)
    tier: str | None = None
    budget: BudgetSpec | None = None
    tenant: str = ""
    priority: int = 0
    session_id: str | None = None
    request_id: str | None = None
    constraint: ConstraintSpec | Mapping | None = None
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise once, here
        set_(self, "prompt", _check_prompt(self.prompt))
        params = _check_model("params", SamplingParams, self.params)
        set_(self, "params", params if params is not None else SamplingParams())
        set_(self, "budget", _check_model("budget", BudgetSpec, self.budget))
        set_(self, "constraint", to_constraint(self.constraint))
        _check_optional_str("tier", self.tier)
        _check_optional_str("session_id", self.session_id)
        _check_optional_str("request_id", self.request_id)
        if not isinstance(self.tenant, str):
            raise InvalidRequestError("tenant", f"must be a string (got {self.tenant!r})")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise InvalidRequestError("priority", f"must be an integer (got {self.priority!r})")
        k = self.num_speculative_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise InvalidRequestError("num_speculative_tokens",
                                      f"must be an integer >= 0 (0 turns speculation off) or None (got {k!r})")

    def replace(self, **changes: Any) -> RequestSpec:
        return dataclasses.replace(self, **changes)


FIELDS = tuple(f.name for f in dataclasses.fields(RequestSpec))


def to_spec(prompt: Prompt | RequestSpec, params: SamplingParams | Mapping | None = None, **fields: Any) -> RequestSpec:
    """A front end's arguments as a RequestSpec: a spec as it is (keywords replace its fields), or a prompt
    with ``params`` and keyword fields. An unknown keyword is an error naming the known ones."""
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise TypeError(f"unknown request field(s) {unknown}; RequestSpec fields: {', '.join(FIELDS)}")
    if isinstance(prompt, RequestSpec):
        if params is not None:
            fields["params"] = params
        return prompt.replace(**fields) if fields else prompt
    if params is not None:
        fields["params"] = params
    return RequestSpec(prompt, **fields)
