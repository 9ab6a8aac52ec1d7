"""Derived numbers (ratios, roofline fractions, targets), the printed tables and the JSON file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# issue 3's targets on a 2-core CPU, float32
TARGETS = {"throughput_vs_peer_batched": 3.0, "batch1_vs_peer": 1.2, "batch1_bandwidth_pct": 70.0, "prefix_speedup": 5.0}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def weight_bytes_per_token(params: dict, precision: str, compute_dtype: str | None = None,
                           int8_lm_head: bool = False, int4_group_size: int = 32) -> float:
    """Bytes of weights one decode token reads. int8: the projections at one byte per weight plus a float32
    scale per output row; int4: half a byte per weight plus a 16-bit scale per group; the rest (norms, router, the
    LM head unless quantized: ``int8_lm_head`` for either) in the activation dtype."""
    if precision not in ("int8", "int4"):
        return params["active_per_token"] * DTYPE_BYTES[precision]
    act = DTYPE_BYTES[compute_dtype or "float32"]
    if precision == "int8":
        proj = params["proj_active"] + 4 * params["proj_rows_active"]
        head = params["head"] + 4 * params["head_rows"]
    else:
        proj = params["proj_active"] * (0.5 + 2 / int4_group_size)
        head = params["head"] * (0.5 + 2 / int4_group_size)
    rest = (params["body_active"] - params["proj_active"]) * act
    return proj + rest + (head if int8_lm_head else params["head"] * act)


def derive(row: dict, roofline: dict) -> None:
    """Add ``ratios`` and ``roofline`` to one model x dtype result (in place)."""
    params, dtype, eng = row["params"], row["dtype"], row["engine"]
    compute = row.get("compute_dtype") or dtype
    head_quantized = bool(row.get("int8_lm_head") or row.get("int4_lm_head"))
    weight_bytes = weight_bytes_per_token(params, dtype, compute, head_quantized, row.get("int4_group_size") or 32)
    bw = roofline["bandwidth_gbs"]["best"] * 1e9
    peak = roofline["gemm_gflops"].get(compute, 0.0) * 1e9
    # model FLOPs of the workload: every prompt and output token runs the active body; only sampled
    # positions run the head (attention's own FLOPs are left out, so this slightly understates the work)
    flops = 2 * (params["body_active"] * (eng["prompt_tokens"] + eng["output_tokens"]) + params["head"] * eng["output_tokens"])
    achieved = flops / eng["elapsed_s"]
    b1 = row["batch1"]["tok_s"]
    adj = row["batch1"].get("bandwidth_gbs_adjacent")
    row["roofline"] = {
        "weight_bytes_per_token": weight_bytes,
        "bandwidth_tok_s": bw / weight_bytes,
        "batch1_bandwidth_pct": 100.0 * b1 * weight_bytes / bw,
        # against the bandwidth measured right before and after the batch-1 runs (same machine state)
        "batch1_bandwidth_pct_adjacent": 100.0 * b1 * weight_bytes / (adj * 1e9) if adj else None,
        "flop_tok_s": peak / (2 * params["active_per_token"]) if peak else None,
        "workload_gflops": achieved / 1e9,
        "workload_flop_pct": 100.0 * achieved / peak if peak else None,
    }
    pb, ps, p1 = row.get("peer_batched"), row.get("peer_single"), row.get("peer_batch1")
    det = row.get("deterministic")
    if det:  # cost of the batch-invariant mode: the share of throughput it gives up
        det["cost_pct_mixed"] = 100.0 * (1 - det["engine"]["output_tok_s"] / eng["output_tok_s"])
        det["cost_pct_batch1"] = 100.0 * (1 - det["batch1"]["tok_s"] / b1)
    row["ratios"] = {
        "throughput_vs_peer_batched": _ratio(eng["output_tok_s"], pb and pb["output_tok_s"]),
        "throughput_vs_peer_single": _ratio(eng["output_tok_s"], ps and ps["output_tok_s"]),
        "batch1_vs_peer": _ratio(b1, p1 and p1["tok_s"]),
    }


def target_lines(rows: list[dict]) -> list[str]:
    """One line per float32 row: each issue-3 target, met or missed and by how much."""
    lines = []
    for row in rows:
        if row["dtype"] != "float32":
            continue
        roof = row["roofline"]
        pct = roof.get("batch1_bandwidth_pct_adjacent") or roof["batch1_bandwidth_pct"]
        got = {**row["ratios"], "batch1_bandwidth_pct": pct,
               "prefix_speedup": (row.get("prefix") or {}).get("speedup")}
        parts = []
        for key, want in TARGETS.items():
            v = got.get(key)
            if v is None:
                parts.append(f"{key} n/a")
            else:
                verdict = "ok" if v >= want else f"MISSED by {100 * (1 - v / want):.0f}%"
                parts.append(f"{key} {v:.2f} (>= {want:g}: {verdict})")
        lines.append(f"  {row['model']} float32: " + "; ".join(parts))
    return lines


def _f(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def _pair(a: Any, b: Any, spec: str = ".1f") -> str:
    return "-" if a is None else f"{_f(a, spec)}/{_f(b, spec)}"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = lambda cells: "  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([fmt(headers), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)])


def _single_caption(rows: list[dict]) -> str:
    n = next((r["peer_single"]["requests"] for r in rows if r.get("peer_single")), None)
    return "not run" if n is None else f"one at a time over the first {n} requests, TTFT = a 1-token generate"


def _native(flag) -> str:
    if flag is None:
        return "unknown"
    return "native" if flag else "emulated (many-row GEMMs widened to float32)"


def _precision_name(r: dict) -> str:
    """The row's precision, with its KV cache's dtype where ``cache.dtype`` made it other than the activations'."""
    act = r.get("compute_dtype") or ("float32" if r["dtype"] in ("int8", "int4") else r["dtype"])
    kv = r.get("kv_cache_dtype")
    cache = f", {kv} KV" if kv and kv != act else ""
    if r["dtype"] == "int4":
        return (f"int4 (group {r.get('int4_group_size') or 32}, {act} act, "
                f"{r.get('int4_dot') or 'int8'} dot{', int4 head' if r.get('int4_lm_head') else ''}{cache})")
    if r["dtype"] != "int8":
        return r["dtype"] + (f" ({kv} KV)" if cache else "")
    dot = ", int8 GEMM" if r.get("int8_dot") == "int8" else ""
    return f"int8 ({act} act{dot}{', int8 head' if r.get('int8_lm_head') else ''}{cache})"


