"""The benchmark behind ``+recipe=bench``: the engine vs ``transformers.generate`` and vs this machine's roofline.

For every model x dtype: a seeded mixed workload through the engine (all requests at t=0) and through
transformers (static left-padded batches, and one at a time), batch-1 decode against the bandwidth
roofline, and TTFT with and without a prefix-cache hit. Prints two tables and writes ``bench.json``
into the Hydra run directory. Modules: settings (the ``bench:`` section), models (checkpoints and
parameter counts), roofline, workload, engine_runs, peer (transformers, imported lazily), machine
(load while running), report (tables, JSON).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from litellm_pipeline.bench import engine_runs, llamacpp, parallel, peer, report, speculative, structured
from litellm_pipeline.bench.machine import CpuMonitor, loadavg, machine_info
from litellm_pipeline.bench.models import ensure_checkpoint, param_counts, resolve_model
from litellm_pipeline.bench.roofline import gemv_bandwidth, measure_roofline, stream_bandwidth, stream_mb
from litellm_pipeline.bench.settings import BenchSettings, bench_settings
from litellm_pipeline.bench.workload import batch1_item, make_workload
from litellm_pipeline.errors import ConfigError
from litellm_pipeline.tasks import output_dir

__all__ = ["run_bench", "BenchSettings"]


def engine_config(base: Mapping[str, Any], path: Path, dtype: str, overrides: Mapping[str, Any]) -> dict:
    """The app config (without ``bench``) for one engine under test."""
    cfg = OmegaConf.create(copy.deepcopy(dict(base)))
    OmegaConf.set_struct(cfg, False)
    OmegaConf.update(cfg, "model.path", str(path), merge=True)
    OmegaConf.update(cfg, "device.dtype", dtype, merge=True)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, merge=True)
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def _config(base: Mapping[str, Any], path: Path, s: BenchSettings, precision: str, extra: Mapping[str, Any]) -> dict:
    """The engine config of one precision: its compute dtype, ``bench.engine`` + ``extra``, and what the
    precision itself sets (int8 / int4: the cpu_int8 / cpu_int4 layer ops), which wins over both."""
    return engine_config(base, path, s.compute_dtype(precision), {**s.engine, **extra, **s.precision_overrides(precision)})


def _check_lengths(s: BenchSettings, models: list[tuple[str, dict]], max_model_len: int | None) -> None:
    """Fail before any work when a length cannot fit a model's context."""
    for name, cfg in models:
        limit = min(cfg.get("max_position_embeddings", 2048), max_model_len or 10**9)
        for what, need in (("prompt_len[1] + output_len[1]", s.prompt_len[1] + s.output_len[1]),
                           ("batch1_prompt_len + batch1_output_len", s.batch1_prompt_len + s.batch1_output_len),
                           ("prefix_len + prefix_suffix_len + 1", s.prefix_len + s.prefix_suffix_len + 1),
                           ("structured_max_tokens + 24", (s.structured_max_tokens + 24) if s.structured else 0),
                           ("speculative_prompt_len + speculative_output_len + speculative_k",
                            s.speculative_prompt_len + s.speculative_output_len + s.speculative_k
                            if s.speculative and s.speculative_models else 0)):
            if need > limit:
                raise ConfigError(f"bench.{what} = {need} exceeds model {name}'s context of {limit} tokens")


def _units(s: BenchSettings, n_models: int, n_single: int) -> int:
    per_run = 3 + s.num_requests + (1 if s.prefix_len else 0) + (2 + s.num_requests if s.deterministic else 0)
    per_run += len(s.offload) + (1 if s.structured else 0)
    if s.peer:
        per_run += 2 + s.num_requests + n_single
    if s.llamacpp:
        per_run += 1 + s.num_requests
    if s.llamacpp_server:
        per_run += 1
    return 1 + n_models + n_models * len(s.dtypes) * per_run


