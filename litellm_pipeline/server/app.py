"""The FastAPI app: OpenAI-compatible routes over one :class:`AsyncEngine`, so concurrent HTTP requests batch.

``build_app(engine_or_async_engine, settings)`` is all a caller needs (:mod:`.serve` runs it under uvicorn; tests
and embedders may mount it anywhere). Routes only turn bodies into RequestSpecs (:mod:`.specs`) and engine
outputs into OpenAI bodies (:mod:`.responses`); errors become OpenAI error bodies (:mod:`.errors`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any, AsyncIterator, Callable, Mapping

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi_offline import FastAPIOffline

from litellm_pipeline.config.schema import ServerSection
from litellm_pipeline.engine.async_engine import AsyncEngine
from litellm_pipeline.engine.engine import Engine
from litellm_pipeline.engine.tenants import reserved_tokens
from litellm_pipeline.errors import (
    InternalError,
    InvalidRequestError,
    NotFoundError,
    RequestError,
)
from litellm_pipeline.server.errors import install_error_handlers, request_error_body
from litellm_pipeline.server.fanin import FanIn
from litellm_pipeline.server.gate import Gate, GateState, mark_reported, set_tenant
from litellm_pipeline.server.protocol import ChatCompletionRequest, CompletionRequest
from litellm_pipeline.server.responses import (
    ChoiceState,
    TokenText,
    chat_body,
    chunk,
    completion_body,
    usage,
)
from litellm_pipeline.server.specs import Choice, Limits, chat_specs, completion_specs
from litellm_pipeline.server.tools import ToolCallReader
from litellm_pipeline.telemetry import RequestRejected
from litellm_pipeline.telemetry.prometheus import CONTENT_TYPE_LATEST, PrometheusSink

__all__ = ["build_app", "metrics_sink"]

log = logging.getLogger("litellm_pipeline.server")


def metrics_sink(engine: Engine) -> PrometheusSink:
    """The engine's Prometheus sink, subscribed to its bus if the config did not name one."""
    sink = engine.bus.sink(PrometheusSink)
    if sink is None:
        sink = PrometheusSink()
        engine.bus.subscribe(sink)
    return sink


