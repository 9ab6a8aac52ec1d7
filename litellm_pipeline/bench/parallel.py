"""Tensor and expert parallelism in the bench (``bench.parallel=true``): tokens/s of each bench model in one process
and split over 2 ranks (``tensor=2``; ``expert=2`` for MoE models), with the time the driver spends in the model's
collectives per step. Every split runs on this machine's cores: one process with all of them against 2 ranks with
half each, so the comparison is what splitting costs or gains on the same hardware. Greedy, random prompts,
``ignore_eos``; rounds alternate the splits' order and the median is kept; ``same`` says whether a split generated
one process's tokens.
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path
from typing import Any, Callable

import torch

from litellm_pipeline.bench.speculative import _run
from litellm_pipeline.sampling import SamplingParams

__all__ = ["measure_parallel"]


def splits(moe: bool) -> dict[str, dict[str, Any]]:
    out = {"1 rank": {}, "tensor=2": {"parallel.tensor": 2}}
    if moe:
        out["expert=2"] = {"parallel.expert": 2}
    return out


def measure_parallel(build: Callable[[Path, dict], Any], path: Path, cfg: dict, name: str, batches: list[int],
                     requests: int, prompt_len: int, output_len: int, rounds: int, seed: int) -> dict:
    moe = "num_local_experts" in cfg or "num_experts" in cfg
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, cfg["vocab_size"]) for _ in range(prompt_len)] for _ in range(requests)]
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    # torch's threads are the process's: the driver of a parallel engine takes its share of the cores, a single
    # process all of them; each run gets its own count back
    default_threads = torch.get_num_threads()
    threads = {}
    engines = {}
    for label, o in splits(moe).items():
        engines[label] = build(path, {"cache.enable_prefix_caching": False, **o})
        threads[label] = torch.get_num_threads()
        torch.set_num_threads(default_threads)
    rows = []
    try:
        for label, engine in engines.items():
            torch.set_num_threads(threads[label])
            _run(engine, prompts[:1], 1, sp)  # warm
        for batch in batches:
            got: dict[str, list[dict]] = {label: [] for label in engines}
            for r in range(rounds):
                for label in (engines if r % 2 == 0 else list(reversed(list(engines)))):
                    torch.set_num_threads(threads[label])
                    got[label].append(_timed(engines[label], prompts, batch, sp))
            first_outputs = got["1 rank"][0]["outputs"]
            for label, runs in got.items():
                rows.append({
                    "split": label, "batch": batch, "tokens": runs[0]["tokens"],
                    "tok_s": statistics.median(x["tokens"] / x["wall_s"] for x in runs),
                    "steps": runs[0]["steps"],
                    "collective_ms_per_step": statistics.median(x["collective_ms_per_step"] for x in runs),
                    "collectives_per_step": runs[0]["collectives_per_step"],
                    "same": runs[0]["outputs"] == first_outputs,
                })
    finally:
        torch.set_num_threads(default_threads)
        for engine in engines.values():
            engine.close()
    return {"model": name, "threads": threads, "prompt_len": prompt_len, "output_len": output_len,
            "requests": requests, "rows": rows}


def _timed(engine, prompts: list, batch: int, sp: SamplingParams) -> dict:
    """``_run`` with the driver's collective seconds and calls, and the model steps, over the run."""
    member = engine.rt.parallel
    comm = member.comm if member is not None else None
    driver = member.driver if member is not None else None
    s0, c0 = (comm.seconds, comm.calls) if comm is not None else (0.0, 0)
    f0 = driver.forwards if driver is not None else 0
    got = _run(engine, prompts, batch, sp)
    steps = (driver.forwards - f0) if driver is not None else 0
    got["steps"] = steps
    got["collective_ms_per_step"] = 1e3 * (comm.seconds - s0) / steps if steps else 0.0
    got["collectives_per_step"] = (comm.calls - c0) / steps if steps else 0.0
    return got