def _measure_one(row: dict, path: Path, s: BenchSettings, base: dict, items, single_items,
                 bar: tqdm, mark: Callable[[str], None], device: str) -> dict:
    """Fill ``row`` for one model x dtype; ``mark(label)`` closes a phase (and saves what is measured so far)."""
    from litellm_pipeline.config.build import build_engine

    name, dtype = row["model"], row["dtype"]
    tag = f"{name}/{dtype}"
    bar.set_description(f"{tag}: build engine")
    engine = build_engine(_config(base, path, s, dtype, {}))
    is_moe = engine.rt.model_cfg.is_moe
    # cache.dtype (null: the model's)
    row["kv_cache_dtype"] = str(engine.rt.kv_caches[0][0].dtype).removeprefix("torch.")
    engine_runs.warmup(engine, s.warmup, s.seed)
    bar.update()
    mark("engine build+warmup")
    b1 = batch1_item(s.batch1_prompt_len, s.batch1_output_len, s.seed)
    rl = s.roofline
    probe = functools.partial(_adjacent_bandwidth, rl.bandwidth_mb, min(rl.repeats, 3), device)
    with contextlib.ExitStack() as stack:
        peers = _open_llamacpp_peers(row, path, s, items, b1, stack, bar, tag)
        if peers:
            mark("llama.cpp peers start")
        # the mixed workload through the engine, then llama-server right after it (llama-cpp-python's one-by-one
        # run comes later). Once each: a second engine run would find every prompt in its prefix cache.
        bar.set_description(f"{tag}: mixed workload")
        row["engine"] = engine_runs.run_workload(engine, items, on_finish=bar.update)
        mixed = {}
        if "llamacpp_server" in peers:
            bar.set_description(f"{tag}: llama-server mixed workload")
            try:
                mixed["llamacpp_server"] = peers["llamacpp_server"].mixed(items)
            except Exception as exc:
                mixed["llamacpp_server"] = {"error": f"{type(exc).__name__}: {exc}"}
        row["engine"]["rounds_with"] = [_PEERS[k] for k in mixed]  # the peers measured right next to it
        mark("mixed workload")
        runs = {"engine": lambda: engine_runs.batch1_tpot(engine, b1)}  # noqa: F821 (called before the del below)
        runs.update({key: (lambda p=p: p.batch1_tpot(b1)) for key, p in peers.items()})
        bar.set_description(f"{tag}: batch-1 decode" + (f" in rounds with {', '.join(_PEERS[k] for k in peers)}"
                                                        if peers else ""))
        got = engine_runs.batch1_rounds(runs, s.batch1_repeats, probe, fallible=set(peers))
        row["batch1"] = {"prompt_len": len(b1.prompt_ids), "output_len": b1.output_len, **got.pop("engine"),
                         "rounds_with": [_PEERS[k] for k in peers]}
        bar.update()
        mark("batch-1 decode")
        for key, other in peers.items():
            label, one = _PEERS[key], got[key]
            try:
                for what in (mixed.get(key), one):
                    if what is not None and "error" in what:
                        raise RuntimeError(what["error"])
                if key == "llamacpp":
                    bar.set_description(f"{tag}: {label} mixed load one request at a time")
                    work_out = other.mixed(items)
                    mark(f"{label} mixed load")
                else:
                    work_out = mixed[key]
                row[key] = {**other.info(), "batch1_tok_s": one["tok_s"], "batch1_tpot_ms": one["tpot_ms"],
                            "batch1_bandwidth_gbs_adjacent": one["bandwidth_gbs_adjacent"], **work_out}
            except Exception as exc:
                row[key + "_error"] = f"{label} peer failed: {type(exc).__name__}: {exc}"
        bar.update(s.num_requests if s.llamacpp else 0)  # the peers' starts were one unit each
    row["prefix"] = None
    if s.prefix_len:
        bar.set_description(f"{tag}: prefix-hit TTFT")
        row["prefix"] = engine_runs.prefix_ttft(engine, s.prefix_len, s.prefix_suffix_len, s.seed)
        bar.update()
        mark("prefix TTFT")
    del engine
    gc.collect()
    bar.update()
    row["deterministic"] = None
    if s.deterministic:
        row["deterministic"] = _measure_deterministic(path, s, base, items, b1, probe, bar, tag, dtype)
        mark("deterministic mode")
    row["offload"] = None
    if s.offload and is_moe and dtype not in ("int8", "int4"):  # cpu_int8 and cpu_int4 refuse expert offload
        row["offload"] = _measure_offload(path, s, base, b1, row["batch1"], bar, tag, dtype)
        mark("expert offload")
    else:
        bar.update(len(s.offload))
    row["structured"] = None
    if s.structured:
        row["structured"] = _measure_structured(path, s, base, bar, tag, dtype)
        mark("structured output")
    row["peer_batched"] = row["peer_single"] = row["peer_batch1"] = None
    if s.peer and dtype in ("int8", "int4"):  # transformers has no weight-only int8 / int4 CPU path to compare with
        bar.update(2 + s.num_requests + len(single_items))
    elif s.peer:
        bar.set_description(f"{tag}: load transformers")
        model, err = peer.load_peer(path, dtype, device)
        if model is None:
            row["peer_error"] = err
            bar.update(2 + s.num_requests + len(single_items))
            return row
        peer.warmup(model, s.warmup)
        bar.update()
        mark("peer load+warmup")
        bar.set_description(f"{tag}: transformers batched")
        row["peer_batched"] = peer.run_batched(model, items, s.peer_batch_size, on_batch=bar.update)
        mark("peer batched")
        bar.set_description(f"{tag}: transformers one at a time")
        row["peer_single"] = peer.run_single(model, single_items, on_request=bar.update)
        mark("peer one-at-a-time")
        bar.set_description(f"{tag}: transformers batch-1 decode")
        row["peer_batch1"] = peer.batch1_decode(model, b1, s.batch1_repeats)
        bar.update()
        mark("peer batch-1")
        del model
        gc.collect()
    return row


