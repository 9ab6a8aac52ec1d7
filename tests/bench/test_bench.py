"""The bench (``+recipe=bench``): its measuring parts, and a tiny end-to-end run in a subprocess.

Speed itself is never asserted here; only that every number is there, finite and positive.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from litellm_pipeline.bench import roofline
from litellm_pipeline.bench.checkpoints import random_weights
from litellm_pipeline.bench.models import param_counts, resolve_model
from litellm_pipeline.bench.settings import bench_settings
from litellm_pipeline.bench.workload import (
    FIRST_BYTE_ID,
    LAST_BYTE_ID,
    make_workload,
    percentile,
)
from litellm_pipeline.errors import ConfigError

TINY = [
    "bench.dtypes=[float32]",
    "bench.num_requests=4",
    "bench.prompt_len=[8,16]",
    "bench.output_len=[4,8]",
    "bench.prefix_len=32",
    "bench.batch1_prompt_len=8",
    "bench.batch1_output_len=8",
    "bench.batch1_repeats=1",
    "bench.warmup=1",
    "bench.roofline.bandwidth_mb=16",
    "bench.roofline.gemm_size=128",
    "bench.roofline.repeats=2",
]


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


# --- roofline -------------------------------------------------------------------------------------------


def test_roofline_functions_return_positive_finite_numbers():
    assert _positive(roofline.read_bandwidth(mb=8, repeats=2))
    assert _positive(roofline.gemv_bandwidth(mb=8, repeats=2))
    assert _positive(roofline.gemm_flops(n=64, repeats=2))
    assert _positive(roofline.gemm_flops(n=64, repeats=2, dtype=__import__("torch").bfloat16))
    r = roofline.measure_roofline(["float32", "bfloat16"], mb=8, gemm_size=64, repeats=2)
    assert all(_positive(v) for v in r["bandwidth_gbs"].values())
    assert set(r["gemm_gflops"]) == {"float32", "bfloat16"} and all(_positive(v) for v in r["gemm_gflops"].values())
    bw = r["bandwidth_gbs"]
    assert bw["stream_mb"] >= max(4 * (roofline.last_level_cache_mb() or 0), 1024)
    assert bw["best"] == max(bw["sum"], bw["gemv_float32"], bw["stream"])


def test_the_stream_probe_reads_every_element():
    """The kernel the bandwidth probe times sums what it reads (split over the decode threads): nothing skipped."""
    import torch

    from litellm_pipeline.model import cpu_kernels

    x = torch.arange(1_000_003, dtype=torch.float32) % 977  # not a multiple of a block or of the vector width
    assert cpu_kernels.ops().stream_read(x) == float(x.double().sum())


# --- workload -------------------------------------------------------------------------------------------


def test_workload_is_deterministic_for_a_seed_and_respects_the_ranges():
    a = make_workload(50, (5, 9), (2, 4), seed=7)
    assert a == make_workload(50, (5, 9), (2, 4), seed=7)
    assert a != make_workload(50, (5, 9), (2, 4), seed=8)
    assert len(a) == 50
    assert all(5 <= len(it.prompt_ids) <= 9 and 2 <= it.output_len <= 4 for it in a)
    assert all(FIRST_BYTE_ID <= t <= LAST_BYTE_ID for it in a for t in it.prompt_ids)
    # both ends of each range are reachable (uniform, inclusive)
    assert {len(it.prompt_ids) for it in a} >= {5, 9} and {it.output_len for it in a} == {2, 3, 4}


def test_percentile_interpolates():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)


# --- models and settings --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_mixtral"])
def test_param_counts_match_the_written_weights(name):
    _, cfg = resolve_model(name)
    counts = param_counts(cfg)
    assert counts["total"] == sum(t.numel() for t in random_weights(cfg, 0).values())
    assert counts["active_per_token"] == counts["body_active"] + counts["head"]
    if cfg.get("num_local_experts"):
        assert counts["active_per_token"] < counts["total"] - counts["embedding"]  # only top-k experts


def test_preset_shapes_are_about_the_advertised_sizes():
    llama, mixtral = param_counts(resolve_model("llama125m")[1]), param_counts(resolve_model("mixtral175m")[1])
    assert 110e6 < llama["total"] < 140e6
    assert 165e6 < mixtral["total"] < 185e6 and mixtral["experts"] == 8 and mixtral["experts_per_token"] == 2


def test_model_given_as_a_dict_overrides_a_preset():
    name, cfg = resolve_model({"name": "narrow", "base": "tiny_llama", "hidden_size": 32, "head_dim": 8})
    assert name == "narrow" and cfg["hidden_size"] == 32 and cfg["num_hidden_layers"] == 2
    with pytest.raises(ConfigError, match="unknown model 'nope'.*tiny_llama"):
        resolve_model("nope")


def test_bad_bench_settings_name_the_key():
    with pytest.raises(ConfigError, match=r"bench\.num_requests: must be >= 1"):
        bench_settings({"num_requests": 0})
    with pytest.raises(ConfigError) as exc:
        bench_settings({"prompt_len": [9, 3], "models": ["tiny_llama"]})
    # one line naming the key and its value, not the whole section
    assert str(exc.value).splitlines()[1:] == ["bench.prompt_len: must be [lo, hi] with 1 <= lo <= hi (got [9, 3])"]
    with pytest.raises(ConfigError, match=r"bench\.nope: unknown key"):
        bench_settings({"nope": 1})


def test_batch1_bandwidth_fraction_uses_the_adjacent_measurement_for_the_target():
    from litellm_pipeline.bench import report

    params = {"active_per_token": 100_000_000, "body_active": 80_000_000, "head": 20_000_000}
    row = {"model": "m", "dtype": "float32", "params": params,
           "engine": {"prompt_tokens": 10, "output_tokens": 10, "elapsed_s": 1.0, "output_tok_s": 10.0},
           "batch1": {"tok_s": 50.0, "bandwidth_gbs_adjacent": 25.0}, "prefix": {"speedup": 6.0}}
    report.derive(row, {"bandwidth_gbs": {"best": 40.0}, "gemm_gflops": {"float32": 100.0}})
    # 50 tok/s x 400 MB = 20 GB/s: half of the run's 40 GB/s roofline, 80% of the 25 GB/s measured alongside
    assert row["roofline"]["batch1_bandwidth_pct"] == pytest.approx(50.0)
    assert row["roofline"]["batch1_bandwidth_pct_adjacent"] == pytest.approx(80.0)
    (line,) = report.target_lines([row])
    assert "batch1_bandwidth_pct 80.00 (>= 70: ok)" in line and "prefix_speedup 6.00 (>= 5: ok)" in line
    row["batch1"]["bandwidth_gbs_adjacent"] = None  # no probe: the run's roofline decides
    report.derive(row, {"bandwidth_gbs": {"best": 40.0}, "gemm_gflops": {"float32": 100.0}})
    assert "batch1_bandwidth_pct 50.00 (>= 70: MISSED by 29%)" in report.target_lines([row])[0]


def test_batch1_rounds_interleave_engines_and_keep_each_ones_best_and_adjacent_probe():
    """Every round runs every engine once, the order rotated; each engine keeps its best run and the best probe
    taken right before or after one of its runs; a fallible engine that fails leaves the rounds with its error,
    any other failure propagates."""
    from litellm_pipeline.bench.engine_runs import batch1_rounds

    calls: list[str] = []
    times = {"a": iter([0.30, 0.10, 0.20]), "b": iter([0.05, 0.50, 0.40]), "c": iter([0.2, 0.2])}

    def run(name):
        def go():
            calls.append(name)
            if name == "c" and calls.count("c") == 2:
                raise RuntimeError("peer went away")
            return next(times[name])
        return go

    probes = iter(range(1, 100))
    got = batch1_rounds({n: run(n) for n in "abc"}, 3, probe=lambda: float(next(probes)), fallible={"c"})
    assert calls == ["a", "b", "c", "b", "c", "a", "a", "b"]  # c failed in round 2: it leaves the rounds
    assert got["a"]["tpot_ms"] == pytest.approx(100.0) and got["a"]["tok_s"] == pytest.approx(10.0)
    assert got["b"]["tpot_ms"] == pytest.approx(50.0)
    assert got["c"] == {"error": "RuntimeError: peer went away"}
    # probes: 1 before the first run, then one after every run that finished (c's failure took none):
    # a ran between probes 1-2, 5-6 and 6-7; b between 2-3, 4-5 and 7-8
    assert got["a"]["bandwidth_gbs_adjacent"] == 7.0 and got["b"]["bandwidth_gbs_adjacent"] == 8.0
    with pytest.raises(RuntimeError, match="peer went away"):
        calls.clear()
        batch1_rounds({"a": lambda: 0.1, "c": run("c")}, 3)
    assert batch1_rounds({"a": lambda: 0.25}, 2) == {"a": {"tpot_ms": 250.0, "tok_s": 4.0,
                                                          "bandwidth_gbs_adjacent": None}}


def test_cpu_monitor_counts_the_processes_the_bench_started_as_its_own():
    """A peer process still running when a phase closes (the llama.cpp peers between the engine's batch-1 runs) is
    the bench's own load, not another process's: a busy machine would be flagged otherwise."""
    from litellm_pipeline.bench.machine import CpuMonitor

    def cpu_s(pid):  # utime + stime of one process, from /proc
        with open(f"/proc/{pid}/stat") as f:
            return sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13]) / os.sysconf("SC_CLK_TCK")

    mon = CpuMonitor()
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 30: pass"])
    try:
        deadline = time.monotonic() + 20
        while cpu_s(child.pid) < 0.5 and time.monotonic() < deadline:  # however busy the machine is
            time.sleep(0.05)
        phase = mon.mark("child spinning")
        spun = cpu_s(child.pid)
    finally:
        child.kill()
        child.wait()
    assert spun >= 0.5
    # what the child spun is counted as the bench's own (this process itself only slept)
    assert phase["own_cores"] * phase["wall_s"] >= 0.9 * spun, (phase, spun)


def test_int8_bytes_per_token_equal_the_quantized_model(tmp_path):
    """The int8 roofline counts what the cpu_int8 model holds: int8 projections (and head) plus float32 scales,
    the rest in the activation dtype; float precisions count every active weight at their width."""
    from litellm_pipeline.bench import report
    from litellm_pipeline.bench.checkpoints import write_random_checkpoint
    from litellm_pipeline.llm import LLM

    _, cfg = resolve_model("tiny_llama")
    params = param_counts(cfg)
    path = write_random_checkpoint(tmp_path / "ckpt", cfg, 0)
    for head in (True, False):
        llm = LLM(model=str(path), overrides=["device.threads=1", "pipeline.stages.decode.params.layer_ops=cpu_int8",
                                               f"pipeline.stages.decode.params.layer_ops_params={{lm_head: {str(head).lower()}}}"])
        model = llm.engine.rt.model
        held = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n != "embed_tokens")
        scales = sum(t.numel() * t.element_size() for m in model.modules() for t in m.__dict__.get("int8_scales", {}).values())
        assert (model.lm_head.dtype == torch.int8) is head
        assert report.weight_bytes_per_token(params, "int8", "float32", head) == held + scales
    assert report.weight_bytes_per_token(params, "bfloat16") == 2 * params["active_per_token"]
    assert report.weight_bytes_per_token(params, "float32") == 4 * params["active_per_token"]
    for head, group in ((True, 32), (False, 64)):  # int4: two codes a byte plus a float16 scale per group
        llm = LLM(model=str(path), overrides=[
            "device.threads=1", "pipeline.stages.decode.params.layer_ops=cpu_int4",
            f"pipeline.stages.decode.params.layer_ops_params={{lm_head: {str(head).lower()}, group_size: {group}}}"])
        model = llm.engine.rt.model
        held = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n != "embed_tokens")
        scales = sum(g.scale.numel() * g.scale.element_size() for m in model.modules()
                     for g in m.__dict__.get("int4_groups", {}).values())
        assert (model.lm_head.dtype == torch.uint8) is head
        assert report.weight_bytes_per_token(params, "int4", "float32", head, group) == held + scales


def test_precision_table_compares_each_precision_with_float32():
    from litellm_pipeline.bench import report

    def row(dtype, mixed, b1, **extra):
        return {"model": "m", "dtype": dtype, "engine": {"output_tok_s": mixed}, "batch1": {"tok_s": b1},
                "roofline": {"weight_bytes_per_token": 2**20, "batch1_bandwidth_pct": 50.0}, **extra}

    rows = [row("float32", 10.0, 20.0), row("bfloat16", 15.0, 30.0),
            row("int8", 12.0, 50.0, compute_dtype="float32", int8_lm_head=True)]
    table = "\n".join(report.precision_table(rows))
    lines = table.splitlines()
    assert "precisions side by side" in table
    bf16 = next(line for line in lines if " bfloat16 " in line)
    assert bf16.split()[3:7] == ["15.0", "1.50", "30.0", "1.50"]
    int8 = next(line for line in lines if "int8 (float32 act, int8 head)" in line)
    assert "2.50" in int8.split() and "1.20" in int8.split()
    assert report.precision_table(rows[:1]) == []  # one precision: nothing to compare


def test_peer_is_reported_unavailable_without_transformers(monkeypatch, tmp_path):
    from litellm_pipeline.bench import peer

    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as if not installed
    model, why = peer.load_peer(tmp_path, "float32")
    assert model is None and "not installed" in why


# --- end to end -----------------------------------------------------------------------------------------


def run_bench_cli(tmp_path, *overrides: str) -> dict:
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "litellm_pipeline", "+recipe=bench", *overrides, f"hydra.run.dir={run}"]
    env = {**os.environ, "LITELLM_PIPELINE_CACHE": str(tmp_path.parent / "bench-cache")}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "engine tok/s" in proc.stdout and "%BW" in proc.stdout  # the tables were printed
    data = json.loads((run / "bench.json").read_text())
    data["_stdout"] = proc.stdout
    return data


def _check_common(data: dict, model: str) -> dict:
    m = data["machine"]
    assert m["torch_threads"] >= 1 and len(m["loadavg_start"]) == 3 and len(m["loadavg_end"]) == 3
    assert isinstance(data["busy"], bool) and data["phases"][0]["phase"] == "idle check"
    assert data["complete"] is True
    assert _positive(data["roofline"]["bandwidth_gbs"]["best"]) and _positive(data["roofline"]["gemm_gflops"]["float32"])
    assert _positive(data["models"][model]["total"]) and _positive(data["elapsed_s"])
    (row,) = data["results"]
    assert row["model"] == model and row["dtype"] == "float32" and isinstance(row["busy"], bool)
    eng = row["engine"]
    assert eng["requests"] == 4 and 4 * 4 <= eng["output_tokens"] <= 4 * 8
    for key in ("output_tok_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "elapsed_s"):
        assert _positive(eng[key]), key
    assert eng["ttft_ms_p50"] <= eng["ttft_ms_p99"]
    assert _positive(row["batch1"]["tok_s"]) and _positive(row["batch1"]["bandwidth_gbs_adjacent"])
    for key in ("bandwidth_tok_s", "batch1_bandwidth_pct", "batch1_bandwidth_pct_adjacent", "flop_tok_s",
                "workload_flop_pct"):
        assert _positive(row["roofline"][key]), key
    for key in ("ttft_ms_hit", "ttft_ms_cold", "speedup"):
        assert _positive(row["prefix"][key]), key
    return row


@pytest.mark.slow
def test_tiny_bench_end_to_end_with_transformers(tmp_path):
    pytest.importorskip("transformers")
    data = run_bench_cli(tmp_path, "bench.models=[tiny_llama]", *TINY)
    row = _check_common(data, "tiny_llama")
    for part in ("peer_batched", "peer_single"):
        assert row[part]["output_tokens"] == row["engine"]["output_tokens"]  # useful tokens only
        assert _positive(row[part]["output_tok_s"])
    assert row["peer_batched"]["generated_tokens"] >= row["peer_batched"]["output_tokens"]
    assert _positive(row["peer_single"]["ttft_ms_p50"]) and _positive(row["peer_batch1"]["tok_s"])
    for key in ("throughput_vs_peer_batched", "throughput_vs_peer_single", "batch1_vs_peer"):
        assert _positive(row["ratios"][key]), key
    assert "issue-3 targets" in data["_stdout"]


@pytest.mark.slow
def test_tiny_bench_without_the_peer_has_no_peer_columns(tmp_path):
    data = run_bench_cli(tmp_path, "bench.models=[tiny_mixtral]", "bench.peer=false", "bench.deterministic=true",
                         "bench.offload=[1,4]", *TINY)
    row = _check_common(data, "tiny_mixtral")
    assert row["peer_batched"] is None and row["peer_single"] is None and row["peer_batch1"] is None
    assert all(v is None for v in row["ratios"].values())
    assert data["models"]["tiny_mixtral"]["experts"] == 4
    det = row["deterministic"]  # the batch-invariant mode on the same workload, and its cost
    assert det["engine"]["output_tokens"] == row["engine"]["output_tokens"] and _positive(det["batch1"]["tok_s"])
    assert det["cost_pct_mixed"] == pytest.approx(100 * (1 - det["engine"]["output_tok_s"] / row["engine"]["output_tok_s"]))
    assert "batch-invariant mode" in data["_stdout"]
    one, every = row["offload"]  # expert offload: 1 of 4 experts resident misses, all 4 never do
    assert one["hot_experts"] == 1 and one["misses"] > 0 and one["hit_rate"] < 1 and one["miss_cost_ms"] is not None
    assert every["misses"] == 0 and every["hit_rate"] == 1 and every["miss_cost_ms"] is None
    assert every["device_expert_mb"] == pytest.approx(4 * one["device_expert_mb"])
    assert "expert offload (moe.hot_experts)" in data["_stdout"]


def test_a_precision_names_its_kv_cache_where_cache_dtype_made_it_another():
    from litellm_pipeline.bench.report import _precision_name

    assert _precision_name({"dtype": "float32", "kv_cache_dtype": "float32"}) == "float32"
    assert _precision_name({"dtype": "float32", "kv_cache_dtype": "float16"}) == "float32 (float16 KV)"
    assert _precision_name({"dtype": "bfloat16", "kv_cache_dtype": "bfloat16"}) == "bfloat16"
    int4 = {"dtype": "int4", "compute_dtype": "float32", "int4_lm_head": True, "kv_cache_dtype": "float16"}
    assert _precision_name(int4) == "int4 (group 32, float32 act, int8 dot, int4 head, float16 KV)"
    assert _precision_name({"dtype": "int8", "compute_dtype": "bfloat16",
                            "kv_cache_dtype": "bfloat16"}) == "int8 (bfloat16 act)"


@pytest.mark.slow
def test_tiny_bench_int8_and_int4_precisions_beside_float32(tmp_path):
    tiny = [o for o in TINY if not o.startswith("bench.dtypes=")]
    data = run_bench_cli(tmp_path, "bench.models=[tiny_llama]", "bench.dtypes=[float32,int8,int4]", *tiny)
    fp, q8, q4 = data["results"]
    assert (fp["dtype"], q8["dtype"], q4["dtype"]) == ("float32", "int8", "int4")
    assert (q4["int4_lm_head"], q4["int4_group_size"], q4["int4_dot"]) == (True, 32, "int8")
    assert q4["engine"]["output_tokens"] == fp["engine"]["output_tokens"] and _positive(q4["batch1"]["tok_s"])
    assert q4["peer_batched"] is None  # no int4 peer in transformers
    ratio4 = q4["roofline"]["weight_bytes_per_token"] / fp["roofline"]["weight_bytes_per_token"]
    assert 0.14 < ratio4 < 0.2  # (0.5 + 2 / 32) / 4 of the quantized weights, norms in float32
    assert "int4 (group 32, float32 act, int8 dot, int4 head)" in data["_stdout"]
    assert fp["kv_cache_dtype"] == q8["kv_cache_dtype"] == q4["kv_cache_dtype"] == "float32"  # cache.dtype: null
    assert data["machine"]["int4_kernel"] in ("avx512", "avx2", "scalar")
    assert q8["compute_dtype"] == "float32" and q8["int8_lm_head"] is True
    assert q8["engine"]["output_tokens"] == fp["engine"]["output_tokens"] and _positive(q8["batch1"]["tok_s"])
    assert fp["peer_batched"] is not None or fp.get("peer_error")  # the float row keeps its peer
    assert q8["peer_batched"] is None and q8["peer_batch1"] is None  # no int8 peer: not compared
    # int8 reads about a quarter of float32's bytes (tiny_llama: norms and scales keep it above a quarter)
    ratio = q8["roofline"]["weight_bytes_per_token"] / fp["roofline"]["weight_bytes_per_token"]
    assert 0.25 < ratio < 0.3
    assert "precisions side by side" in data["_stdout"] and "int8 (float32 act, int8 head)" in data["_stdout"]


@pytest.mark.slow
def test_tiny_bench_with_the_llamacpp_peer_runs_it_or_says_why_not(tmp_path):
    """Without llama-cpp-python (the CI machine) the run completes and names what is missing; with it, the peer's
    numbers and ratios are in the row and the table."""
    tiny = [o for o in TINY if not o.startswith("bench.dtypes=")]
    data = run_bench_cli(tmp_path, "bench.models=[tiny_llama]", "bench.dtypes=[int8]", "bench.peer=false",
                         "bench.llamacpp=true", *tiny)
    (row,) = data["results"]
    if row["llamacpp"] is None:
        assert "not installed" in row["llamacpp_error"] and row["llamacpp_error"] in data["_stdout"]
        assert row["batch1"]["rounds_with"] == [] == row["engine"]["rounds_with"] and _positive(row["batch1"]["tok_s"])
    else:
        lc = row["llamacpp"]
        assert lc["format"] == "Q8_0" and lc["requests"] == 4 and lc["output_tokens"] == row["engine"]["output_tokens"]
        assert _positive(lc["batch1_tok_s"]) and _positive(lc["output_tok_s"])
        assert row["batch1"]["rounds_with"] == ["llama.cpp"] and _positive(lc["batch1_bandwidth_gbs_adjacent"])
        assert "llama.cpp on the same checkpoint as GGUF" in data["_stdout"] and "llama-cpp-python" in data["_stdout"]


def test_unknown_bench_key_fails_before_any_work(tmp_path):
    cmd = [sys.executable, "-m", "litellm_pipeline", "+recipe=bench", "+bench.nope=1", f"hydra.run.dir={tmp_path}/run"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "bench.nope: unknown key" in proc.stderr
    assert not (tmp_path / "run" / "bench.json").exists()


# --- the llama.cpp peer ---------------------------------------------------------------------------------


def test_llamacpp_peer_is_reported_unavailable_without_its_packages(monkeypatch):
    from litellm_pipeline.bench import llamacpp

    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    why = llamacpp.unavailable()
    assert why and "llama-cpp-python is not installed" in why


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_mixtral"])
@pytest.mark.parametrize("precision", ["float32", "float16", "int8", "int4"])
def test_gguf_written_for_the_llamacpp_peer_holds_the_checkpoint(tmp_path, name, precision):
    """Read back with gguf's own reader: llama.cpp's tensor names and shapes, the format of the precision, the
    values (Q8_0 within half a block step), Q/K rows in llama.cpp's rotary order, stacked Mixtral experts."""
    gguf = pytest.importorskip("gguf")
    import numpy as np
    from safetensors.torch import load_file

    from litellm_pipeline.bench import llamacpp
    from litellm_pipeline.bench.checkpoints import write_random_checkpoint

    _, cfg = resolve_model(name)
    ckpt = write_random_checkpoint(tmp_path / name, cfg, 0)
    out = llamacpp.write_gguf(ckpt, tmp_path / "m.gguf", precision)
    reader = gguf.GGUFReader(str(out))
    tensors = {t.name: t for t in reader.tensors}
    sd = load_file(str(ckpt / "model.safetensors"))
    layers, experts = cfg["num_hidden_layers"], cfg.get("num_local_experts", 0)
    per_layer = 9 + (1 if experts else 0)  # 2 norms, q k v o, gate/up/down (dense) or the router and 3 stacks (MoE)
    assert len(tensors) == 3 + layers * per_layer
    want = {"float32": "F32", "float16": "F16", "int8": "Q8_0", "int4": "Q4_0"}[precision]

    def values(t) -> np.ndarray:
        return gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])

    def close(a: np.ndarray, b: torch.Tensor) -> None:
        b = b.float().numpy()
        assert a.shape == b.shape
        tol = {"float32": 0.0, "float16": 1e-3 * np.abs(b).max(), "int8": np.abs(b).max() / 127,
               "int4": np.abs(b).max() / 7}[precision]
        assert np.abs(a - b).max() <= tol + 1e-7

    assert tensors["output_norm.weight"].tensor_type.name == "F32"
    for key, ours in (("token_embd.weight", "model.embed_tokens.weight"), ("output.weight", "lm_head.weight"),
                      ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight")):
        assert tensors[key].tensor_type.name == want
        close(values(tensors[key]), sd[ours])
    q = values(tensors["blk.1.attn_q.weight"])  # llama.cpp's pair order: rows (head, pair, half) of HF's
    nh, hd = cfg["num_attention_heads"], cfg["head_dim"]
    hf_q = sd["model.layers.1.self_attn.q_proj.weight"].reshape(nh, 2, hd // 2, -1).transpose(1, 2).reshape(nh * hd, -1)
    close(q, hf_q)
    if experts:
        up = values(tensors["blk.0.ffn_up_exps.weight"])
        assert up.shape[0] == experts
        close(up[1], sd["model.layers.0.block_sparse_moe.experts.1.w3.weight"])
        assert reader.fields["llama.expert_count"].parts[-1][0] == experts
    else:
        close(values(tensors["blk.0.ffn_down.weight"]), sd["model.layers.0.mlp.down_proj.weight"])


# --- the llama-server peer (a stand-in binary speaking its HTTP API: the real one is never built here) -------

FAKE_SERVER = r"""#!{python}
# llama-server's /health and /completion for the bench's peer; records its argv and the most requests in flight
import json, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
argv = sys.argv[1:]
opt = lambda k: argv[argv.index(k) + 1]
mode = {mode!r}
if mode == "exit":
    print("error: failed to load model", flush=True)
    sys.exit(3)
slots = threading.Semaphore(int(opt("-np")))
lock = threading.Lock()
state = {{"now": 0, "max": 0, "requests": []}}
def record():
    with open({log!r}, "w") as f:
        json.dump({{"argv": argv, "max_in_flight": state["max"], "requests": state["requests"]}}, f)
class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _send(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self._send(200 if self.path == "/health" else 404, {{"status": "ok"}})
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ok = (self.path == "/completion" and all(isinstance(t, int) for t in req["prompt"])
              and req["ignore_eos"] is True and req["temperature"] == 0)
        if not ok:
            return self._send(400, {{"error": "bad request"}})
        with slots:
            with lock:
                state["now"] += 1
                state["max"] = max(state["max"], state["now"])
                state["requests"].append([len(req["prompt"]), req["n_predict"]])
            time.sleep(0.3)
            with lock:
                state["now"] -= 1
                record()
        n = req["n_predict"] - (1 if mode == "short" else 0)
        self._send(200, {{"content": "", "tokens_predicted": n, "timings": {{"predicted_n": n, "predicted_ms": 2.0 * (n - 1)}}}})
ThreadingHTTPServer(("127.0.0.1", int(opt("--port"))), H).serve_forever()
"""


def _fake_server(tmp_path, mode: str = "ok"):
    path = tmp_path / f"llama-server-{mode}"
    log = tmp_path / f"fake-{mode}.json"
    path.write_text(FAKE_SERVER.format(python=sys.executable, mode=mode, log=str(log)))
    path.chmod(0o755)
    return path, log


@pytest.mark.slow
def test_tiny_bench_with_the_llamacpp_server_peer(tmp_path):
    """The mixed load goes to llama-server all at once (as many in flight as it has slots), token-id prompts of the
    workload's lengths, its tokens counted; batch-1 from its own timing; the table compares both."""
    pytest.importorskip("gguf")
    fake, log = _fake_server(tmp_path)
    tiny = [o for o in TINY if not o.startswith("bench.dtypes=")]
    tiny = [o for o in tiny if not o.startswith("bench.batch1_")]
    data = run_bench_cli(tmp_path, "bench.models=[tiny_llama]", "bench.dtypes=[float32]", "bench.peer=false",
                         f"bench.llamacpp_server={fake}", "bench.llamacpp_server_slots=3", "bench.batch1_repeats=2",
                         "bench.batch1_prompt_len=9", "bench.batch1_output_len=5", *tiny)
    (row,) = data["results"]
    sv = row["llamacpp_server"]
    assert sv is not None, row.get("llamacpp_server_error")
    items = make_workload(4, (8, 16), (4, 8), 0)
    assert sv["format"] == "F32" and sv["slots"] == 3 and sv["requests"] == 4
    assert sv["output_tokens"] == row["engine"]["output_tokens"] == sum(it.output_len for it in items)
    # the stand-in's timing, like llama-server's: 2 ms per decode step, from the first token to the last
    assert sv["batch1_tok_s"] == pytest.approx(500.0)
    # the mixed load right after the engine's, batch-1 in rounds with the engine's, a bandwidth probe next to each run
    assert row["engine"]["rounds_with"] == ["llama-server"] and row["batch1"]["rounds_with"] == ["llama-server"]
    assert row["engine"]["prefix_hit_tokens"] == 0  # the workload ran once: no prompt was in the cache
    assert _positive(sv["batch1_bandwidth_gbs_adjacent"]) and _positive(row["batch1"]["bandwidth_gbs_adjacent"])
    seen = json.loads(log.read_text())
    argv = seen["argv"]
    assert argv[argv.index("-np") + 1] == "3" and argv[argv.index("-m") + 1].endswith("-F32.gguf")
    assert seen["max_in_flight"] == 3  # all sent at once, capped by the server's slots
    want = sorted([len(it.prompt_ids), it.output_len] for it in items)
    # after the warm-up: the workload, then the two batch-1 runs
    assert len(seen["requests"]) == 1 + 4 + 2
    assert sorted(seen["requests"][1:5]) == want and seen["requests"][5:] == [[9, 5], [9, 5]]
    assert "srv mixed" in data["_stdout"] and "llama-server with 3 slots" in data["_stdout"]


def test_llamacpp_server_peer_failures_are_named(tmp_path):
    """A missing binary, a server that exits at start-up and one that answers short are each a clear error."""
    pytest.importorskip("gguf")
    from litellm_pipeline.bench import llamacpp
    from litellm_pipeline.bench.checkpoints import write_random_checkpoint
    from litellm_pipeline.bench.workload import batch1_item

    why = llamacpp.server_unavailable(str(tmp_path / "no-such-llama-server"))
    assert why and "no-such-llama-server" in why and "neither an executable" in why
    _, cfg = resolve_model("tiny_llama")
    ckpt = write_random_checkpoint(tmp_path / "tiny_llama", cfg, 0)
    items, b1 = make_workload(2, (8, 16), (4, 8), 0), batch1_item(8, 4, 0)
    dead, _ = _fake_server(tmp_path, "exit")
    with pytest.raises(RuntimeError, match="exited with code 3: error: failed to load model"):
        llamacpp.measure_server(str(dead), ckpt, "float32", items, b1, 1, 1, 2, tmp_path)
    short, _ = _fake_server(tmp_path, "short")
    with pytest.raises(RuntimeError, match="produced .* tokens, the workload asks for"):
        llamacpp.measure_server(str(short), ckpt, "float32", items, b1, 1, 1, 2, tmp_path)


@pytest.mark.slow
def test_tiny_bench_structured_output_section(tmp_path):
    data = run_bench_cli(tmp_path, "bench.models=[tiny_llama]", "bench.peer=false", "bench.structured=true",
                         "bench.structured_batches=[1,3]", "bench.structured_rounds=2", *TINY)
    row = _check_common(data, "tiny_llama")
    st = row["structured"]
    assert st["vocab_type"] == "byte_level" and 259 < st["vocab_size"] <= 512  # a BPE vocabulary trained here
    assert _positive(st["compile_cold_ms"]) and _positive(st["compile_hit_us"]) and _positive(st["setup_ms"])
    assert [r["batch"] for r in st["rows"]] == [1, 3]
    for r in st["rows"]:
        # the JSON schema's four records take more than one token each; both runs generated these same tokens
        assert r["tokens"] > 20 * r["batch"] and _positive(r["free_tok_s"]) and _positive(r["json_tok_s"])
        assert r["overhead_pct"] == pytest.approx(100 * (r["free_tok_s"] / r["json_tok_s"] - 1))
        assert _positive(r["mask_us_per_step"]) and r["mask_us_per_row"] == pytest.approx(
            r["mask_us_per_step"] / r["batch"])
    assert "structured output: the same requests under a JSON schema" in data["_stdout"]
