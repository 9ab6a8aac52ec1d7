"""``+recipe=loadtest``: the HTTP server under a streaming load, against the same load through the Python API.

A client (this process) sends ``loadtest.requests`` streaming completions with Poisson arrivals at
``loadtest.rate`` requests per second (bounded by ``loadtest.max_duration_s``) to a server: one it starts
itself (``python -m litellm_pipeline +recipe=serve server.port=0`` as a second process, with the same model and
overrides) or the one at ``loadtest.url``. Per request it records the time to the first token and between
tokens, from the server-sent events as they arrive. Then the same arrivals run in this process through
``AsyncEngine`` (the Python API, no HTTP), so the server's overhead is a ratio measured in one run. Reported:
TTFT and inter-token latency p50 / p99, output tokens per second, goodput (requests per second that kept both
SLOs, ``loadtest.slo_ttft_ms`` and ``loadtest.slo_itl_ms``, the mean gap between a request's tokens), and,
afterwards, that the server is healthy with no KV block in use (read from its ``/metrics``).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from litellm_pipeline.errors import section_settings
from litellm_pipeline.tasks._noisy import NoisySettings, format_noisy, run_noisy


class LoadtestSettings(BaseModel):
    """The ``loadtest:`` config section (see recipes/loadtest.yaml)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str | None = None  # a running server; None: start one
    requests: int = Field(default=200, ge=1)
    rate: float = Field(default=100.0, gt=0)  # Poisson arrivals, requests per second (inf: all at once)
    max_duration_s: float = Field(default=120.0, gt=0)  # arrivals after this are not sent
    max_tokens: int = Field(default=32, ge=1)
    slo_ttft_ms: float = Field(default=500.0, gt=0)
    slo_itl_ms: float = Field(default=50.0, gt=0)
    seed: int = 0
    in_process: bool = True  # also run the same arrivals through the Python API
    startup_timeout_s: float = Field(default=120.0, gt=0)
    request_timeout_s: float = Field(default=300.0, gt=0)
    noisy: NoisySettings = NoisySettings()  # the noisy-neighbour test (tasks/_noisy.py) instead of the load above


def load_settings(section: Any) -> LoadtestSettings:
    return section_settings(LoadtestSettings, section, "loadtest")


@dataclass
class Trace:
    """One request's text arrival times (seconds from its send) and how it ended. Times are of chunks that carry
    text: a token that completes no character yet (a split multi-byte one) arrives with the next."""

    sent_s: float  # from the start of the run
    token_times: list[float] = field(default_factory=list)
    tokens: int = 0
    finished: bool = False
    error: str | None = None

    @property
    def ttft_ms(self) -> float | None:
        return self.token_times[0] * 1e3 if self.token_times else None

    @property
    def itl_ms(self) -> list[float]:
        t = self.token_times
        return [(b - a) * 1e3 for a, b in zip(t, t[1:])]


def arrivals(s: LoadtestSettings) -> list[float]:
    """Send times (seconds from the start), seeded Poisson, cut at max_duration_s."""
    rng = random.Random(f"loadtest:{s.seed}")
    out, t = [], 0.0
    for _ in range(s.requests):
        t += rng.expovariate(s.rate)
        if t > s.max_duration_s:
            break
        out.append(t)
    return out


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summarise(traces: list[Trace], wall_s: float, s: LoadtestSettings) -> dict:
    ok = [t for t in traces if t.error is None and t.finished]
    timed = [t for t in ok if t.token_times]
    ttft = [t.ttft_ms for t in timed]
    itl = [g for t in timed for g in t.itl_ms]
    good = [t for t in timed
            if t.ttft_ms <= s.slo_ttft_ms and (not t.itl_ms or statistics.mean(t.itl_ms) <= s.slo_itl_ms)]
    tokens = sum(t.tokens for t in ok)
    return {
        "requests": len(traces), "completed": len(ok), "failed": len(traces) - len(ok),
        "errors": sorted({t.error for t in traces if t.error})[:5],
        "wall_s": wall_s, "output_tokens": tokens,
        "output_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "goodput_requests_per_s": len(good) / wall_s if wall_s > 0 else 0.0,
        "slo_met_share": len(good) / len(traces) if traces else 0.0,
        "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p99": _pct(ttft, 99),
        "itl_ms_p50": _pct(itl, 50), "itl_ms_p99": _pct(itl, 99),
    }


