"""The gate every API request passes first (a plain ASGI middleware, outermost).

* Not serving (starting, draining): ``/v1/...`` gets 503 at once.
* Request headers past ``server.max_header_bytes`` get 431 (uvicorn itself refuses, in plain text, only headers
  past four times that, where its parser stops).
* The body is read here, bounded by ``server.max_body_bytes`` (413 past it, whatever Content-Length claims),
  then replayed to the app; later ``receive`` calls go to the server, so a disconnect is still seen.
* Requests in flight are counted: a drain waits for that count to reach zero.
* Every ``/v1`` request refused with a 4xx or 503 is reported once (``on_refused(tenant, reason)``; the server
  publishes it as a ``rejected`` event): whether the gate, FastAPI's body validation, a route or the engine refused
  it. The engine reports its own refusals; a route that hands a request to the engine marks it
  (:func:`mark_reported`), so none is counted twice.
"""

from __future__ import annotations

import asyncio
import json
from contextvars import ContextVar
from typing import Any, Awaitable, Callable

from starlette.responses import JSONResponse

from litellm_pipeline.server.errors import error_body

__all__ = ["Gate", "GateState", "mark_reported", "set_tenant"]

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

# past the limit the rest of a body is still read (and dropped) up to this many times the limit, so the client
# is reading our 413 rather than failing to write; a body declared larger than that is answered at once
_DRAIN_FACTOR = 8
# the runtime's error class for an HTTP status, the reason a refusal without a code is counted under
_REASONS = {400: "InvalidRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "InvalidRequestError",
            413: "InvalidRequestError", 429: "RateLimitedError", 431: "InvalidRequestError", 503: "OverloadedError"}

# per /v1 request: {"reported": bool, "tenant": str}; a dict set by the gate, so the routes' writes reach it from
# any task the request runs in
_REQUEST: ContextVar[dict[str, Any] | None] = ContextVar("litellm_pipeline_request", default=None)


def mark_reported() -> None:
    """The request's refusal (if it is refused) is reported already: the engine refused it and published that."""
    state = _REQUEST.get()
    if state is not None:
        state["reported"] = True


def set_tenant(tenant: str) -> None:
    """Who sent the request, once it is known (its refusal is counted under that tenant)."""
    state = _REQUEST.get()
    if state is not None:
        state["tenant"] = tenant


class GateState:
    """What the gate and the health check share: the serving status and the requests in flight."""

    def __init__(self) -> None:
        self.status = "starting"  # -> "serving" -> "draining"
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True once no request is in flight; False if ``timeout`` seconds passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


class Gate:
    def __init__(self, app: Callable, state: GateState, max_body_bytes: int, max_header_bytes: int = 16_384,
                 on_refused: Callable[[str, str], None] | None = None):
        self.app = app
        self.state = state
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"].startswith("/v1/") and self.on_refused is not None:
            send = self._watch(send)
        size = sum(len(k) + len(v) + 4 for k, v in scope.get("headers") or ())  # "name: value\r\n"
        if size > self.max_header_bytes:
            await _answer(scope, receive, send, 431,
                          f"the request headers are {size} bytes; this server takes at most {self.max_header_bytes} "
                          "(server.max_header_bytes)", code="headers_too_large", headers={"Connection": "close"})
            return
        if not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if self.state.status != "serving":
            why = "is still starting" if self.state.status == "starting" else "is shutting down"
            await _answer(scope, receive, send, 503, f"the server {why}: retry later", code="not_serving",
                          headers={"Retry-After": "1", "Connection": "close"})
            return
        body = await self._read_body(scope, receive, send)
        if body is None:
            return
        scope = _as_json(scope)
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        self.state.enter()
        try:
            await self.app(scope, replay, send)
        finally:
            self.state.leave()

    def _watch(self, send: Send) -> Send:
        """``send``, reporting the response if it refuses the request and nothing reported it yet."""
        request = {"reported": False, "tenant": ""}
        _REQUEST.set(request)
        status = 0

        async def watched(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not request["reported"] and (
                    400 <= status < 500 and status != 499 or status == 503):
                request["reported"] = True
                self.on_refused(request["tenant"], _reason(status, message.get("body", b"")))
            await send(message)

        return watched

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None after answering 413 (too large) or 400 (a bad Content-Length)."""
        limit = self.max_body_bytes
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await _answer(scope, receive, send, 400, f"Content-Length is not a number ({declared[:40]!r})")
                return None
            if size > limit * _DRAIN_FACTOR:
                await self._too_large(scope, receive, send, size)
                return None
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            part = message.get("body", b"")
            total += len(part)
            if total <= limit:
                chunks.append(part)
            if not message.get("more_body", False) or total > limit * _DRAIN_FACTOR:
                break
        if total > limit:
            await self._too_large(scope, receive, send, total)
            return None
        return b"".join(chunks)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, size: int) -> None:
        await _answer(scope, receive, send, 413,
                      f"the request body is {size} bytes; this server takes at most {self.max_body_bytes} "
                      "(server.max_body_bytes)", code="request_too_large", headers={"Connection": "close"})


def _as_json(scope: Scope) -> Scope:
    """Every API body is JSON: one sent without a type or with another (curl's default form type, a browser
    fetch's text/plain) is read as JSON (a client that forgot the header gets its request served, or a 400
    saying why the JSON is invalid)."""
    headers = [(k, v) for k, v in scope.get("headers") or () if k != b"content-type"]
    kind = dict(scope.get("headers") or ()).get(b"content-type", b"").split(b";")[0].strip().lower()
    if kind == b"application/json" or kind.endswith(b"+json"):
        return scope
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


async def _answer(scope: Scope, receive: Receive, send: Send, status: int, message: str, code: str | None = None,
                  headers: dict[str, str] | None = None) -> None:
    await JSONResponse(error_body(status, message, code=code), status_code=status, headers=headers)(
        scope, receive, send)


def _reason(status: int, body: bytes) -> str:
    """What a refusal is counted under: its error body's code (``request_too_large``, ``invalid_api_key``, a quota
    ...) if it has one, else the runtime's error class for its status."""
    try:
        code = json.loads(body)["error"].get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        code = None
    return code or _REASONS.get(status, f"http_{status}")
