"""Errors as OpenAI-style JSON bodies: ``{"error": {"message", "type", "param", "code"}}``.

The runtime's taxonomy (:mod:`litellm_pipeline.errors`) already carries the HTTP status of each error; this
module only picks OpenAI's ``type`` for it and the ``param`` it names. Body validation errors become one 400
naming the field; anything unexpected becomes a 500 with an error id that is also in the log.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from litellm_pipeline.errors import (
    AuthenticationError,
    InternalError,
    OverloadedError,
    RateLimitedError,
    RequestError,
    format_error_list,
)

__all__ = ["error_body", "error_response", "install_error_handlers", "validation_message"]

log = logging.getLogger("litellm_pipeline.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 431: "invalid_request_error", 500: "server_error",
          503: "service_unavailable_error"}
# pydantic puts the member of a union a value was tried against into the location ("str", "list[int]")
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|dict\[.*\]|list\[.*\]|[A-Z]\w*)$")
_FIELD_PREFIX = re.compile(r"^([a-z_]+(?:\.[a-z_]+|\[\d+\])*): ")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               **extra: Any) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code, **extra}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code, **extra), status_code=status, headers=headers)


def request_error_body(exc: RequestError) -> tuple[int, dict[str, Any], dict[str, str] | None]:
    """(status, body, headers) of one of the runtime's request errors."""
    status, headers, extra = exc.status_code, None, {}
    code = None
    param = getattr(exc, "field", None)  # InvalidRequestError names its field (engine-side: "params.top_p")
    if param is not None:
        param = param.removeprefix("params.")
    retry_after = getattr(exc, "retry_after_s", None)  # RateLimitedError; OverloadedError of a full tenant queue
    if isinstance(exc, (RateLimitedError, OverloadedError)):
        code = exc.quota or None  # which quota: requests_per_minute, tokens_per_minute, ..., max_queued
        if retry_after is not None:
            headers = {"Retry-After": str(max(1, math.ceil(retry_after)))}
    if isinstance(exc, AuthenticationError):
        headers, code = {"WWW-Authenticate": "Bearer"}, "invalid_api_key"
    if isinstance(exc, InternalError):
        extra["error_id"] = exc.error_id
        code = "internal_error"
    return status, error_body(status, exc.message, param, code, **extra), headers


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """(message, param) of a request body's validation errors: one line per field, the first field named."""
    for e in errors:
        if tuple(e.get("loc", ())) != ("body",):
            continue
        if e.get("type") == "missing":
            return "the request body is empty: it must be a JSON object", None
        if e.get("type") == "model_attributes_type":  # valid JSON, but not an object
            got = e.get("input")
            kind = {type(None): "null", bool: "a boolean", list: "an array", str: "a string"}.get(
                type(got), "a number")
            return f"the request body must be a JSON object, got {kind}", None
    per_field: dict[Any, dict[str, Any]] = {}
    for e in errors:
        loc = tuple(p for p in e.get("loc", ()) if not (isinstance(p, str) and _UNION_TAG.match(p)))
        if loc and loc[0] == "body":
            loc = loc[1:]
        if e.get("type") == "json_invalid":
            detail = (e.get("ctx") or {}).get("error", "")
            return f"the body is not valid JSON: {detail} (at character {loc[0] if loc else '?'})".strip(), None
        e = {**e, "loc": loc}
        if not loc:  # a check of the whole body: its message names the fields, the body itself is noise
            e.pop("input", None)
        # one line per field: of a union's failed branches, the deepest says most ("stop[0]: ..." over "stop: ...")
        kept = per_field.get(loc[:1])
        if kept is None or len(loc) > len(kept["loc"]):
            per_field[loc[:1]] = e
    lines = format_error_list(list(per_field.values())).splitlines()
    lines = [ln.removeprefix("<root>: ") for ln in lines]
    match = _FIELD_PREFIX.match(lines[0]) if lines else None
    param = match.group(1) if match else None
    return "; ".join(lines), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return error_response(400, message, param)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        if isinstance(exc, InternalError):
            log.error("request failed: %s", exc, exc_info=exc.__cause__)
        status, body, headers = request_error_body(exc)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        err = InternalError(f"internal error while serving {request.url.path}: {type(exc).__name__}")
        log.error("%s", err, exc_info=exc)
        return error_response(500, err.message, code="internal_error", error_id=err.error_id)