def precision_table(rows: list[dict], label=lambda r: r["model"]) -> list[str]:
    """Per model, its precisions side by side against its float32 row (when measured in the same run): which
    precision to pick on this machine. Empty when no model has more than one precision."""
    by_model: dict[str, list[dict]] = {}
    for r in rows:
        by_model.setdefault(r["model"], []).append(r)
    if not any(len(rs) > 1 for rs in by_model.values()):
        return []
    t = []
    for rs in by_model.values():
        ref = next((r for r in rs if r["dtype"] == "float32"), None)
        for r in rs:
            mixed, b1 = r["engine"]["output_tok_s"], r["batch1"]["tok_s"]
            roof = r["roofline"]
            t.append([label(r), _precision_name(r), _f(roof["weight_bytes_per_token"] / 2**20),
                      _f(mixed), _f(_ratio(mixed, ref and ref["engine"]["output_tok_s"]), ".2f"),
                      _f(b1), _f(_ratio(b1, ref and ref["batch1"]["tok_s"]), ".2f"),
                      _f(roof.get("batch1_bandwidth_pct_adjacent") or roof["batch1_bandwidth_pct"])])
    return ["", "precisions side by side (x fp32: against the same model's float32 row of this run; %BW: batch-1 "
            "bytes read per second vs the adjacent bandwidth)", _table(
                ["model", "precision", "MB/token", "mixed tok/s", "x fp32", "b1 tok/s", "x fp32", "%BW"], t)]


# issue 15's goals against llama.cpp's closest format, same run: batch-1 and the mixed load
LLAMACPP_GOALS = {"batch1": 1.0, "mixed": 1.3}


