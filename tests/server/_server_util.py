"""Helpers of the server tests (imported as a plain module: ``tests/server`` is on sys.path): a real uvicorn server
on a free loopback port in a background thread, and the KV pool check."""

from __future__ import annotations

import json
import shutil
import threading
import time
from dataclasses import dataclass

import httpx
import uvicorn

from litellm_pipeline.config.build import build_engine, to_plain
from litellm_pipeline.config.compose import compose
from litellm_pipeline.config.schema import validate_config
from litellm_pipeline.engine.engine import Engine
from litellm_pipeline.server.app import build_app
from litellm_pipeline.server.auth import ApiKeys

# the plugin stages of server_stages.py, put into the pipeline by config like any plugin's
PLUGIN_STAGES = ["+pipeline.stages.fault={impl: 'server_stages:FailOnMarker'}",
                 "+pipeline.stages.slow={impl: 'server_stages:SlowSteps', params: {delay_s: 0.0}}",
                 "pipeline.order=[admit,select_tier,route,prefill,decode,sample,fault,slow,emit]"]
# the chat template of the test copy: the user's text right after BOS, so a chat turn asks the demo skills
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


@dataclass
class LiveServer:
    url: str
    engine: Engine
    app: object
    server: uvicorn.Server
    thread: threading.Thread

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30.0, **kw)

    def openai(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", timeout=30.0, max_retries=0)

    def stage(self, cls: type):
        """The engine's instance of a plugin stage class (e.g. to slow its steps for one test)."""
        return next(s for s in self.engine.step_stages if isinstance(s, cls))

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the server thread did not stop"


def with_chat_template(src, dst, template: str):
    """A copy of checkpoint ``src`` at ``dst`` whose tokenizer_config.json has ``template`` as its chat template."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return dst


def start_server(overrides: list[str], model_name: str = "demo", **settings) -> LiveServer:
    """A server as ``+recipe=serve`` makes it (API keys wanted when the config names tenants, as in serve())."""
    cfg = compose(["+recipe=serve", "device.threads=1", *overrides])
    tenants = validate_config(to_plain(cfg)).tenants
    engine = build_engine(cfg)
    app = build_app(engine, {"port": 0, "log_level": "warning", **settings}, model_name=model_name,
                    tenant_of=ApiKeys.from_config(tenants) if tenants else None)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return LiveServer(f"http://127.0.0.1:{port}", engine, app, server, thread)


def wait_pool_empty(engine: Engine, timeout: float = 10.0) -> None:
    """Every KV block back (ref counts 0) and nothing in flight; fails naming what is still held."""
    pool = engine.rt.pool
    deadline = time.monotonic() + timeout
    while (not pool.is_empty() or engine.requests) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.is_empty() and not any(pool.ref_counts), f"{pool.num_blocks - pool.num_free} KV blocks still held"
    assert not engine.requests and not engine.has_unfinished(), f"still in flight: {list(engine.requests)}"
