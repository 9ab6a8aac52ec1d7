"""Error types and readable validation messages shared by config loading and request parsing.

Validation happens at the edge (config build, request admission). A bad value must produce one
line per problem that names the key path and the allowed range, e.g.
``temperature: must be >= 0 and <= 100 (got -1)``, instead of pydantic's multi-line report.

Request errors form a small taxonomy that a server maps to HTTP status codes one to one
(:attr:`RequestError.status_code`): :class:`InvalidRequestError` (400; names the offending field),
:class:`AuthenticationError` (401), :class:`NotFoundError` (404), :class:`RateLimitedError` (429, with
``retry_after_s`` and the ``quota``), :class:`OverloadedError` (503) and :class:`InternalError` (500, with an
``error_id`` to find it in the log).
Every path that rejects a request raises one of them.
"""

from __future__ import annotations

import uuid
from typing import Any, TypeVar

import pydantic

M = TypeVar("M", bound=pydantic.BaseModel)

__all__ = [
    "ConfigError",
    "InvalidValueError",
    "ReadableModel",
    "RequestError",
    "InvalidRequestError",
    "NotFoundError",
    "AuthenticationError",
    "RateLimitedError",
    "OverloadedError",
    "InternalError",
    "format_validation_error",
    "format_error_list",
    "range_message",
]

# pydantic prefixes messages of errors raised inside validators with these; the text after is ours
_VALIDATOR_PREFIXES = ("Value error, ", "Assertion failed, ")

# built-in constraint error types -> phrasing built from the error's ctx
_CONSTRAINT_TEXT = {
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}",
    "multiple_of": "must be a multiple of {multiple_of}",
    "too_short": "must have at least {min_length} item(s)",
    "too_long": "must have at most {max_length} item(s)",
    "string_too_short": "must have at least {min_length} character(s)",
    "string_too_long": "must have at most {max_length} character(s)",
    "literal_error": "must be one of {expected}",
    "enum": "must be one of {expected}",
}
_MAX_INPUT_REPR = 80


class ConfigError(ValueError):
    """A configuration could not be loaded or built; ``str()`` is the readable explanation."""


class ReadableModel(pydantic.BaseModel):
    """A pydantic model whose validation errors are one readable :class:`InvalidValueError`
    (``field: must be >= 0 (got -1)``, one line per problem) instead of pydantic's multi-line report."""

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except pydantic.ValidationError as err:
            raise InvalidValueError(err) from None

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any):
        """Validate a mapping (e.g. a request body); errors are raised like ``__init__``'s."""
        try:
            return super().model_validate(obj, *args, **kwargs)
        except pydantic.ValidationError as err:
            # pydantic routes this through __init__, so the error usually wraps our InvalidValueError;
            # InvalidValueError's text unwraps it again
            raise InvalidValueError(err) from None


class InvalidValueError(ValueError):
    """Raised by models that format their own validation errors (e.g. ``SamplingParams``).

    ``str()`` is :func:`format_validation_error`'s text; the pydantic error is kept so that, when such a
    model is nested in another one, the outer report can list the inner lines under the outer path.
    """

    def __init__(self, err: pydantic.ValidationError) -> None:
        super().__init__(format_validation_error(err))
        self.validation_error = err


class RequestError(Exception):
    """A request could not be served; ``status_code`` is the HTTP status a server answers with."""

    status_code: int = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequestError(RequestError, ValueError):
    """The request itself is wrong (a bad field, a prompt the model cannot take): nothing of it was kept.

    ``field`` names the request field at fault (``"prompt"``, ``"params.max_tokens"``, ``"tier"``...); the
    message starts with it.
    """

    status_code = 400

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class NotFoundError(RequestError, LookupError):
    """The thing the request names (a model, a request id, a session) does not exist."""

    status_code = 404


class RateLimitedError(RequestError):
    """A quota would be exceeded; retry after ``retry_after_s`` seconds. ``quota`` names which one."""

    status_code = 429

    def __init__(self, message: str, retry_after_s: float, quota: str = "") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.quota = quota