# ---- the HTTP client ---------------------------------------------------------------------------------------
async def _one_http(client, url: str, model: str, prompt: str, s: LoadtestSettings, trace: Trace) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": s.max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=s.request_timeout_s) as resp:
            if resp.status_code != 200:
                trace.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    trace.tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("finish_reason") for c in chunk.get("choices", ())):
                    trace.finished = True
                if any(c.get("text") for c in chunk.get("choices", ())):
                    trace.token_times.append(time.perf_counter() - t0)
    except Exception as exc:  # a failed request is reported, the run goes on
        trace.error = f"{type(exc).__name__}: {exc}"


async def run_http(url: str, model: str, texts: list[str], times: list[float], s: LoadtestSettings,
                   bar=None) -> tuple[list[Trace], float]:
    import httpx

    traces = [Trace(t) for t in times]
    limits = httpx.Limits(max_connections=len(times) + 4, max_keepalive_connections=len(times) + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        start = time.perf_counter()

        async def fire(i: int) -> None:
            await asyncio.sleep(max(0.0, times[i] - (time.perf_counter() - start)))
            await _one_http(client, url, model, texts[i], s, traces[i])
            if bar is not None:
                bar.update(1)

        await asyncio.gather(*(fire(i) for i in range(len(times))))
        wall = time.perf_counter() - start
    return traces, wall


# ---- the same load through the Python API ------------------------------------------------------------------
async def run_in_process(engine, texts: list[str], times: list[float], s: LoadtestSettings,
                         bar=None) -> tuple[list[Trace], float]:
    from litellm_pipeline.engine.async_engine import AsyncEngine
    from litellm_pipeline.sampling import SamplingParams

    params = SamplingParams(max_tokens=s.max_tokens, temperature=0.0, ignore_eos=True)
    traces = [Trace(t) for t in times]
    async with AsyncEngine(engine) as aeng:
        start = time.perf_counter()

        async def fire(i: int) -> None:
            await asyncio.sleep(max(0.0, times[i] - (time.perf_counter() - start)))
            t0 = time.perf_counter()
            try:
                async for out in aeng.generate(texts[i], params):
                    if out.delta_text:
                        traces[i].token_times.append(time.perf_counter() - t0)
                    traces[i].tokens = len(out.token_ids)
                    traces[i].finished = out.finished
            except Exception as exc:
                traces[i].error = f"{type(exc).__name__}: {exc}"
            if bar is not None:
                bar.update(1)

        await asyncio.gather(*(fire(i) for i in range(len(times))))
        wall = time.perf_counter() - start
    return traces, wall


# ---- the server process ------------------------------------------------------------------------------------
_URL = re.compile(r" at (http://\S+) ")


class ServerProcess:
    """``+recipe=serve`` on a free port in a child process, with the overrides this run was given."""

    def __init__(self, overrides: list[str], timeout_s: float):
        cmd = [sys.executable, "-m", "litellm_pipeline", "+recipe=serve", *overrides, "server.port=0",
               "hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=disabled",
               "hydra/hydra_logging=disabled"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.url = self._wait_url(timeout_s)
        # from now on its output (an access log line per request) is read and only the tail kept: a pipe nobody
        # reads fills up, and the server would block writing its log
        self.tail: collections.deque[str] = collections.deque(maxlen=200)
        self._reader = threading.Thread(target=self._drain, name="loadtest-server-log", daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.tail.append(line)

    def _wait_url(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        seen = []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break  # the server exited
            seen.append(line)
            m = _URL.search(line)
            if m:
                return m.group(1)
        self.stop()
        raise RuntimeError("loadtest: the server did not start:\n" + "".join(seen[-20:]))

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: the server drains and exits 0
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def server_overrides(overrides: list[str]) -> list[str]:
    """This run's command-line overrides that describe the model and engine (not the recipe, the load or Hydra)."""
    drop = ("+recipe=", "loadtest.", "+loadtest.", "hydra.", "hydra/")
    return [o for o in overrides if not o.lstrip("~+").startswith(tuple(d.lstrip("+") for d in drop))]


def server_state(url: str) -> dict:
    """After the run: /health and the KV blocks in use and requests running, from /metrics."""
    import httpx

    health = httpx.get(f"{url}/health", timeout=10).status_code
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {"health": health, "kv_blocks_used": _gauge(text, "kv_blocks_used"),
            "requests_running": _gauge(text, "num_requests_running"),
            "requests_waiting": _gauge(text, "num_requests_waiting")}


def _gauge(text: str, name: str) -> float | None:
    """The sum over label sets of a gauge in the Prometheus text format (hot and warm blocks, say)."""
    vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(f"litellm_pipeline:{name}") and not line.startswith("#")]
    return sum(vals) if vals else None


def _model_id(url: str) -> str:
    import httpx

    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def format_report(r: dict) -> str:
    def f(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    head = (f"{'path':<12}{'done':>6}{'fail':>6}{'tok/s':>9}{'goodput/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}"
            f"{'ITL p50':>9}{'ITL p99':>9}")
    lines = [f"{r['requests']} streaming requests, Poisson arrivals at {r['rate']:g}/s, {r['max_tokens']} tokens each; "
             f"SLOs: TTFT <= {r['slo_ttft_ms']:g} ms, mean ITL <= {r['slo_itl_ms']:g} ms (ms below)", head,
             "-" * len(head)]
    for name in ("http", "in_process"):
        x = r.get(name)
        if x is None:
            continue
        lines.append(f"{name:<12}{x['completed']:>6}{x['failed']:>6}{f(x['output_tok_s']):>9}"
                     f"{f(x['goodput_requests_per_s'], '.2f'):>11}{f(x['ttft_ms_p50']):>10}{f(x['ttft_ms_p99']):>10}"
                     f"{f(x['itl_ms_p50']):>9}{f(x['itl_ms_p99']):>9}")
    if r.get("server_vs_in_process") is not None:
        lines.append(f"server throughput / in-process throughput: {r['server_vs_in_process']:.1%} (goal >= 90%)")
    st = r.get("server_after")
    if st:
        lines.append(f"after the run: health {st['health']}, KV blocks in use {f(st['kv_blocks_used'], 'g')}, "
                     f"running {f(st['requests_running'], 'g')}, waiting {f(st['requests_waiting'], 'g')}")
    for name in ("http", "in_process"):
        for e in (r.get(name) or {}).get("errors", []):
            lines.append(f"{name} error: {e}")
    return "\n".join(lines)


def run_loadtest(cfg, overrides: list[str]) -> dict:
    from tqdm import tqdm

    from litellm_pipeline.config.build import build_engine, to_plain
    from litellm_pipeline.tasks import write_json

    plain = to_plain(cfg)
    s = load_settings(plain.get("loadtest"))
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would bury the report
    demo = plain["model"].get("path") is None
    if s.noisy.enabled:
        result = run_noisy(s.noisy, server_overrides(overrides), demo, s.seed, s.max_duration_s,
                           s.startup_timeout_s, s.request_timeout_s)
        print(format_noisy(result))
        path = write_json(result, "loadtest.json")
        print(f"wrote {path}")
        return result
    times = arrivals(s)
    from litellm_pipeline.tasks.budget_load import workload_prompts

    texts = workload_prompts(len(times), demo, s.seed)
    result: dict[str, Any] = {"requests": len(times), "rate": s.rate, "max_tokens": s.max_tokens,
                              "slo_ttft_ms": s.slo_ttft_ms, "slo_itl_ms": s.slo_itl_ms}
    server = None if s.url else ServerProcess(server_overrides(overrides), s.startup_timeout_s)
    url = s.url or server.url
    try:
        with tqdm(total=len(times), desc="loadtest: http", unit="req") as bar:
            traces, wall = asyncio.run(run_http(url, _model_id(url), texts, times, s, bar))
        result["http"] = summarise(traces, wall, s)
        result["server_after"] = server_state(url)
    finally:
        if server is not None:
            result["server_exit_code"] = server.stop()
    if s.in_process:
        engine = build_engine(plain)
        with tqdm(total=len(times), desc="loadtest: in-process", unit="req") as bar:
            traces, wall = asyncio.run(run_in_process(engine, texts, times, s, bar))
        result["in_process"] = summarise(traces, wall, s)
        base = result["in_process"]["output_tok_s"]
        result["server_vs_in_process"] = result["http"]["output_tok_s"] / base if base else None
    print(format_report(result))
    path = write_json(result, "loadtest.json")
    print(f"wrote {path}")
    return result


def run(cfg) -> dict:
    """The load test with the command line's overrides (the server it starts gets the same ones)."""
    from hydra.core.hydra_config import HydraConfig

    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    return run_loadtest(cfg, overrides)
