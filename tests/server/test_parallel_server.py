"""A server over a tensor-parallel engine: the openai client gets one process's tokens; when a worker dies the
requests fail naming its rank, the server keeps answering, and /health says why it is failed."""

from __future__ import annotations

import os
import signal

import openai
import pytest
from _server_util import start_server


@pytest.fixture
def parallel_server(hf_checkpoint):
    live = start_server([f"model.path={hf_checkpoint('qwen2')}", "parallel.tensor=2"], model_name="tiny")
    yield live
    live.stop()
    live.engine.close()


def test_a_parallel_engine_serves_until_a_rank_dies(parallel_server, hf_checkpoint):
    single = start_server([f"model.path={hf_checkpoint('qwen2')}"], model_name="tiny")
    try:
        want = single.openai().completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0)
    finally:
        single.stop()
    client = parallel_server.openai()
    got = client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0)
    assert got.choices[0].text == want.choices[0].text
    with parallel_server.client() as http:
        assert http.get("/health").status_code == 200
        (worker,) = parallel_server.engine.rt.parallel.driver.procs
        os.kill(worker.pid, signal.SIGKILL)
        with pytest.raises(openai.InternalServerError, match="rank 1"):
            client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0)
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "rank 1" in health.json()["error"]
        assert http.get("/v1/models").status_code == 200  # the server itself still answers
