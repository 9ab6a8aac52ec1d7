"""``+recipe=serve``: build the engine, run the app under uvicorn, drain on SIGTERM.

Draining is ours, not uvicorn's: uvicorn's own shutdown closes the listening socket at once, so a client would
see "connection refused" instead of a 503 it can act on, and it re-raises the signal after shutting down, so
the process would die of SIGTERM instead of exiting 0. Here the first SIGTERM/SIGINT turns the gate to
"draining" (``/health`` and new API requests answer 503) while requests in flight finish, for up to
``server.drain_timeout_s``; what is still running then is aborted (its clients get a 503 error), and uvicorn
is told to stop. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from types import FrameType

import uvicorn
from fastapi import FastAPI

from litellm_pipeline.config.schema import AppConfig, ServerSection
from litellm_pipeline.errors import ConfigError
from litellm_pipeline.server.auth import ApiKeys

__all__ = ["serve", "run_app", "served_model_name"]

log = logging.getLogger("litellm_pipeline.server")
# after the drain, how long aborted requests get to send their 503 before uvicorn closes their connections
_ABORT_GRACE_S = 5.0


def served_model_name(app_cfg: AppConfig) -> str:
    """``server.served_model_name``, else the checkpoint folder's name, else ``demo`` (the embedded model)."""
    if app_cfg.server.served_model_name:
        return app_cfg.server.served_model_name
    return Path(app_cfg.model.path).resolve().name if app_cfg.model.path else "demo"


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout_s: float):
        super().__init__(config)
        self.app = app
        self.drain_timeout_s = drain_timeout_s
        self.url: str | None = None
        self._drain: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        try:
            await super().startup(sockets)
        except SystemExit:  # uvicorn exits the process when it cannot listen: let run_app say why instead
            self.should_exit = True
            return
        if self.started and not self.should_exit:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            self.url = f"http://{shown}:{port}"
            print(f"serving {self.app.state.model_name!r} at {self.url} (chat page: {self.url}/; OpenAI API: "
                  f"{self.url}/v1; API docs: {self.url}/docs; health: {self.url}/health; metrics: {self.url}/metrics)",
                  flush=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # runs in the main thread, which runs the event loop: hand the work to the loop
        if self._drain is not None or self.should_exit:
            log.warning("second signal: stopping without waiting for requests in flight")
            self.should_exit = self.force_exit = True
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # before the event loop runs: nothing is in flight to wait for
            self.should_exit = True
            return
        self.app.state.gate.status = "draining"  # from now on: 503
        loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        gate = self.app.state.gate
        log.info("draining: %d request(s) in flight, waiting up to %.0f s", gate.in_flight, self.drain_timeout_s)
        if not await gate.wait_idle(self.drain_timeout_s):
            log.warning("drain timeout: aborting %d request(s) still in flight", gate.in_flight)
            await asyncio.to_thread(self.app.state.async_engine.shutdown)  # their streams raise a 503
            await gate.wait_idle(_ABORT_GRACE_S)
        self.should_exit = True


def run_app(app: FastAPI, settings: ServerSection) -> DrainingServer:
    """Serve ``app`` until a signal drains it; returns the stopped server. Raises ConfigError if it could not
    start (e.g. the port is taken)."""
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level, lifespan="on",
        h11_max_incomplete_event_size=4 * settings.max_header_bytes, timeout_graceful_shutdown=_ABORT_GRACE_S,
    )
    server = DrainingServer(config, app, settings.drain_timeout_s)
    before = sys.getswitchinterval()
    if settings.switch_interval_ms is not None:
        sys.setswitchinterval(settings.switch_interval_ms / 1000)
    try:
        server.run()
    finally:
        sys.setswitchinterval(before)
    if not server.started:
        raise ConfigError(
            f"server: could not listen on {settings.host}:{settings.port} (see the log above; "
            "server.port=0 picks a free port)")
    return server


def serve(app_cfg: AppConfig) -> DrainingServer:
    """The serve task: the engine of the config, the app over it (API keys wanted when ``conf/tenants`` names
    tenants), uvicorn until drained."""
    from litellm_pipeline.config.build import build_from_app
    from litellm_pipeline.server.app import build_app

    # keys first: a missing key variable stops the start before the model is loaded
    keys = ApiKeys.from_config(app_cfg.tenants) if app_cfg.tenants else None
    engine = build_from_app(app_cfg)
    app = build_app(engine, app_cfg.server, model_name=served_model_name(app_cfg), tenant_of=keys)
    try:
        server = run_app(app, app_cfg.server)
    finally:
        engine.close()  # a parallel engine's workers
    log.info("stopped after %d request(s)", server.server_state.total_requests)
    return server
