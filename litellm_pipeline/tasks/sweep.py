"""``+recipe=sweep``: one point of a tier / budget sweep (run many with Hydra's ``-m``), written as ``sweep.json``.

A job sends a fixed workload (held-out skills prompts for the embedded demo model; a set of text prompts for
any other checkpoint) through the configured engine, all at once, at ``sweep.tier`` or under the configured
select_tier mode and default budget, and records:

* quality: exact-match accuracy for the demo model; for another checkpoint, the share of greedy tokens equal
  to the full model's (every expert) on the same prompts;
* latency p50 / p99 (end to end and inter-token, ms), output tokens per second of the whole workload;
* money: mean and total, from the cost records;
* budget compliance: per set budget limit, the share of requests whose actual value kept it;
* which TierSets were chosen, and how many requests the budget rejected.

``+recipe=report report.sweep_dir=DIR`` (:mod:`litellm_pipeline.tasks.report`) turns a directory of these into a
table and a Pareto plot.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from litellm_pipeline.errors import ConfigError, InvalidRequestError, section_settings
from litellm_pipeline.sampling import SamplingParams

TEXT_PROMPTS = (
    "The capital of France is", "def fibonacci(n):", "1 2 3 4 5", "Once upon a time",
    "The weather today", "import numpy as np", "Dear Sir or Madam,", "The answer is",
)


class SweepSettings(BaseModel):
    """The ``sweep:`` config section (see recipes/sweep.yaml)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tier: str | None = None  # a tier every request names; null: the select_tier mode decides
    per_task: int = Field(default=20, ge=1)  # demo model: held-out prompts per skill
    prompts: int = Field(default=8, ge=1)  # another checkpoint: text prompts
    max_tokens: int = Field(default=16, ge=1)
    seed: int = 1234  # which held-out prompts


def sweep_settings(section: Any) -> SweepSettings:
    return section_settings(SweepSettings, section, "sweep")


def _pct(values: list[float], q: float, failed: int = 0) -> float | None:
    """The q-quantile of ``values``, ``failed`` more requests counting as never answered (infinitely late): None
    where there is nothing, or where the quantile falls on a failure."""
    v = sorted(values) + [math.inf] * failed
    if not v:
        return None
    x = v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]
    return None if math.isinf(x) else x


def _workload(engine, s: SweepSettings, demo: bool) -> tuple[list[str], list[str] | None, list[str] | None]:
    if demo:
        from litellm_pipeline.demo.skills import heldout

        exs = heldout(s.per_task, seed=s.seed)
        return [e.prompt for e in exs], [e.answer for e in exs], [e.task for e in exs]
    return [TEXT_PROMPTS[i % len(TEXT_PROMPTS)] for i in range(s.prompts)], None, None


def _run(engine, prompts, params, tier) -> tuple[list, int, float]:
    """Submit everything at once and step until done: (outputs in prompt order, rejected count, seconds)."""
    t0 = time.perf_counter()
    reqs, rejected = [], 0
    for p in prompts:
        try:
            reqs.append(engine.add_request(p, params, tier=tier))
        except InvalidRequestError as exc:
            if exc.field != "budget":
                raise
            reqs.append(None)
            rejected += 1
    finished = iter(engine.run([r for r in reqs if r is not None]))
    seconds = time.perf_counter() - t0
    return [next(finished) if r is not None else None for r in reqs], rejected, seconds