class AuthenticationError(RequestError):
    """The request carries no API key, or one that names no tenant (the server's ``conf/tenants`` keys)."""

    status_code = 401


class OverloadedError(RequestError):
    """The server cannot take the request now (queue full, draining); the request itself is fine.
    ``retry_after_s`` (None: unknown) and ``quota`` (e.g. ``"max_queued"``) are set when a tenant's queue is full."""

    status_code = 503

    def __init__(self, message: str, retry_after_s: float | None = None, quota: str = "") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.quota = quota


class InternalError(RequestError, RuntimeError):
    """Something failed inside the runtime while serving the request; ``error_id`` identifies it in logs."""

    status_code = 500

    def __init__(self, message: str, error_id: str | None = None) -> None:
        self.error_id = error_id or uuid.uuid4().hex[:12]
        suffix = f" (error id {self.error_id})"
        super().__init__(message if message.endswith(suffix) else message + suffix)


def range_message(lo: Any = None, hi: Any = None, *, lo_open: bool = False, hi_open: bool = False) -> str:
    """The phrase used for a range violation: ``range_message(0, 100)`` -> ``"must be >= 0 and <= 100"``."""
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {lo}")
    if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} {hi}")
    return "must be " + " and ".join(parts)


def _path(loc: tuple[Any, ...], prefix: str) -> str:
    out = prefix
    for part in loc:
        if isinstance(part, int):  # list index
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "<root>"


def _message(e: dict[str, Any]) -> str:
    kind = e.get("type", "")
    ctx = e.get("ctx") or {}
    if kind in _CONSTRAINT_TEXT:
        # a float field's bound reads as written in the schema: "must be > 0", not "> 0.0"
        ctx = {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in ctx.items()}
        try:
            return _CONSTRAINT_TEXT[kind].format(**ctx)
        except (KeyError, IndexError):
            pass
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required key is missing"
    msg = str(e.get("msg", ""))
    for p in _VALIDATOR_PREFIXES:
        if msg.startswith(p):
            return msg[len(p):]
    return msg[:1].lower() + msg[1:]


def _got(e: dict[str, Any]) -> str:
    if e.get("type") == "missing" or "input" not in e:
        return ""
    text = repr(e["input"])
    if len(text) > _MAX_INPUT_REPR:
        text = text[: _MAX_INPUT_REPR - 3] + "..."
    return f" (got {text})"


def format_validation_error(err: pydantic.ValidationError, prefix: str = "") -> str:
    """One line per error: ``path.to.key: message (got X)``; ``prefix`` is prepended to every path.

    List indices are written ``key[i]``. Errors raised by our own validators keep their text (pydantic's
    ``"Value error, "`` prefix is dropped); built-in constraint errors are rephrased as ``must be >= 0``.
    """
    return format_error_list(err.errors(), prefix)


def section_settings(model: type[M], section: Any, key: str) -> M:
    """A recipe's config section (``bench``, ``sweep``, ...; None: all defaults) validated as ``model``; a bad
    value is one ConfigError with a line per problem naming ``key.<field>``."""
    try:
        return model.model_validate(section or {})
    except pydantic.ValidationError as exc:
        raise ConfigError(f"invalid {key} config:\n" + format_validation_error(exc, key)) from exc


def format_error_list(errors: list[dict[str, Any]], prefix: str = "") -> str:
    """:func:`format_validation_error` over pydantic's error dicts (e.g. FastAPI's ``RequestValidationError``
    has the list but no ``ValidationError``)."""
    lines = []
    for e in errors:
        path = _path(tuple(e.get("loc", ())), prefix)
        inner = (e.get("ctx") or {}).get("error")
        if isinstance(inner, InvalidValueError):  # a nested self-formatting model: list its own lines
            lines.append(format_validation_error(inner.validation_error, "" if path == "<root>" else path))
        else:
            lines.append(f"{path}: {_message(e)}{_got(e)}")
    return "\n".join(lines)
