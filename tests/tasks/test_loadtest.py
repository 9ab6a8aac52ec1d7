"""+recipe=loadtest: the real server in a second process under a streaming load, against the Python API."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from litellm_pipeline.errors import ConfigError
from litellm_pipeline.tasks.loadtest import (
    LoadtestSettings,
    Trace,
    arrivals,
    load_settings,
    server_overrides,
    summarise,
)


def test_arrivals_are_seeded_poisson_and_bounded_in_time():
    s = LoadtestSettings(requests=500, rate=50.0, seed=3)
    a = arrivals(s)
    assert a == arrivals(s) and a != arrivals(LoadtestSettings(requests=500, rate=50.0, seed=4))
    assert len(a) == 500 and all(x < y for x, y in zip(a, a[1:]))
    assert 500 / a[-1] == pytest.approx(50.0, rel=0.15)  # the mean rate
    cut = arrivals(LoadtestSettings(requests=500, rate=50.0, max_duration_s=2.0, seed=3))
    assert cut == [x for x in a if x <= 2.0] and 60 < len(cut) < 140


def test_summary_counts_slos_percentiles_and_failures():
    s = LoadtestSettings(slo_ttft_ms=100, slo_itl_ms=10)
    good = Trace(0.0, [0.05, 0.055, 0.06], tokens=3, finished=True)  # TTFT 50 ms, gaps 5 ms
    slow_start = Trace(0.0, [0.2, 0.201], tokens=2, finished=True)  # TTFT 200 ms
    slow_tokens = Trace(0.0, [0.01, 0.05], tokens=2, finished=True)  # a 40 ms gap
    silent = Trace(0.0, tokens=4, finished=True)  # its tokens made no complete character: done, but untimed
    failed = Trace(0.0, error="HTTP 400: bad")
    cut = Trace(0.0, [0.01], tokens=1)  # the stream ended without a finish_reason
    r = summarise([good, slow_start, slow_tokens, silent, failed, cut], wall_s=2.0, s=s)
    assert r["completed"] == 4 and r["failed"] == 2 and r["errors"] == ["HTTP 400: bad"]
    assert r["output_tokens"] == 11 and r["output_tok_s"] == pytest.approx(5.5)
    assert r["goodput_requests_per_s"] == pytest.approx(0.5) and r["slo_met_share"] == pytest.approx(1 / 6)
    assert r["ttft_ms_p50"] == pytest.approx(50.0) and r["ttft_ms_p99"] == pytest.approx(200.0)
    assert r["itl_ms_p99"] == pytest.approx(40.0)


def test_only_model_and_engine_overrides_reach_the_server():
    got = server_overrides(["+recipe=loadtest", "loadtest.requests=4", "+loadtest.url=x", "model.path=/m",
                            "hydra.run.dir=d", "hydra/launcher=joblib", "engine.max_num_seqs=8"])
    assert got == ["model.path=/m", "engine.max_num_seqs=8"]


def test_bad_settings_name_the_key():
    with pytest.raises(ConfigError, match=r"loadtest.rate"):
        load_settings({"rate": 0})
    with pytest.raises(ConfigError, match=r"loadtest.requestz"):
        load_settings({"requestz": 3})


@pytest.mark.slow
def test_loadtest_recipe_against_a_real_server(tmp_path):
    cmd = [sys.executable, "-m", "litellm_pipeline", "+recipe=loadtest", "loadtest.requests=12", "loadtest.rate=100",
           "loadtest.max_tokens=6", f"hydra.run.dir={tmp_path}/run"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "run" / "loadtest.json").read_text())
    for path in ("http", "in_process"):
        assert r[path]["completed"] == 12 and r[path]["failed"] == 0, r[path]["errors"]
        assert r[path]["output_tokens"] == 12 * 6  # ignore_eos: every request makes all its tokens
        assert r[path]["ttft_ms_p50"] > 0 and r[path]["output_tok_s"] > 0
    assert r["server_vs_in_process"] == pytest.approx(r["http"]["output_tok_s"] / r["in_process"]["output_tok_s"])
    # afterwards the server was healthy with nothing in flight and no KV block in use, and drained to exit 0
    assert r["server_after"] == {"health": 200, "kv_blocks_used": 0.0, "requests_running": 0.0,
                                 "requests_waiting": 0.0}
    assert r["server_exit_code"] == 0
    assert "server throughput / in-process throughput" in proc.stdout


@pytest.mark.slow
def test_noisy_neighbour_recipe(tmp_path):
    """Tenant b's short requests alone, under tenant a's flood, and under a flood whose clients drop their streams
    and reconnect: b is never refused, a's excess over its quota gets 429, a's dropped streams are aborted, and
    the server ends healthy with no KV block in use (the p95 ratios are measured, not asserted here)."""
    cmd = [sys.executable, "-m", "litellm_pipeline", "+recipe=loadtest", "loadtest.noisy.enabled=true",
           "loadtest.noisy.b_requests=10", "loadtest.noisy.b_rate=20", "loadtest.noisy.a_requests=60",
           "loadtest.noisy.a_rate=200", "loadtest.noisy.a_max_concurrent=2", "cache.num_blocks=24",
           f"hydra.run.dir={tmp_path}/run"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "run" / "loadtest.json").read_text())
    assert list(r["phases"]) == ["alone", "flood", "flood_disconnect"]
    for name, ph in r["phases"].items():
        assert ph["b"]["status"] == {"200": ph["b"]["sent"]} and ph["b"]["completed"] == ph["b"]["sent"], name
        assert ph["b"]["ttft_ms_p95"] > 0 and ph["settled_s"] is not None
    for name in ("flood", "flood_disconnect"):
        a = r["phases"][name]["a"]
        assert a["sent"] > 10 and a["status"].get("429", 0) > 0 and set(a["status"]) <= {"200", "429"}, a
        assert r["verdict"][f"{name}_b_never_refused"] is True
    assert r["phases"]["flood_disconnect"]["a"]["dropped"] > 0
    assert r["phases"]["flood"]["a"]["dropped"] == 0
    assert r["server_after"]["health"] == 200 and r["server_after"]["kv_blocks_used"] == 0
    assert r["server_exit_code"] == 0
    assert "b's p95 TTFT" in proc.stdout
