"""Speculative decoding in the bench (``bench.speculative=true``): tokens/s with each proposer against none, at
batch 1 and batch N, on the demo model's skills (copy, reverse, sort, add, recall) at ``bench.speculative_tier``.

Each method runs in its own engine on the same held-out prompts (greedy, so every method generates the same
tokens). ``tok/s`` is output tokens over wall time (prompt steps included); ``decode tok/s`` counts only the
tokens after each request's first, over the time after its first token: what speculation changes. Rounds
alternate the methods' order and the median is kept. ``draft`` is the demo checkpoint drafting at its native
routing for the target tier; ``draft_random`` a random checkpoint of the demo's shape and vocabulary: a draft
that is almost never right, the case adaptive k must keep near 1x.
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from litellm_pipeline.sampling import SamplingParams

__all__ = ["measure_speculative", "measure_checkpoint", "METHODS"]

METHODS = ("none", "ngram", "tier", "draft", "draft_random")


def _overrides(method: str, k: int, demo: Path, random_draft: Callable[[], Path]) -> dict[str, Any]:
    if method == "none":
        return {"speculative.method": "none"}
    out: dict[str, Any] = {"speculative.method": method, "speculative.k": k}
    if method == "ngram":
        out["speculative.params"] = {"max_n": 4, "min_n": 1}
    elif method == "tier":
        out["speculative.params"] = {"tier": "fast"}
    elif method == "draft":
        out["speculative.model"] = str(demo)
    elif method == "draft_random":
        out.update({"speculative.method": "draft", "speculative.model": str(random_draft())})
    return out


def _random_draft(demo: Path, seed: int) -> Path:
    """The demo checkpoint with every weight redrawn at random (same shapes and scale): same vocabulary, no skill."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from litellm_pipeline.bench.checkpoints import cache_root

    target = cache_root() / f"demo-redrawn-seed{seed}"
    if (target / "model.safetensors").is_file():
        return target
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(demo, tmp, ignore=shutil.ignore_patterns("model.safetensors", "*.png"))
    g = torch.Generator().manual_seed(seed)
    weights = {k: (torch.randn(v.shape, generator=g) * v.float().std().clamp(min=1e-3)).to(v.dtype)
               if v.dim() > 1 else v for k, v in load_file(str(demo / "model.safetensors")).items()}
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def _run(engine, prompts: list, batch: int, sp: SamplingParams | int) -> dict:
    """Every prompt, ``batch`` at a time (``sp``: the params, or greedy ``max_tokens``); output tokens, wall
    seconds, decode tokens and seconds, drafts."""
    if isinstance(sp, int):
        sp = SamplingParams(temperature=0, max_tokens=sp)
    tokens = dec_tokens = drafted = kept = 0
    dec_s = 0.0
    outputs = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        reqs = [engine.add_request(p, sp) for p in prompts[i : i + batch]]
        engine.run(reqs)
        for r in reqs:
            n = len(r.output_ids)
            tokens += n
            drafted += r.num_draft_tokens
            kept += r.num_accepted_tokens
            outputs.append(list(r.output_ids))
            if n > 1:
                dec_tokens += n - 1
                dec_s += r.finish_time - r.first_token_time
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "wall_s": wall, "dec_tokens": dec_tokens, "dec_s": dec_s, "drafted": drafted,
            "accepted": kept, "outputs": outputs}


def measure_speculative(build: Callable[[dict], Any], demo: Path, methods: list[str], batches: list[int],
                        per_task: int, rounds: int, k: int, max_tokens: int, seed: int,
                        on_step: Callable[[], None] = lambda: None) -> dict:
    """``build(overrides)`` makes an engine on the demo model at the bench's tier with the given overrides."""
    from litellm_pipeline.demo.skills import TASKS, heldout

    examples = heldout(per_task, seed=seed)
    by_task = {t: [e.prompt for e in examples if e.task == t] for t in TASKS}
    drafts: dict[str, Path] = {}

    def random_draft() -> Path:
        if "p" not in drafts:
            drafts["p"] = _random_draft(demo, seed + 1)
        return drafts["p"]

    engines = {m: build(_overrides(m, k, demo, random_draft)) for m in methods}
    for engine in engines.values():  # warm: kernels, plans, the draft model's
        _run(engine, by_task["copy"][:2], 2, max_tokens)
    rows = []
    for batch in batches:
        for task, prompts in by_task.items():
            got: dict[str, list[dict]] = {m: [] for m in methods}
            for r in range(rounds):
                order = methods if r % 2 == 0 else list(reversed(methods))
                for m in order:
                    got[m].append(_run(engines[m], prompts, batch, max_tokens))
            ref = got.get("none", [None])[0]
            base = None
            for m in methods:
                runs = got[m]
                if ref is not None and runs[0]["outputs"] != ref["outputs"]:
                    raise RuntimeError(f"speculative bench: {m} changed the greedy output on {task} (batch {batch})")
                tok_s = statistics.median(x["tokens"] / x["wall_s"] for x in runs)
                dec = statistics.median(x["dec_tokens"] / x["dec_s"] for x in runs if x["dec_s"] > 0) \
                    if any(x["dec_s"] > 0 for x in runs) else None
                row = {"method": m, "batch": batch, "task": task, "requests": len(prompts),
                       "tokens": runs[0]["tokens"], "tok_s": tok_s, "decode_tok_s": dec,
                       "drafted": runs[0]["drafted"], "accepted": runs[0]["accepted"],
                       "acceptance": runs[0]["accepted"] / runs[0]["drafted"] if runs[0]["drafted"] else None}
                if m == "none":
                    base = row
                if base is not None:
                    row["speedup"] = tok_s / base["tok_s"]
                    row["decode_speedup"] = dec / base["decode_tok_s"] if dec and base["decode_tok_s"] else None
                rows.append(row)
            on_step()
    del engines
    gc.collect()
    return {"k": k, "max_tokens": max_tokens, "rows": rows}


