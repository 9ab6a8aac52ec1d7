"""Timed runs through the engine under test: the mixed workload, batch-1 decode, and a prefix hit."""

from __future__ import annotations

import random
import time
from typing import Callable, Collection, Mapping, Sequence

from litellm_pipeline.bench.workload import WorkItem, latency_summary, random_ids
from litellm_pipeline.sampling import SamplingParams
from litellm_pipeline.telemetry import MemorySink, PrefixLookup


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run_requests(engine, items: Sequence[WorkItem], on_finish: Callable[[], None] | None = None) -> list:
    """Submit every item at once (t=0), step until all finish; returns the finished Request objects."""
    reqs = [engine.add_request(list(it.prompt_ids), _greedy(it.output_len)) for it in items]

    def finished(out) -> None:
        if out.error:
            raise RuntimeError(f"bench request {out.request_id} failed: {out.error}")
        if on_finish:
            on_finish()

    engine.run(reqs, on_finish=finished)
    return reqs


def warmup(engine, n: int, seed: int) -> None:
    if n:
        rng = random.Random(seed ^ 0x5EED)
        run_requests(engine, [WorkItem(tuple(random_ids(rng, 16)), 4) for _ in range(n)])


def workload_metrics(reqs: Sequence, t0: float) -> dict:
    """Throughput and latency of requests that were all submitted at ``t0`` (time.monotonic)."""
    end = max(r.finish_time for r in reqs)
    out_tokens = sum(len(r.output_ids) for r in reqs)
    prompt_tokens = sum(len(r.prompt_ids) for r in reqs)
    ttft = [r.first_token_time - r.arrival for r in reqs]
    tpot = [(r.finish_time - r.first_token_time) / (len(r.output_ids) - 1) for r in reqs if len(r.output_ids) > 1]
    elapsed = max(end - t0, 1e-9)
    return {
        "requests": len(reqs),
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "elapsed_s": elapsed,
        "output_tok_s": out_tokens / elapsed,
        "total_tok_s": (prompt_tokens + out_tokens) / elapsed,
        **latency_summary(ttft, tpot),
    }


def run_workload(engine, items: Sequence[WorkItem], on_finish: Callable[[], None] | None = None) -> dict:
    """The mixed workload, with the engine's events counted on the bus while it runs."""
    sink = MemorySink()
    engine.bus.subscribe(sink)
    try:
        t0 = time.monotonic()
        reqs = run_requests(engine, items, on_finish)
    finally:
        engine.bus.unsubscribe(sink)
    metrics = workload_metrics(reqs, t0)
    metrics["preemptions"] = sink.counts["preempted"]
    metrics["steps"] = sink.counts["step"]
    metrics["prefix_hit_tokens"] = int(sink.total(PrefixLookup, "hit_tokens"))
    return metrics


def batch1_tpot(engine, item: WorkItem) -> float:
    """One request alone through ``engine``: seconds per output token after the first (pure decode)."""
    (r,) = run_requests(engine, [item])
    return (r.finish_time - r.first_token_time) / (len(r.output_ids) - 1)


def batch1_rounds(runs: Mapping[str, Callable[[], float]], repeats: int, probe: Callable[[], float] | None = None,
                  fallible: Collection[str] = ()) -> dict[str, dict]:
    """Batch-1 decode of several engines in interleaved rounds: ``repeats`` rounds, each running every engine once
    (``runs[name]()`` returns seconds per token after the first), the order rotated from round to round; each
    engine's fastest run counts (``tpot_ms``, ``tok_s``).

    On a shared machine the bandwidth a neighbour leaves us drifts over minutes, so engines measured one after
    the other can see different machines; in rounds they see the same one. ``probe`` (read bandwidth in GB/s,
    measured now) runs before every run and after the last: each engine also gets ``bandwidth_gbs_adjacent``, the
    best probe next to one of its runs (None without a probe). A name in ``fallible`` that raises gets
    ``{"error": ...}`` and leaves the rounds; any other exception propagates.
    """
    names = list(runs)
    best = dict.fromkeys(names, float("inf"))
    near: dict[str, list[float]] = {n: [] for n in names}
    errors: dict[str, str] = {}
    last = probe() if probe is not None else None
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            if name in errors:
                continue
            before = last
            try:
                tpot = runs[name]()
            except Exception as exc:
                if name not in fallible:
                    raise
                errors[name] = f"{type(exc).__name__}: {exc}"
                continue
            best[name] = min(best[name], tpot)
            if probe is not None:
                last = probe()
                near[name] += [before, last]
    return {name: {"error": errors[name]} if name in errors else
            {"tpot_ms": best[name] * 1e3, "tok_s": 1.0 / max(best[name], 1e-9),
             "bandwidth_gbs_adjacent": max(near[name]) if near[name] else None} for name in names}


def batch1_decode(engine, item: WorkItem, repeats: int, probe: Callable[[], float] | None = None) -> dict:
    """One request alone: output tokens/s after the first token (pure decode), best of ``repeats``, with the
    bandwidth probed next to the runs (see :func:`batch1_rounds`)."""
    (one,) = batch1_rounds({"engine": lambda: batch1_tpot(engine, item)}, repeats, probe).values()
    return {"prompt_len": len(item.prompt_ids), "output_len": item.output_len, **one}


def prefix_ttft(engine, prefix_len: int, suffix_len: int, seed: int) -> dict:
    """TTFT of B (shares a ``prefix_len`` prefix with A, which ran to completion first) vs cold C."""
    rng = random.Random(seed ^ 0xCAFE)
    prefix = random_ids(rng, prefix_len)
    a = WorkItem(tuple(prefix + random_ids(rng, suffix_len)), 1)
    b = WorkItem(tuple(prefix + random_ids(rng, suffix_len)), 1)
    c = WorkItem(tuple(random_ids(rng, prefix_len + suffix_len)), 1)
    ttft = {}
    for name, item in (("a_first", a), ("b_hit", b), ("c_cold", c)):
        (r,) = run_requests(engine, [item])
        ttft[name] = r.first_token_time - r.arrival
    return {
        "prefix_len": prefix_len,
        "suffix_len": suffix_len,
        "ttft_ms_first": ttft["a_first"] * 1e3,
        "ttft_ms_hit": ttft["b_hit"] * 1e3,
        "ttft_ms_cold": ttft["c_cold"] * 1e3,
        "speedup": ttft["c_cold"] / max(ttft["b_hit"], 1e-9),
    }
