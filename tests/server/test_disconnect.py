"""A client that goes away mid-request has its engine requests aborted and their KV blocks freed at once."""

from __future__ import annotations

import logging
import time

import httpx
import pytest
from _server_util import wait_pool_empty
from server_stages import slow_steps

from litellm_pipeline import SamplingParams
from litellm_pipeline.telemetry.prometheus import PrometheusSink

LONG = {"prompt": "copy:abcdef=", "max_tokens": 45, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def slow(demo_server):
    # 45 tokens take about 9 s: a client that leaves after two events leaves in the middle even when a loaded
    # machine stalls the reader for seconds, and a request that ran to its end instead is plainly slower
    with slow_steps(demo_server, 0.2):
        yield


def aborted(engine) -> float:
    sink = engine.bus.sink(PrometheusSink)
    return sum(s.value for m in sink.registry.collect() if m.name == "litellm_pipeline:request_success"
               for s in m.samples if s.name.endswith("_total") and s.labels["finish_reason"] == "abort")


def test_disconnect_mid_stream_aborts_and_frees_blocks(demo_server, slow, reference):
    engine, pool = demo_server.engine, demo_server.engine.rt.pool
    before = aborted(engine)
    with httpx.Client(base_url=demo_server.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={**LONG, "stream": True, "n": 2}) as resp:
            events = 0
            for line in resp.iter_lines():
                events += line.startswith("data: ")
                if events == 2:
                    break
            assert len(engine.requests) == 2 and pool.num_free < pool.num_blocks  # both choices hold KV now
            ids = set(engine.requests)
    # the connection is closed: both choices are aborted and every block comes back
    wait_pool_empty(engine)
    assert not ids & set(engine.requests)
    assert aborted(engine) == before + 2
    # and the server serves the next request as before
    (ref,) = reference.generate("12+345=", SamplingParams(max_tokens=6, temperature=0))
    with httpx.Client(base_url=demo_server.url, timeout=30) as client:
        assert client.post("/v1/completions", json={"prompt": "12+345=", "max_tokens": 6, "temperature": 0}
                           ).json()["choices"][0]["text"] == ref.text


class _Errors(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_disconnect_while_waiting_for_a_whole_answer_aborts(demo_server, slow):
    """The request is aborted at once, and the handler ends without an exception (uvicorn logs one as an error)."""
    engine = demo_server.engine
    before = aborted(engine)
    errors = _Errors()
    log = logging.getLogger("uvicorn.error")
    log.addHandler(errors)
    try:
        for _ in range(2):
            with httpx.Client(base_url=demo_server.url, timeout=0.3) as client:
                with pytest.raises(httpx.ReadTimeout):
                    client.post("/v1/completions", json=LONG)  # gives up (and closes) long before the 45 tokens
            t0 = time.monotonic()
            wait_pool_empty(engine)
            assert time.monotonic() - t0 < 5.0, "the request ran to its end (about 9 s) instead of being aborted"
        time.sleep(0.5)  # the handlers' last lines run after the aborts
    finally:
        log.removeHandler(errors)
    assert aborted(engine) == before + 2
    assert not errors.records, [r.getMessage() + repr(r.exc_info and r.exc_info[1]) for r in errors.records]