def _draft_config(cfg: dict) -> dict:
    """A small model of the same family and vocabulary (the ``draft`` of a bench checkpoint): 2 layers, width 64."""
    small = {**cfg, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16}
    if "num_local_experts" in cfg:
        small["intermediate_size"] = 96
    return small


def measure_checkpoint(build: Callable[[Path, dict], Any], path: Path, cfg: dict, name: str, seed: int,
                       batches: list[int], requests: int, prompt_len: int, output_len: int, k: int,
                       only: list[str] | None = None, rounds: int = 1) -> dict:
    """A bench checkpoint (random weights): none, ngram, draft (a 2-layer model of its vocabulary, random too) and,
    for a MoE model, tier, on random prompts with ``ignore_eos``; ``same`` says whether each method generated
    none's tokens (greedy over random weights can meet near-ties that the chunked verification rounds otherwise).
    ``rounds`` runs of each, in alternating order; the median."""
    import random

    from litellm_pipeline.bench.checkpoints import cache_root, write_random_checkpoint

    moe = "num_local_experts" in cfg or "num_experts" in cfg
    draft = None
    if only is None or "draft" in only:
        draft = write_random_checkpoint(cache_root() / f"bench-{name}-draft-seed{seed}", _draft_config(cfg), seed + 1)
    methods = {"none": {"speculative.method": "none"},
               "ngram": {"speculative.method": "ngram", "speculative.k": k, "speculative.params": {"max_n": 4}}}
    if draft is not None:
        methods["draft"] = {"speculative.method": "draft", "speculative.k": k, "speculative.model": str(draft)}
    if moe:
        methods["tier"] = {"speculative.method": "tier", "speculative.k": k, "speculative.params": {"tier": "fast"}}
        for overrides in methods.values():  # the target runs at its costliest tier, as on the demo model
            overrides["pipeline.stages.select_tier.params.tier"] = "max"
    if only is not None:
        methods = {m: o for m, o in methods.items() if m == "none" or m in only}
    rng = random.Random(seed)
    vocab = cfg["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(requests)]
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engines = {m: build(path, {"cache.enable_prefix_caching": False, **overrides}) for m, overrides in methods.items()}
    for engine in engines.values():
        _run(engine, prompts[:1], 1, sp)  # warm
    rows = []
    for batch in batches:
        got: dict[str, list[dict]] = {m: [] for m in engines}
        for r in range(rounds):  # alternating order, the median of each: a shared machine drifts between runs
            for m in (engines if r % 2 == 0 else list(reversed(list(engines)))):
                got[m].append(_run(engines[m], prompts, batch, sp))
        for m, runs in got.items():
            first = runs[0]
            rows.append({"method": m, "batch": batch, **{x: first[x] for x in ("tokens", "drafted", "accepted")},
                         "wall_s": statistics.median(x["wall_s"] for x in runs),
                         "tok_s": statistics.median(x["tokens"] / x["wall_s"] for x in runs),
                         "outputs": first["outputs"]})
    del engines
    gc.collect()
    for r in rows:
        base = next(b for b in rows if b["method"] == "none" and b["batch"] == r["batch"])
        r["speedup"] = r["tok_s"] / base["tok_s"]
        r["same"] = r["outputs"] == base["outputs"]
        r["acceptance"] = r["accepted"] / r["drafted"] if r["drafted"] else None
    for r in rows:
        del r["outputs"]
    return {"model": name, "moe": moe, "prompt_len": prompt_len, "output_len": output_len, "rows": rows}


def plot(result: dict, path: Path) -> Path | None:
    """Speed-up against acceptance, one point per (method, batch, task)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    markers = {1: "o", 8: "s"}
    for m in sorted({r["method"] for r in result["rows"]} - {"none"}):
        pts = [r for r in result["rows"] if r["method"] == m and r["acceptance"] is not None]
        for b in sorted({r["batch"] for r in pts}):
            sub = [r for r in pts if r["batch"] == b]
            ax.scatter([r["acceptance"] for r in sub], [r["decode_speedup"] or 0 for r in sub],
                       label=f"{m} b{b}", marker=markers.get(b, "^"))
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("acceptance (kept / drafted)")
    ax.set_ylabel("decode speed-up vs none")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