_PEERS = {"llamacpp": "llama.cpp", "llamacpp_server": "llama-server"}


def _open_llamacpp_peers(row: dict, path: Path, s: BenchSettings, items, b1, stack: contextlib.ExitStack,
                         bar: tqdm, tag: str) -> dict:
    """Start the llama.cpp peers the settings ask for, each in a process of its own, on the same checkpoint and
    precision with the engine's thread count; ``{row key: peer}`` for those that started. A peer that cannot run
    here gets ``row[key + "_error"]`` saying why, one that fails to start says how; the engine's numbers still
    count. Started peers stop when ``stack`` closes."""
    threads, n_ctx, dtype = torch.get_num_threads(), llamacpp.context_need(items, b1), row["dtype"]
    row["llamacpp"] = row["llamacpp_server"] = None
    wanted = {}
    if s.llamacpp:
        wanted["llamacpp"] = (llamacpp.unavailable(), lambda: llamacpp.PeerProcess(path, dtype, threads, n_ctx,
                                                                                    path.parent))
    if s.llamacpp_server:
        wanted["llamacpp_server"] = (llamacpp.server_unavailable(s.llamacpp_server),
                                     lambda: llamacpp.open_server(s.llamacpp_server, path, dtype, threads,
                                                                  s.llamacpp_server_slots, n_ctx, path.parent))
    peers = {}
    for key, (why, start) in wanted.items():
        if why is not None:
            row[key + "_error"] = why
            continue
        bar.set_description(f"{tag}: start {_PEERS[key]}")
        try:
            peers[key] = stack.enter_context(start())
        except Exception as exc:
            row[key + "_error"] = f"{_PEERS[key]} peer failed: {type(exc).__name__}: {exc}"
    bar.update(len(wanted))
    return peers


def _measure_deterministic(path, s: BenchSettings, base: dict, items, b1, probe, bar: tqdm, tag: str, dtype: str) -> dict:
    """The same workload and batch-1 decode with ``engine.deterministic=true`` (the batch-invariant mode)."""
    from litellm_pipeline.config.build import build_engine

    bar.set_description(f"{tag}: deterministic mode")
    engine = build_engine(_config(base, path, s, dtype, {"engine.deterministic": True}))
    engine_runs.warmup(engine, s.warmup, s.seed)
    bar.update()
    work = engine_runs.run_workload(engine, items, on_finish=bar.update)
    one = engine_runs.batch1_decode(engine, b1, s.batch1_repeats, probe)
    bar.update()
    del engine
    gc.collect()
    return {"engine": work, "batch1": one}