def build_app(
    engine: Engine | AsyncEngine,
    settings: ServerSection | Mapping[str, Any] | None = None,
    *,
    model_name: str | None = None,
    tenant_of: Callable[[Request], str] | None = None,
) -> FastAPI:
    """An app serving ``engine`` (an :class:`Engine` is wrapped in an AsyncEngine the app starts and stops;
    an AsyncEngine already running is left running at shutdown).

    ``model_name``: the model id clients use (default ``settings.served_model_name``, else ``"default"``).
    ``tenant_of``: who sent a request (becomes ``RequestSpec.tenant``); default: everyone is tenant ``""``. It runs
    first on every ``/v1`` route and may raise a RequestError, e.g. :class:`~.auth.ApiKeys`' 401 for a missing or
    unknown key.
    """
    aeng = engine if isinstance(engine, AsyncEngine) else AsyncEngine(engine)
    cfg = settings if isinstance(settings, ServerSection) else ServerSection.model_validate(dict(settings or {}))
    name = model_name or cfg.served_model_name or "default"
    eng = aeng.engine
    tok, rt = eng.tokenizer, eng.rt
    limits = Limits(rt.max_model_len, cfg.max_n, cfg.max_prompts)
    sink = metrics_sink(eng)
    token_text = TokenText(tok)
    gate = GateState()
    tenant_of = tenant_of or (lambda request: "")

    async def tenant(request: Request) -> str:
        # a dependency of every /v1 route: FastAPI runs it before it checks the body, so a request without a
        # valid key gets its 401 before any 400 (only a body that is not JSON at all is refused first)
        who = tenant_of(request)
        set_tenant(who)
        return who
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owns = not aeng.running
        aeng.start()
        gate.status = "serving"
        try:
            yield
        finally:
            gate.status = "draining"
            if owns:
                await asyncio.to_thread(aeng.shutdown)

    # /docs (Swagger UI) and /redoc load their scripts from this server (fastapi-offline ships them), not a CDN
    app = FastAPIOffline(title="litellm_pipeline", version="0.1.0", lifespan=lifespan,
                         description="OpenAI-compatible API of the litellm_pipeline runtime")
    app.state.gate, app.state.async_engine, app.state.metrics, app.state.model_name = gate, aeng, sink, name
    install_error_handlers(app)

    def refused(tenant: str, reason: str) -> None:  # a /v1 request the engine never saw was refused
        if rt.bus.enabled:
            rt.bus.publish(RequestRejected(None, tenant, reason, "refused before it reached the engine"))

    app.add_middleware(Gate, state=gate, max_body_bytes=cfg.max_body_bytes, max_header_bytes=cfg.max_header_bytes,
                       on_refused=refused)

    def model_card() -> dict[str, Any]:
        tiers = [{"name": t.name, "experts_per_layer": list(t.experts_per_layer), "cost": t.cost,
                  "price": {"prompt_1k": t.price.prompt_1k, "output_1k": t.price.output_1k}}
                 for t in rt.tiers.values()]
        return {"id": name, "object": "model", "created": created, "owned_by": cfg.owned_by,
                "max_model_len": rt.max_model_len, "tiers": tiers}

    def check_model(asked: str | None) -> None:
        if asked is not None and asked != name:
            err = NotFoundError(f"model {asked!r} does not exist; this server serves {name!r}")
            err.field = "model"  # the error body's param
            raise err

    page = resources.files(__package__).joinpath("static/chat.html").read_text(encoding="utf-8")

    @app.get("/", include_in_schema=False)
    async def chat_page() -> HTMLResponse:
        """The chat page: talks to this server's /v1 API, loads nothing from elsewhere."""
        return HTMLResponse(page)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while serving; 503 while starting or draining, or once the engine cannot run its model any more (a
        parallel engine that lost a rank: the reason names it)."""
        failure = eng.failure
        if failure is not None:
            return JSONResponse({"status": "failed", "error": failure, "requests_in_flight": gate.in_flight},
                                status_code=503)
        return JSONResponse({"status": "ok" if gate.status == "serving" else gate.status,
                             "requests_in_flight": gate.in_flight},
                            status_code=200 if gate.status == "serving" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text exposition format."""
        return Response(sink.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(tenant)])
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(tenant)])
    async def get_model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, who: str = Depends(tenant)):
        check_model(body.model)
        choices = completion_specs(body, tok, limits, who)
        return await serve(request, body, choices, chat=False, top_k=body.logprobs)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request, who: str = Depends(tenant)):
        check_model(body.model)
        choices = chat_specs(body, tok, limits, who)
        return await serve(request, body, choices, chat=True, top_k=(body.top_logprobs or 0) if body.logprobs else None)

    async def serve(request: Request, body, choices: list[Choice], chat: bool, top_k: int | None):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        states = [ChoiceState(c.index, c.prompt_index, chat, top_k,
                              reader=ToolCallReader(c.tools) if c.tools is not None else None) for c in choices]
        rt = aeng.engine.rt
        if rt.tenants is not None:  # choices are admitted one by one: refuse a set no quota can ever take whole
            rt.tenants.check_group(choices[0].spec.tenant, [
                reserved_tokens(len(c.spec.prompt), c.spec.params.max_tokens, rt.max_model_len) for c in choices
            ], prompts=choices[-1].prompt_index + 1)  # (a refusal here is counted by the gate)
        try:
            fan = await FanIn.open(aeng, choices)  # a refusal raises here: a plain 4xx, nothing left running
        except RequestError as exc:
            mark_reported()  # the engine published its refusal
            if chat and isinstance(exc, InvalidRequestError) and exc.field == "prompt":  # chat calls it messages
                raise InvalidRequestError("messages", "rendered prompt " + exc.message.removeprefix("prompt: ")
                                          ) from None
            raise
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(events(fan, states, rid, chat, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        if not await collect(fan, states, request):
            return Response(status_code=499)  # the client left; nobody reads this
        make = chat_body if chat else completion_body
        return JSONResponse(make(rid, name, states))

    async def collect(fan: FanIn, states: list[ChoiceState], request: Request) -> bool:
        """Run every choice to the end; False (all aborted) if the client disconnected first."""
        async def consume() -> None:
            async for index, out in fan:
                states[index].add(out, token_text)

        work = asyncio.ensure_future(consume())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                fan.cancel()
                await asyncio.wait({work})  # cancel() only asks: the task is cancelled once it has run again
        if work.cancelled():
            return False
        work.result()  # a failed choice raises its error (and FanIn aborted the others)
        return True

    async def events(fan: FanIn, states: list[ChoiceState], rid: str, chat: bool,
                     include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events; a client that disconnects cancels this generator, which aborts every choice."""
        stamp = int(time.time())

        def sse(choices: list[dict[str, Any]], usage_body: dict | None = None) -> str:
            body = chunk(rid, name, stamp, chat, choices, usage_body, include_usage)
            return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

        try:
            if chat:  # OpenAI's first chunk names the role
                yield sse([{"index": s.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for s in states])
            async for index, out in fan:
                state = states[index]
                text, logprobs = state.add(out, token_text)
                if state.reader is not None:  # tool calls: deltas of the reader, not of the text
                    for delta in state.tool_deltas[:-1]:
                        yield sse([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])
                    last = state.tool_deltas[-1:]
                    if not last and logprobs is None and not out.finished:
                        continue
                    choice = {"index": index, "delta": last[0] if last else {}, "logprobs": logprobs,
                              "finish_reason": state.finish_reason if out.finished else None}
                    if out.finished:
                        choice["cost"] = state.cost
                    yield sse([choice])
                    continue
                if not text and logprobs is None and not out.finished:
                    continue
                choice: dict[str, Any] = {"index": index}
                if chat:
                    choice["delta"] = {"content": text} if text else {}
                else:
                    choice["text"] = text
                choice["logprobs"] = logprobs
                choice["finish_reason"] = out.finish_reason if out.finished else None
                if out.finished:
                    choice["cost"] = state.cost
                yield sse([choice])
            if include_usage:
                yield sse([], usage(states))
        except Exception as exc:  # headers are sent: the error travels as an event
            if not isinstance(exc, RequestError):
                exc = _internal(exc)
            elif isinstance(exc, InternalError):
                log.error("request failed: %s", exc, exc_info=exc.__cause__)
            _, err, _ = request_error_body(exc)
            yield f"data: {json.dumps(err)}\n\n"
        finally:
            fan.cancel()
        yield "data: [DONE]\n\n"

    return app


def _internal(exc: Exception) -> InternalError:
    err = InternalError(f"internal error: {type(exc).__name__}: {exc}")
    log.error("%s", err, exc_info=exc)
    return err


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body was read already: only http.disconnect can come)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
