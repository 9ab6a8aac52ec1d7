"""``+recipe=loadtest loadtest.noisy.enabled=true``: a noisy neighbour, over HTTP on loopback.

Tenant ``b`` sends short streaming completions at a modest Poisson rate, within its quotas; tenant ``a`` floods the
same server with long prompts for as long as b's load lasts, more than its quota lets in. Three phases, each
bounded by request counts and ``loadtest.max_duration_s``:

1. ``alone``: b's load with nothing else;
2. ``flood``: b's same load while a floods;
3. ``flood_disconnect``: the same, but a's clients drop each stream after ``disconnect_after_chunks`` chunks and
   send the request again (a client that reconnects), ``reconnects`` times.

The server is started with both tenants' API keys (random, made here), their quotas and KV shares, and
``engine.scheduler=fair`` (the load's config is in the report). Reported per phase: b's time to first token
(p50 / p95 / p99), b's responses by status (any 429 or 503 is a failure of the isolation: b stays within its
quotas), a's responses by status (its excess must get 429, or wait), a's streams dropped, and the server's KV
blocks in use and health afterwards. Goals: b's p95 TTFT under the flood at most ``goal_ttft_ratio`` (2) times
its p95 alone, no 429/503 for b, and the server healthy with no KV block in use at the end.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import secrets
import string
import time
from collections import Counter
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class NoisySettings(BaseModel):
    """``loadtest.noisy``: the noisy-neighbour test (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    b_requests: int = Field(default=80, ge=1)  # tenant b's requests per phase
    b_rate: float = Field(default=8.0, gt=0)  # their Poisson arrivals per second
    b_max_tokens: int = Field(default=8, ge=1)
    b_max_concurrent: int = Field(default=16, ge=1)  # b's quota (its load stays within it)
    b_min_kv_fraction: float | None = Field(default=0.25, ge=0, le=1)
    a_requests: int = Field(default=1500, ge=1)  # tenant a's flood per phase (at most; it stops with b's load)
    a_rate: float = Field(default=100.0, gt=0)  # its arrivals per second (a flood: more than its quota lets in)
    a_max_tokens: int = Field(default=16, ge=1)
    a_prompt_chars: int = Field(default=36, ge=1)  # a's long prompts (the demo model's context is 64 tokens)
    a_max_concurrent: int = Field(default=32, ge=1)  # a's quota: its excess gets 429
    a_max_kv_fraction: float | None = Field(default=0.5, gt=0, le=1)
    disconnect_after_chunks: int = Field(default=2, ge=1)  # phase 3: a's clients drop the stream after this
    reconnects: int = Field(default=1, ge=0)  # ... and send the request again this many times
    scheduler: str = "fair"
    goal_ttft_ratio: float = Field(default=2.0, gt=0)


def tenant_overrides(n: NoisySettings, keys: dict[str, str]) -> list[str]:
    """The server's overrides: both tenants (keys as digests), quotas and KV shares, and the scheduler."""
    out = [f"engine.scheduler={n.scheduler}"]
    for t, key in keys.items():
        out.append(f"+tenants.{t}.api_key_sha256=[{hashlib.sha256(key.encode()).hexdigest()}]")
    out.append(f"+tenants.a.max_concurrent={n.a_max_concurrent}")
    out.append(f"+tenants.b.max_concurrent={n.b_max_concurrent}")
    if n.a_max_kv_fraction is not None:
        out.append(f"+tenants.a.max_kv_fraction={n.a_max_kv_fraction}")
    if n.b_min_kv_fraction is not None:
        out.append(f"+tenants.b.min_kv_fraction={n.b_min_kv_fraction}")
    return out


def _times(count: int, rate: float, seed: str, max_s: float) -> list[float]:
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(count):
        t += rng.expovariate(rate)
        if t > max_s:
            break
        out.append(t)
    return out


def long_prompts(count: int, chars: int, seed: int) -> list[str]:
    """a's prompts: ``copy:`` of ``chars`` random letters and digits (the demo model copies them back)."""
    rng = random.Random(f"noisy-a:{seed}")
    alphabet = string.ascii_lowercase + string.digits
    return ["copy:" + "".join(rng.choice(alphabet) for _ in range(chars)) + "=" for _ in range(count)]


async def _stream(client, url: str, model: str, key: str, prompt: str, max_tokens: int, timeout_s: float,
                  drop_after: int | None = None) -> dict[str, Any]:
    """One streaming completion: its status, the seconds to its first text chunk, chunks seen, and whether the
    client dropped it (after ``drop_after`` chunks)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    got: dict[str, Any] = {"status": None, "ttft_s": None, "chunks": 0, "dropped": False, "finished": False}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout_s,
                                 headers={"Authorization": f"Bearer {key}"}) as resp:
            got["status"] = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                return got
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if any(c.get("text") for c in chunk.get("choices", ())):
                    if got["ttft_s"] is None:
                        got["ttft_s"] = time.perf_counter() - t0
                    got["chunks"] += 1
                    if drop_after is not None and got["chunks"] >= drop_after:
                        got["dropped"] = True
                        return got  # leaving the block closes the connection mid-stream
                if any(c.get("finish_reason") for c in chunk.get("choices", ())):
                    got["finished"] = True
    except Exception as exc:  # reported per request, the run goes on
        got["error"] = f"{type(exc).__name__}: {exc}"
    return got


async def run_phase(url: str, model: str, keys: dict[str, str], n: NoisySettings, b_prompts: list[str],
                    a_prompts: list[str], flood: bool, disconnect: bool, max_s: float, timeout_s: float,
                    seed: int) -> dict[str, Any]:
    import httpx

    b_times = _times(n.b_requests, n.b_rate, f"noisy-b:{seed}", max_s)
    # the flood lasts as long as b's load does
    a_times = _times(n.a_requests, n.a_rate, f"noisy-a:{seed}", b_times[-1] if b_times else max_s) if flood else []
    limits = httpx.Limits(max_connections=len(b_times) + len(a_times) + 8,
                          max_keepalive_connections=len(b_times) + len(a_times) + 8)
    b_out: list[dict] = []
    a_out: list[dict] = []
    async with httpx.AsyncClient(limits=limits) as client:
        start = time.perf_counter()

        async def b_one(i: int) -> None:
            await asyncio.sleep(max(0.0, b_times[i] - (time.perf_counter() - start)))
            b_out.append(await _stream(client, url, model, keys["b"], b_prompts[i % len(b_prompts)],
                                       n.b_max_tokens, timeout_s))

        async def a_one(i: int) -> None:
            await asyncio.sleep(max(0.0, a_times[i] - (time.perf_counter() - start)))
            prompt = a_prompts[i % len(a_prompts)]
            tries = 1 + (n.reconnects if disconnect else 0)
            for k in range(tries):
                drop = n.disconnect_after_chunks if disconnect and k < tries - 1 else None
                got = await _stream(client, url, model, keys["a"], prompt, n.a_max_tokens, timeout_s, drop)
                a_out.append(got)
                if not got["dropped"]:
                    break

        await asyncio.gather(*(b_one(i) for i in range(len(b_times))), *(a_one(i) for i in range(len(a_times))))
        wall = time.perf_counter() - start
    ttft = sorted(x["ttft_s"] * 1e3 for x in b_out if x["ttft_s"] is not None)
    return {
        "wall_s": wall,
        "b": {"sent": len(b_times), "status": _statuses(b_out), "completed": sum(x["finished"] for x in b_out),
              "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p95": _pct(ttft, 95), "ttft_ms_p99": _pct(ttft, 99),
              "errors": sorted({x["error"] for x in b_out if x.get("error")})[:3]},
        "a": {"sent": len(a_times), "attempts": len(a_out), "status": _statuses(a_out),
              "completed": sum(x["finished"] for x in a_out), "dropped": sum(x["dropped"] for x in a_out),
              "errors": sorted({x["error"] for x in a_out if x.get("error")})[:3]},
    }


def _statuses(outs: list[dict]) -> dict[str, int]:
    return dict(sorted(Counter(str(x["status"]) for x in outs).items()))


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def verdict(result: dict[str, Any], n: NoisySettings) -> dict[str, Any]:
    """The goals, each True/False (None where it could not be measured)."""
    alone = result["phases"]["alone"]["b"]["ttft_ms_p95"]
    out: dict[str, Any] = {}
    for name in ("flood", "flood_disconnect"):
        ph = result["phases"].get(name)
        if ph is None:
            continue
        p95 = ph["b"]["ttft_ms_p95"]
        ratio = p95 / alone if p95 is not None and alone else None
        out[f"{name}_b_ttft_p95_ratio"] = ratio
        out[f"{name}_b_ttft_ok"] = None if ratio is None else ratio <= n.goal_ttft_ratio
        bad = {s: c for s, c in ph["b"]["status"].items() if s in ("429", "503")}
        out[f"{name}_b_never_refused"] = not bad and ph["b"]["completed"] == ph["b"]["sent"]
        a_status = ph["a"]["status"]
        out[f"{name}_a_excess_refused_or_served"] = set(a_status) <= {"200", "429", "503"}
    st = result.get("server_after") or {}
    out["server_clean_after"] = st.get("health") == 200 and not st.get("kv_blocks_used")
    return out


def format_noisy(r: dict[str, Any]) -> str:
    def f(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    lines = [f"noisy neighbour: b {r['settings']['b_requests']} requests at {r['settings']['b_rate']:g}/s within its "
             f"quotas; a floods {r['settings']['a_requests']} long prompts at {r['settings']['a_rate']:g}/s "
             f"(max_concurrent {r['settings']['a_max_concurrent']}, max_kv_fraction "
             f"{r['settings']['a_max_kv_fraction']}); scheduler {r['settings']['scheduler']}",
             f"{'phase':<18}{'b TTFT p50':>11}{'p95':>8}{'p99':>8}  {'b status':<16}{'a status':<26}{'a dropped':>9}"]
    for name, ph in r["phases"].items():
        b, a = ph["b"], ph["a"]
        lines.append(f"{name:<18}{f(b['ttft_ms_p50']):>11}{f(b['ttft_ms_p95']):>8}{f(b['ttft_ms_p99']):>8}  "
                     f"{json.dumps(b['status']):<16}{json.dumps(a['status']):<26}{a['dropped']:>9}")
        for e in b["errors"] + a["errors"]:
            lines.append(f"  {name} error: {e}")
    v = r["verdict"]
    for name in ("flood", "flood_disconnect"):
        if f"{name}_b_ttft_p95_ratio" in v:
            lines.append(f"{name}: b's p95 TTFT {f(v[f'{name}_b_ttft_p95_ratio'], '.2f')}x alone (goal <= "
                         f"{r['settings']['goal_ttft_ratio']:g}x: {'met' if v[f'{name}_b_ttft_ok'] else 'NOT met'}); "
                         f"b never refused: {v[f'{name}_b_never_refused']}")
    st = r.get("server_after") or {}
    lines.append(f"after the run: health {st.get('health')}, KV blocks in use {f(st.get('kv_blocks_used'), 'g')}")
    return "\n".join(lines)


def run_noisy(n: NoisySettings, overrides: list[str], demo: bool, seed: int, max_s: float, startup_timeout_s: float,
              timeout_s: float) -> dict[str, Any]:
    """The three phases against a server started here (see the module docstring); the result and its verdict."""
    from litellm_pipeline.tasks.budget_load import workload_prompts
    from litellm_pipeline.tasks.loadtest import ServerProcess, server_state

    keys = {t: f"sk-{t}-{secrets.token_hex(12)}" for t in ("a", "b")}
    b_prompts = workload_prompts(n.b_requests, demo, seed)
    a_prompts = long_prompts(n.a_requests, n.a_prompt_chars, seed)
    server = ServerProcess([*overrides, *tenant_overrides(n, keys)], startup_timeout_s)
    result: dict[str, Any] = {"settings": n.model_dump(), "phases": {}}
    try:
        model = _model_id_with_key(server.url, keys["b"])
        for name, flood, disconnect in (("alone", False, False), ("flood", True, False),
                                        ("flood_disconnect", True, True)):
            phase = result["phases"][name] = asyncio.run(run_phase(
                server.url, model, keys, n, b_prompts, a_prompts, flood, disconnect, max_s, timeout_s, seed))
            phase["settled_s"] = _settle(server.url)
        result["server_after"] = server_state(server.url)
    finally:
        result["server_exit_code"] = server.stop()
    result["verdict"] = verdict(result, n)
    return result


def _model_id_with_key(url: str, key: str) -> str:
    import httpx

    return httpx.get(f"{url}/v1/models", timeout=10, headers={"Authorization": f"Bearer {key}"}).json()["data"][0]["id"]


def _settle(url: str, timeout_s: float = 60.0) -> float | None:
    """Wait until the server runs nothing (the dropped streams' requests aborted, the last ones done); the seconds
    that took, or None if it did not within ``timeout_s`` (a slow answer counts as not yet)."""
    import httpx

    from litellm_pipeline.tasks.loadtest import _gauge

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            text = httpx.get(f"{url}/metrics", timeout=5).text
        except httpx.HTTPError:
            continue
        if not _gauge(text, "num_requests_running") and not _gauge(text, "num_requests_waiting"):
            return time.monotonic() - t0
        time.sleep(0.1)
    return None