def run(cfg) -> dict:
    """The ``sweep`` task: run the workload once, print a line, write ``sweep.json`` into the run directory."""
    from litellm_pipeline.config.build import build_engine, to_plain
    from litellm_pipeline.tasks import write_json

    plain = to_plain(cfg)
    s = sweep_settings(plain.get("sweep"))
    tiers = plain.get("tiers") or {}
    if s.tier is not None and s.tier not in tiers:  # before anything loads
        raise ConfigError(f"sweep.tier: unknown tier {s.tier!r}; configured tiers: {', '.join(tiers)}")
    engine = build_engine(plain)
    demo = plain["model"].get("path") is None
    prompts, answers, tasks = _workload(engine, s, demo)
    # the demo's answers end at EOS; elsewhere every tier makes max_tokens tokens, compared with the full model's
    params = SamplingParams(max_tokens=s.max_tokens, temperature=0.0, ignore_eos=not demo)
    # warm-up (kernels built and paged in, first latencies seen), so the first job of a sweep is not the slowest
    _run(engine, prompts[:4], SamplingParams(max_tokens=2, temperature=0.0), s.tier)
    outs, rejected, seconds = _run(engine, prompts, params, s.tier)
    served = [o for o in outs if o is not None]
    if demo:
        right = [o is not None and o.text == a for o, a in zip(outs, answers)]
        by_task: dict[str, list[bool]] = {}
        for t, r in zip(tasks, right):
            by_task.setdefault(t, []).append(r)
        quality = sum(right) / len(right)
        per_task = {t: sum(v) / len(v) for t, v in by_task.items()}
    else:
        full = max(engine.rt.tiers.values(), key=lambda t: sum(t.experts_per_layer))
        ref, _, _ = _run(engine, prompts, params, full.name)
        agree = total = 0
        for o, r in zip(outs, ref):
            n = len(r.token_ids)
            total += n
            if o is not None:
                agree += sum(a == b for a, b in zip(o.token_ids, r.token_ids))
        quality, per_task = agree / max(1, total), None
    costs = [o.cost for o in served if o.cost is not None]
    lat = [c.latency_ms for c in costs]
    tok = [c.per_token_ms for c in costs if c.per_token_ms is not None]
    limits = Counter()
    met = Counter()
    for c in costs:
        for k, ok in c.budget_met.items():
            limits[k] += 1
            met[k] += ok
    result = {
        "overrides": _overrides(),
        "tier": s.tier,
        "mode": plain["pipeline"]["stages"].get("select_tier", {}).get("params", {}).get("mode", "fixed"),
        "budget": {k: plain.get("budget", {}).get(k) for k in ("latency_cost_ms", "latency_per_token_ms",
                                                                 "monetary_cost_units")},
        "cost_model": costs[0].cost_model if costs else None,
        "requests": len(prompts),
        "rejected": rejected,
        "quality": quality,
        "accuracy_by_task": per_task,
        # p50 / p99 of the served requests; p50_all of every request, a rejected one never answered (None where
        # half or more were rejected): what a user of the job sees, and what the report's frontier compares
        "latency_ms": {"p50": _pct(lat, 0.5), "p99": _pct(lat, 0.99), "mean": statistics.fmean(lat) if lat else None,
                       "p50_all": _pct(lat, 0.5, len(prompts) - len(lat))},
        "per_token_ms": {"p50": _pct(tok, 0.5), "p99": _pct(tok, 0.99)},
        "tokens_per_s": sum(len(o.token_ids) for o in served) / seconds if served and seconds > 0 else None,
        "seconds": seconds,
        "monetary": {"total": sum(c.monetary for c in costs), "mean": statistics.fmean([c.monetary for c in costs])
                     if costs else None},
        "budget_compliance": {k: met[k] / limits[k] for k in limits},
        "tiers_chosen": dict(Counter(c.tier for c in costs)),
    }
    path = write_json(result, "sweep.json")
    label = s.tier or f"mode={result['mode']}"
    budget = ", ".join(f"{k} {v}" for k, v in result["budget"].items() if v is not None) or "none"
    print(f"{label} (budget: {budget}): quality {quality:.3f}, latency p50 {fmt(result['latency_ms']['p50'], '.1f')} "
          f"ms, {fmt(result['tokens_per_s'], '.0f')} tokens/s, money per request "
          f"{fmt(result['monetary']['mean'], '.5f')}, rejected {rejected} of {len(prompts)}; wrote {path}")
    return result


def fmt(value: float | None, spec: str) -> str:
    """``value`` formatted, or "-" where nothing was measured (every request rejected)."""
    return "-" if value is None else format(value, spec)


def _overrides() -> list[str]:
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except (ImportError, ValueError):
        return []


def load_results(sweep_dir: str | Path) -> list[dict]:
    """Every ``sweep.json`` under ``sweep_dir`` (a Hydra multirun directory), in job order."""
    root = Path(sweep_dir)
    if not root.is_dir():
        raise ConfigError(f"report.sweep_dir: {root} is not a directory")
    # numeric folder names in numeric order (2 before 10), named ones after them: Hydra's job numbers and any
    # subdir pattern a user picks can share one sweep folder
    found = sorted(root.rglob("sweep.json"), key=lambda p: [(0, int(x), "") if x.isdigit() else (1, 0, x) for x in p.parts])
    if not found:
        raise ConfigError(f"report.sweep_dir: no sweep.json under {root} (run `python -m litellm_pipeline -m "
                          "+recipe=sweep ...` first)")
    out = []
    for p in found:
        r = json.loads(p.read_text())
        r["path"] = str(p)
        out.append(r)
    return out