def llamacpp_table(rows: list[dict], label=lambda r: r["model"]) -> list[str]:
    """The engine against llama.cpp on the same checkpoint and precision (rows that measured it): llama-cpp-python
    for batch-1 and the mixed load one request at a time, llama-server for the mixed load with continuous batching.
    The goals compare batch-1 with llama-cpp-python's (else the server's) and the mixed load with the server's
    (else one at a time)."""
    got = [r for r in rows if r.get("llamacpp") or r.get("llamacpp_server")]
    if not got:
        return []
    t = []
    for r in got:
        lc, sv = r.get("llamacpp") or {}, r.get("llamacpp_server") or {}
        b1, mixed = r["batch1"]["tok_s"], r["engine"]["output_tok_s"]
        xb, xm1 = _ratio(b1, lc.get("batch1_tok_s")), _ratio(mixed, lc.get("output_tok_s"))
        xbs, xms = _ratio(b1, sv.get("batch1_tok_s")), _ratio(mixed, sv.get("output_tok_s"))
        goal = {"batch1": xb if xb is not None else xbs, "mixed": xms if xms is not None else xm1}
        verdict = "; ".join(f"{k} {'ok' if v is not None and v >= LLAMACPP_GOALS[k] else 'MISSED'}"
                            for k, v in goal.items())
        t.append([label(r), _precision_name(r), lc.get("format") or sv.get("format"), _f(b1),
                  _f(lc.get("batch1_tok_s")), _f(xb, ".2f"), _f(sv.get("batch1_tok_s")), _f(xbs, ".2f"), _f(mixed),
                  _f(lc.get("output_tok_s")), _f(xm1, ".2f"), _f(sv.get("output_tok_s")), _f(xms, ".2f"), verdict])
    version = next((r["llamacpp"].get("version") for r in got if r.get("llamacpp")), None)
    slots = next((r["llamacpp_server"]["slots"] for r in got if r.get("llamacpp_server")), None)
    what = []
    if version:
        what.append(f"llama-cpp-python {version} (b1; 1by1: the mixed load one request at a time, it has no "
                    "continuous batching)")
    if slots:
        what.append(f"llama-server with {slots} slots and continuous batching (srv: the mixed load all at once "
                    "over HTTP; its b1: one request alone)")
    if any(r["batch1"].get("rounds_with") for r in got):
        what.append("batch-1 runs of the engine and the peers interleaved in rounds, best of each")
    return ["", f"llama.cpp on the same checkpoint as GGUF, same threads: {'; '.join(what)}; goals: batch-1 >= "
            f"{LLAMACPP_GOALS['batch1']}x, mixed >= {LLAMACPP_GOALS['mixed']}x (against srv where measured)",
            _table(["model", "precision", "gguf", "b1 tok/s", "llama.cpp b1", "x", "srv b1", "x", "mixed tok/s",
                    "llama.cpp 1by1", "x", "srv mixed", "x", "goals"], t)]


def parallel_table(par: list[dict] | None) -> list[str]:
    """One process against 2 ranks per bench model (bench.parallel)."""
    if not par:
        return []
    out = []
    for m in par:
        out += ["", f"parallel on {m['model']} (random weights, float32, {m['requests']} requests of "
                    f"{m['prompt_len']} + {m['output_len']} tokens; ranks share this machine's cores); x = vs 1 rank",
                f"{'split':<9} {'batch':>5} {'tok/s':>9} {'x':>5} {'collective ms/step':>19} {'calls/step':>10} "
                f"{'same':>4}"]
        base = {r["batch"]: r["tok_s"] for r in m["rows"] if r["split"] == "1 rank"}
        for r in m["rows"]:
            out.append(f"{r['split']:<9} {r['batch']:>5} {r['tok_s']:>9.1f} {r['tok_s'] / base[r['batch']]:>5.2f} "
                       f"{r['collective_ms_per_step']:>19.3f} {r['collectives_per_step']:>10.1f} "
                       f"{'yes' if r['same'] else 'NO':>4}")
    return out


def speculative_table(sp: dict | None) -> list[str]:
    """Each proposer vs none per batch size and skill (bench.speculative)."""
    if not sp:
        return []
    t = [[r["method"], str(r["batch"]), r["task"], str(r["tokens"]), _f(r["tok_s"]), _f(r.get("speedup"), ".2f"),
          _f(r["decode_tok_s"]), _f(r.get("decode_speedup"), ".2f"),
          "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}% of {r['drafted']}"]
         for r in sp["rows"]]
    out = ["", f"speculative decoding on the demo model at tier {sp.get('tier')} (k={sp['k']}, greedy: every method "
           "the same tokens); x = vs none in the same run; decode = tokens after each request's first",
           _table(["method", "batch", "skill", "tokens", "tok/s", "x", "decode tok/s", "x", "accepted"], t)]
    for m in sp.get("models") or []:
        t2 = [[r["method"], str(r["batch"]), str(r["tokens"]), _f(r["tok_s"]), _f(r["speedup"], ".2f"),
               "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}% of {r['drafted']}",
               "yes" if r["same"] else "NO"] for r in m["rows"]]
        out += ["", f"speculative decoding on {m['model']} (random weights, float32, {m['prompt_len']}-token random "
                f"prompts, {m['output_len']} tokens each{', tier max' if m['moe'] else ''}); same = none's tokens",
                _table(["method", "batch", "tokens", "tok/s", "x", "accepted", "same"], t2)]
    return out