def _measure_offload(path, s: BenchSettings, base: dict, b1, resident: dict, bar: tqdm, tag: str, dtype: str) -> list:
    """Batch-1 decode with ``moe.hot_experts`` = each of ``s.offload``: tokens/s, the offload counts per decode
    token, and what a miss costs (the slowdown against the all-resident run over the misses per token)."""
    from litellm_pipeline.config.build import build_engine

    out = []
    for hot in s.offload:
        bar.set_description(f"{tag}: offload hot_experts={hot}")
        engine = build_engine(_config(base, path, s, dtype, {"moe.hot_experts": hot}))
        engine_runs.warmup(engine, s.warmup, s.seed)
        off = engine.rt.model.expert_offload
        runs = engine_runs.batch1_decode(engine, b1, s.batch1_repeats)
        st = off.stats()
        tokens = s.batch1_repeats * b1.output_len
        misses_per_token = st.misses / tokens
        extra_ms = runs["tpot_ms"] - resident["tpot_ms"]
        out.append({
            "hot_experts": hot, "tok_s": runs["tok_s"], "tpot_ms": runs["tpot_ms"], **st.as_dict(),
            "misses_per_token": misses_per_token, "device_expert_mb": off.device_bytes() / 2**20,
            "miss_cost_ms": extra_ms / misses_per_token if misses_per_token > 0 else None,
        })
        bar.update()
        del engine
        gc.collect()
    return out


def _measure_structured(path: Path, s: BenchSettings, base: dict, bar: tqdm, tag: str, dtype: str) -> dict:
    """Masking overhead and compile time (bench/structured.py) on this model's shape with a trained BPE vocabulary."""
    from litellm_pipeline.config.build import build_engine

    bar.set_description(f"{tag}: structured output")
    model_cfg = json.loads((path / "config.json").read_text())
    bpe = structured.structured_checkpoint(tag.split("/")[0], model_cfg, s.model_seed)
    engine = build_engine(_config(base, bpe, s, dtype, {"cache.enable_prefix_caching": False}))
    engine_runs.warmup(engine, s.warmup, s.seed)
    try:
        return structured.measure_structured(engine, s.structured_batches, s.structured_rounds,
                                             s.structured_max_tokens, s.seed)
    finally:
        bar.update()
        del engine
        gc.collect()


def run_bench(cfg: Any) -> dict:
    """Run the bench for the composed config (its ``bench`` section); print the tables, write bench.json."""
    plain = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else copy.deepcopy(dict(cfg))
    s = bench_settings(plain.pop("bench", None))
    # the engine's own sections stay as they are: the bench only sets model.path and device.dtype per run
    base = plain
    t_start = time.monotonic()
    models = [resolve_model(m) for m in s.models]
    if len({n for n, _ in models}) < len(models):
        raise ConfigError(f"bench.models: names must be unique (got {[n for n, _ in models]})")
    _check_lengths(s, models, (base.get("model") or {}).get("max_model_len"))
    device_cfg = base.get("device") or {}
    if device_cfg.get("threads"):
        torch.set_num_threads(int(device_cfg["threads"]))
    from litellm_pipeline.config.build import resolve_device

    device = str(resolve_device(device_cfg.get("type", "cpu")))
    info = machine_info()
    mon = CpuMonitor()
    time.sleep(0.5)  # a quiet half second: what other processes use before we add our own load
    mon.mark("idle check")
    items = make_workload(s.num_requests, s.prompt_len, s.output_len, s.seed)
    single_items = items[: s.peer_single_max_requests] if s.peer_single_max_requests else items
    out = output_dir() / "bench.json"
    result: dict[str, Any] = {"config": s.model_dump(mode="json"), "machine": info, "models": {}, "results": []}
    with tqdm(total=_units(s, len(models), len(single_items)), file=sys.stderr, unit="step",
              mininterval=0.5, dynamic_ncols=True) as bar:
        bar.set_description("roofline")
        rl = s.roofline
        compute = list(dict.fromkeys(s.compute_dtype(p) for p in s.dtypes))
        result["roofline"] = measure_roofline(compute, rl.bandwidth_mb, rl.gemm_size, rl.repeats, device)
        bar.update()
        mon.mark("roofline")
        paths = {}
        for name, mcfg in models:
            bar.set_description(f"{name}: checkpoint")
            paths[name] = ensure_checkpoint(name, mcfg, s.model_seed)
            result["models"][name] = {**param_counts(mcfg), "path": str(paths[name])}
            bar.update()
        mon.mark("checkpoints")
        for name, mcfg in models:
            for dtype in s.dtypes:
                first_phase = len(mon.phases)
                row: dict[str, Any] = {"model": name, "dtype": dtype, "compute_dtype": s.compute_dtype(dtype),
                                       "partial": True}
                if dtype == "int8":
                    row["int8_lm_head"], row["int8_dot"] = s.int8_lm_head, s.int8_dot
                elif dtype == "int4":
                    row["int4_lm_head"], row["int4_group_size"], row["int4_dot"] = (
                        s.int4_lm_head, s.int4_group_size, s.int4_dot)
                result["results"].append(row)

                def mark(label: str, tag: str = f"{name}/{dtype}") -> None:
                    mon.mark(f"{tag} {label}")
                    _save(result, mon, s, t_start, out, complete=False)  # a stopped run keeps what it measured

                _measure_one(row, paths[name], s, base, items, single_items, bar, mark, device)
                row["params"] = result["models"][name]
                row["busy"] = bool(mon.busy_phases(s.busy_cores, phases=mon.phases[first_phase:]))
                del row["partial"]
                report.derive(row, result["roofline"])
                if row.get("peer_error"):
                    result["peer_error"] = row["peer_error"]
                for key in ("llamacpp_error", "llamacpp_server_error"):
                    if row.get(key):
                        result[key] = row[key]
    if s.speculative:
        result["speculative"] = _measure_speculative(s, base, out, models if s.speculative_models else [], paths)
        mon.mark("speculative decoding")
    if s.parallel:
        from litellm_pipeline.config.build import build_engine

        result["parallel"] = [
            parallel.measure_parallel(
                lambda p, extra: build_engine(engine_config(base, p, "float32", {**s.engine, **extra})), paths[name],
                mcfg, name, s.parallel_batches, s.parallel_requests, s.parallel_prompt_len, s.parallel_output_len,
                s.parallel_rounds, s.seed)
            for name, mcfg in models]
        mon.mark("parallel")
    _save(result, mon, s, t_start, out, complete=True)
    print(report.render(result))
    return result


