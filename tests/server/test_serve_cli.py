"""``python -m litellm_pipeline +recipe=serve`` as a user runs it: prints its URL, serves, and on SIGTERM drains
(503 to new requests and health checks, requests in flight finish) and exits 0."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from litellm_pipeline import SamplingParams

HERE = Path(__file__).resolve().parent
PROMPT = "copy:abc="
SLOW = ["+pipeline.stages.slow={impl: 'server_stages:SlowSteps', params: {delay_s: 0.05}}",
        "pipeline.order=[admit,select_tier,route,prefill,decode,sample,slow,emit]"]


class ServeProcess:
    """The server in a subprocess; ``url`` once it printed it."""

    def __init__(self, tmp_path: Path, *overrides: str):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "litellm_pipeline", "+recipe=serve", "server.port=0", "device.threads=1",
               "server.log_level=warning", f"hydra.run.dir={tmp_path}/run", *overrides]
        self.proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.lines: queue.Queue = queue.Queue()
        self.stdout: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.url = self._wait_url(timeout=120)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.stdout.append(line)
            self.lines.put(line)

    def _wait_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            found = re.search(r"serving 'demo' at (http://127\.0\.0\.1:\d+) ", line)
            if found:
                return found.group(1)
        self.proc.kill()
        raise AssertionError(f"no URL printed; stdout: {''.join(self.stdout)}\nstderr: {self.proc.stderr.read()}")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"the server did not exit; stderr: {self.proc.stderr.read()}") from None


def stream_in_thread(url: str, max_tokens: int) -> tuple[threading.Thread, threading.Event, list]:
    """A greedy streaming completion read in a thread: (thread, first-token event, events as dicts or '[DONE]')."""
    events: list = []
    started = threading.Event()

    def run():
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                    started.set()
        started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, started, events


def wait_draining(url: str) -> httpx.Response:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        health = httpx.get(url + "/health", timeout=5)
        if health.status_code == 503:
            return health
        time.sleep(0.02)
    raise AssertionError("health never turned 503 after SIGTERM")


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_and_exits_0(tmp_path, reference):
    tokens = 30  # 30 steps of >= 50 ms: well past the moment SIGTERM lands
    (ref,) = reference.generate(PROMPT, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    server = ServeProcess(tmp_path, *SLOW, "server.drain_timeout_s=60")
    assert httpx.get(server.url + "/health", timeout=5).json()["status"] == "ok"
    thread, started, events = stream_in_thread(server.url, tokens)
    assert started.wait(30)
    server.proc.send_signal(signal.SIGTERM)

    health = wait_draining(server.url)
    assert health.json()["status"] == "draining" and health.json()["requests_in_flight"] == 1
    refused = httpx.post(server.url + "/v1/completions", json={"prompt": "1+2="}, timeout=5)
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]

    thread.join(60)
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in chunks) == ref.text and chunks[-1]["finish_reason"] == "length"
    assert server.wait(30) == 0


@pytest.mark.slow
def test_drain_timeout_aborts_what_is_left_and_still_exits_0(tmp_path):
    server = ServeProcess(tmp_path, *SLOW, "server.drain_timeout_s=0.3")
    thread, started, events = stream_in_thread(server.url, 50)  # 2.5 s of steps: outlives the drain
    assert started.wait(30)
    server.proc.send_signal(signal.SIGTERM)
    thread.join(30)
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["type"] == "service_unavailable_error" and "shut down" in err["message"]
    assert not any(e["choices"][0]["finish_reason"] for e in events[:-2]), "it finished: nothing was aborted"
    assert server.wait(30) == 0  # aborted above (no finish_reason), not waited for: no wall-clock bound needed


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def test_sigterm_stops_a_parallel_server_and_its_worker(tmp_path):
    """``+recipe=serve parallel.tensor=2``: the demo answers through both ranks; SIGTERM drains, exits 0 and the
    worker process is gone with it."""
    server = ServeProcess(tmp_path, "parallel.tensor=2")
    try:
        (worker,) = _children(server.proc.pid)
        resp = httpx.post(f"{server.url}/v1/completions", json={"model": "demo", "prompt": PROMPT, "max_tokens": 4,
                                                                  "temperature": 0}, timeout=60)
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"]
    finally:
        server.proc.send_signal(signal.SIGTERM)
    assert server.wait(60) == 0
    assert not Path(f"/proc/{worker}").exists() or "zombie" in Path(f"/proc/{worker}/status").read_text()