def structured_table(rows: list[dict], label=lambda r: r["model"]) -> list[str]:
    """Masking overhead per batch size and compile times (bench.structured)."""
    got = [r for r in rows if r.get("structured")]
    if not got:
        return []
    t = [[label(r), r["dtype"], str(x["batch"]), str(x["tokens"]), _f(x["free_tok_s"]), _f(x["json_tok_s"]),
          _f(x["overhead_pct"]), _f(x["mask_us_per_step"]), _f(x["mask_us_per_row"])]
         for r in got for x in r["structured"]["rows"]]
    out = ["", "structured output: the same requests under a JSON schema and free (max_tokens = the constrained "
           "length), alternating rounds, median; overhead = time given up to masking",
           _table(["model", "dtype", "batch", "tokens", "free tok/s", "json tok/s", "overhead %", "mask us/step",
                   "us/row"], t)]
    for r in got:
        st = r["structured"]
        out.append(f"  {label(r)} {r['dtype']}: vocabulary {st['vocab_size']} tokens ({st['vocab_type']}), tables "
                   f"{st['setup_ms']:.0f} ms once; a typical JSON schema compiles in {st['compile_cold_ms']:.1f} ms "
                   f"(cached: {st['compile_hit_us']:.1f} us)")
    return out


def render(result: dict) -> str:
    rows, roof, m = result["results"], result["roofline"], result["machine"]
    bw = roof["bandwidth_gbs"]
    out = [
        f"machine: {m.get('cpu_model') or m['processor']}, {m['cpu_count']} CPUs (batch-invariant bf16 linear: "
        f"{m.get('bf16_row_linear') or 'torch'}), torch {m['torch']} with {m['torch_threads']} threads, "
        f"transformers {m['transformers'] or 'not installed'}; load average at start {m['loadavg_start']}, "
        f"at end {m.get('loadavg_end')}",
        f"precisions: kernels {m.get('simd') or 'none'}; bfloat16 products "
        f"{_native(m.get('native_bf16'))}, float16 products {_native(m.get('native_fp16'))}; int8 weight-only "
        f"kernel {m.get('int8_kernel') or 'unavailable'}, int4 {m.get('int4_kernel') or 'unavailable'}",
        f"roofline: read bandwidth {bw['best']:.1f} GB/s (sum {bw['sum']:.1f}, GEMV fp32 {bw['gemv_float32']:.1f}); "
        + ", ".join(f"GEMM {k} {v:.0f} GFLOP/s" for k, v in roof["gemm_gflops"].items()),
    ]
    for name, p in result["models"].items():
        moe = f", {p['experts']} experts top-{p['experts_per_token']}" if p["experts"] else ""
        out.append(f"model {name}: {p['total'] / 1e6:.1f}M params ({p['embedding'] / 1e6:.1f}M embedding), "
                   f"{p['active_per_token'] / 1e6:.1f}M read per token{moe}")
    label = lambda r: r["model"] + ("*" if r.get("busy") else "")  # noqa: E731
    t1 = [[label(r), r["dtype"], _f(r["engine"]["output_tok_s"]),
           _f((r.get("peer_batched") or {}).get("output_tok_s")), _f(r["ratios"]["throughput_vs_peer_batched"], ".2f"),
           _f((r.get("peer_single") or {}).get("output_tok_s")), _f(r["ratios"]["throughput_vs_peer_single"], ".2f"),
           _pair(r["engine"]["ttft_ms_p50"], r["engine"]["ttft_ms_p99"], ".0f"),
           _pair(r["engine"]["tpot_ms_p50"], r["engine"]["tpot_ms_p99"]),
           _pair((r.get("peer_single") or {}).get("ttft_ms_p50"), (r.get("peer_single") or {}).get("ttft_ms_p99"), ".0f"),
           _f(r["engine"].get("preemptions"), "d")] for r in rows]
    out += ["", f"mixed workload: {result['config']['num_requests']} requests, prompt {result['config']['prompt_len']}, "
            f"output {result['config']['output_len']} tokens (ignore_eos), all submitted at t=0; hf-batch: static batches "
            f"of {result['config']['peer_batch_size']}, left-padded; hf-1by1: {_single_caption(rows)}", _table(
        ["model", "dtype", "engine tok/s", "hf-batch tok/s", "x", "hf-1by1 tok/s", "x", "TTFT p50/p99 ms",
         "TPOT p50/p99 ms", "hf-1by1 TTFT ms", "preempt"], t1)]
    t2 = [[label(r), r["dtype"], _f(r["batch1"]["tok_s"]), _f((r.get("peer_batch1") or {}).get("tok_s")),
           _f(r["ratios"]["batch1_vs_peer"], ".2f"), _f(r["roofline"]["bandwidth_tok_s"]),
           _f(r["roofline"]["batch1_bandwidth_pct"]), _f((r["batch1"].get("bandwidth_gbs_adjacent"))),
           _f(r["roofline"].get("batch1_bandwidth_pct_adjacent")), _f(r["roofline"]["workload_gflops"]),
           _f(r["roofline"]["workload_flop_pct"]),
           _pair((r.get("prefix") or {}).get("ttft_ms_hit"), (r.get("prefix") or {}).get("ttft_ms_cold"), ".0f"),
           _f((r.get("prefix") or {}).get("speedup"), ".2f")] for r in rows]
    out += ["", "batch-1 decode vs bandwidth roofline (%BW: vs the run's roofline; adj: vs the GEMV bandwidth measured "
            "right before and after the batch-1 runs); workload model FLOP/s vs GEMM peak; prefix-hit TTFT", _table(
        ["model", "dtype", "b1 tok/s", "hf b1 tok/s", "x", "BW roof tok/s", "%BW", "adj GB/s", "%BW adj", "GFLOP/s",
         "%FLOP",
         "prefix TTFT hit/cold ms", "speedup"], t2)]
    out += precision_table(rows, label)
    det = [r for r in rows if r.get("deterministic")]
    if det:
        t3 = [[label(r), r["dtype"], _f(r["engine"]["output_tok_s"]), _f(r["deterministic"]["engine"]["output_tok_s"]),
               _f(r["deterministic"]["cost_pct_mixed"]), _f(r["batch1"]["tok_s"]),
               _f(r["deterministic"]["batch1"]["tok_s"]), _f(r["deterministic"]["cost_pct_batch1"])] for r in det]
        out += ["", "batch-invariant mode (engine.deterministic=true) vs the default, same workload; cost = throughput "
                "given up", _table(["model", "dtype", "mixed tok/s", "det tok/s", "cost %", "b1 tok/s", "det b1 tok/s",
                                    "cost %"], t3)]
    off = [(r, o) for r in rows for o in (r.get("offload") or [])]
    if off:
        t4 = [[label(r), r["dtype"], str(o["hot_experts"]), _f(o["device_expert_mb"]), _f(r["batch1"]["tok_s"]),
               _f(o["tok_s"]), _f(100 * o["hit_rate"]), _f(o["misses_per_token"], ".2f"),
               _f(100 * o["prefetch_hits"] / max(o["hits"] + o["prefetch_hits"] + o["misses"], 1)),
               _f(o["miss_cost_ms"], ".3f")] for r, o in off]
        out += ["", "expert offload (moe.hot_experts) on batch-1 decode: hit rate = uses found on the device "
                "(resident or prefetched in time); miss cost = slowdown per token / misses per token", _table(
                    ["model", "dtype", "hot", "expert MB", "all b1 tok/s", "b1 tok/s", "hit %", "miss/tok",
                     "prefetch %", "ms/miss"], t4)]
    out += structured_table(rows, label)
    out += speculative_table(result.get("speculative"))
    out += parallel_table(result.get("parallel"))
    out += llamacpp_table(rows, label)
    targets = target_lines(rows)
    if targets:
        out += ["", "issue-3 targets (float32):", *targets]
    if result.get("peer_error"):
        out.append(f"peer: {result['peer_error']}")
    for key in ("llamacpp_error", "llamacpp_server_error"):
        if result.get(key):
            out.append(result[key])
    busy = result.get("busy_phases") or []
    if busy:
        worst = max(busy, key=lambda p: p["other_cores"])
        out += ["", f"WARNING: the machine was busy: other processes used up to {worst['other_cores']:.1f} cores "
                f"(in {len(busy)} of {len(result['phases'])} phases, worst: {worst['phase']}); load average "
                f"{result['machine'].get('loadavg_end')}. Rows marked * were measured while others used more than "
                f"{result['config']['busy_cores']} cores: those numbers are not reliable; rerun on a quiet machine."]
    out.append(f"bench took {result['elapsed_s']:.0f} s; JSON: {result.get('json_path', '-')}")
    return "\n".join(out)


def write_json(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
    return path