def _adjacent_bandwidth(mb: int, repeats: int, device: str | torch.device) -> float:
    """GB/s right before and after the batch-1 runs: on a CPU the stream probe (what decode sees), else the GEMV."""
    got = stream_bandwidth(stream_mb(mb), repeats) if torch.device(device).type == "cpu" else None
    return (got if got is not None else gemv_bandwidth(mb, repeats, torch.float32, device)) / 1e9


def _measure_speculative(s: BenchSettings, base: dict, out: Path, models: list[tuple[str, dict]],
                         paths: dict[str, Path]) -> dict:
    """Each proposer vs none on the demo model's skills and on each bench model (bench/speculative.py); the
    picture next to the JSON."""
    from litellm_pipeline.config.build import build_engine
    from litellm_pipeline.demo import demo_checkpoint

    demo = Path(demo_checkpoint())

    def build(overrides: dict):
        extra = {"pipeline.stages.select_tier.params.tier": s.speculative_tier, **overrides}
        return build_engine(engine_config(base, demo, "float32", {**s.engine, **extra}))

    got = speculative.measure_speculative(build, demo, list(s.speculative_methods), s.speculative_batches,
                                          s.speculative_per_task, s.speculative_rounds, s.speculative_k,
                                          s.speculative_max_tokens, s.seed)
    got["tier"] = s.speculative_tier
    got["models"] = [
        speculative.measure_checkpoint(
            lambda p, extra: build_engine(engine_config(base, p, "float32", {**s.engine, **extra})), paths[name],
            mcfg, name, s.model_seed, s.speculative_batches, s.speculative_requests, s.speculative_prompt_len,
            s.speculative_output_len, s.speculative_k, list(s.speculative_methods), s.speculative_rounds)
        for name, mcfg in models]
    png = speculative.plot(got, out.with_name(out.stem + "-speculative.png"))
    got["plot"] = str(png) if png else None
    return got


def _save(result: dict, mon: CpuMonitor, s: BenchSettings, t_start: float, out: Path, complete: bool) -> None:
    result["machine"]["loadavg_end"] = loadavg()
    result["phases"] = mon.phases
    result["busy_phases"] = mon.busy_phases(s.busy_cores)
    result["busy"] = bool(result["busy_phases"])
    result["elapsed_s"] = time.monotonic() - t_start
    result["complete"] = complete
    result["json_path"] = str(out)
    report.write_json(result, out)
