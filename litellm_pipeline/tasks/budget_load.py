"""``+recipe=budget_load``: cost-adaptive routing under load, shown.

Requests of several budget classes arrive (Poisson, seeded) faster than the full model can serve them; the
select_tier stage (mode ``balanced``) picks each one's TierSet from its budget, the current load and the
latency it has seen so far. The report gives, per class: requests served and rejected, the TierSets chosen
in each time window, latency-budget compliance (goal >= 95%) and monetary compliance (must be 100%).

Latency budgets are multiples (``latency_x``) of the end-to-end latency of one request alone at every
expert, measured at the start, so a class means the same on any machine; money is absolute.
"""

from __future__ import annotations

import random
import statistics
import time
from collections import Counter
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from litellm_pipeline.errors import (
    InvalidRequestError,
    OverloadedError,
    section_settings,
)
from litellm_pipeline.sampling import SamplingParams


class BudgetClass(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    share: float = Field(gt=0)
    latency_x: float | None = Field(default=None, gt=0)  # latency_cost_ms = this x the full model's alone
    monetary_cost_units: float | None = Field(default=None, gt=0)


class LoadSettings(BaseModel):
    """The ``budget_load:`` config section (see recipes/budget_load.yaml)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    requests: int = Field(default=200, ge=1)
    overload: float = Field(default=2.0, gt=0)  # arrival rate / the full model's throughput in requests per second
    max_tokens: int = Field(default=12, ge=1)
    windows: int = Field(default=4, ge=1)  # time windows of the "TierSets chosen over time" table
    seed: int = 0
    classes: list[BudgetClass] = Field(min_length=1)


def load_settings(section: Any) -> LoadSettings:
    return section_settings(LoadSettings, section, "budget_load")


def workload_prompts(n: int, demo: bool, seed: int) -> list[str]:
    """``n`` prompts for a load: seeded held-out skill prompts on the demo model, else plain text ones
    (``+recipe=budget_load`` and ``+recipe=loadtest`` send the same)."""
    if demo:
        from litellm_pipeline.demo.skills import heldout

        exs = heldout(-(-n // 5), seed=seed + 77)
        random.Random(seed).shuffle(exs)
        return [e.prompt for e in exs][:n]
    from litellm_pipeline.tasks.sweep import TEXT_PROMPTS

    return [TEXT_PROMPTS[i % len(TEXT_PROMPTS)] for i in range(n)]


def _full_tier(engine) -> str:
    return max(engine.rt.tiers.values(), key=lambda t: sum(t.experts_per_layer)).name


def _baseline(engine, prompts: list[str], params: SamplingParams) -> tuple[float, float]:
    """(e2e ms of one request alone at every expert, full-model throughput in requests per second)."""
    full = _full_tier(engine)
    alone = []
    for p in prompts[:3]:
        t0 = time.perf_counter()
        engine.run([engine.add_request(p, params, tier=full)])
        alone.append((time.perf_counter() - t0) * 1e3)
    batch = prompts[: min(len(prompts), 16)]
    t0 = time.perf_counter()
    engine.run([engine.add_request(p, params, tier=full) for p in batch])
    rate = len(batch) / (time.perf_counter() - t0)
    return statistics.median(alone[1:] or alone), rate


def run_load(engine, s: LoadSettings, demo: bool) -> dict:
    params = SamplingParams(max_tokens=s.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = workload_prompts(s.requests, demo, s.seed)
    base_ms, full_rate = _baseline(engine, prompts, params)
    rate = s.overload * full_rate
    rng = random.Random(f"budget_load:{s.seed}")
    shares = [c.share for c in s.classes]
    t, arrivals = 0.0, []
    for i, p in enumerate(prompts):
        t += rng.expovariate(rate)
        c = rng.choices(s.classes, shares)[0]
        budget = {"latency_cost_ms": c.latency_x * base_ms if c.latency_x else None,
                  "monetary_cost_units": c.monetary_cost_units}
        arrivals.append((t, c.name, p, {k: v for k, v in budget.items() if v is not None} or None))
    results: list[dict] = []
    live: dict[str, dict] = {}
    start = time.perf_counter()
    nxt = 0
    while nxt < len(arrivals) or engine.has_unfinished():
        now = time.perf_counter() - start
        while nxt < len(arrivals) and arrivals[nxt][0] <= now:
            at, cls, p, budget = arrivals[nxt]
            nxt += 1
            try:
                req = engine.add_request(p, params, budget=budget)
                live[req.request_id] = {"class": cls, "arrival_s": at}
            except InvalidRequestError as exc:
                if exc.field != "budget":
                    raise
                results.append({"class": cls, "arrival_s": at, "rejected": True, "reason": "budget"})
            except OverloadedError:  # admitting it would make requests in flight miss their budgets
                results.append({"class": cls, "arrival_s": at, "rejected": True, "reason": "overloaded"})
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(0.01, arrivals[nxt][0] - now)) if nxt < len(arrivals) else 0.0)
            continue
        for o in engine.step():
            if o.finished and o.request_id in live:
                rec = live.pop(o.request_id)
                c = o.cost
                results.append({**rec, "rejected": False, "tier": c.tier, "latency_ms": c.latency_ms,
                                "monetary": c.monetary, "met": dict(c.budget_met), "finish": o.finish_reason})
    elapsed = time.perf_counter() - start
    return _summarise(results, s, base_ms, full_rate, rate, elapsed)


def _summarise(results, s: LoadSettings, base_ms, full_rate, rate, elapsed) -> dict:
    horizon = max(r["arrival_s"] for r in results) + 1e-9
    per_class = {}
    for c in s.classes:
        rows = [r for r in results if r["class"] == c.name]
        served = [r for r in rows if not r["rejected"]]
        windows = [Counter() for _ in range(s.windows)]
        for r in served:
            windows[min(s.windows - 1, int(r["arrival_s"] / horizon * s.windows))][r["tier"]] += 1
        windows = [dict(w) for w in windows]

        def share(key):
            had = [r["met"][key] for r in served if key in r["met"]]
            return sum(had) / len(had) if had else None

        lat = [r["latency_ms"] for r in served]
        per_class[c.name] = {
            "requests": len(rows), "served": len(served), "rejected": len(rows) - len(served),
            "latency_budget_ms": c.latency_x * base_ms if c.latency_x else None,
            "monetary_budget": c.monetary_cost_units,
            "latency_compliance": share("latency_cost_ms"),
            "monetary_compliance": share("monetary_cost_units"),
            "latency_ms_p50": statistics.median(lat) if lat else None,
            "tiers_by_window": windows,
        }
    return {"baseline_full_alone_ms": base_ms, "full_model_requests_per_s": full_rate,
            "arrival_requests_per_s": rate, "seconds": elapsed, "classes": per_class}


def format_report(r: dict) -> str:
    lines = [f"arrivals {r['arrival_requests_per_s']:.1f} req/s against {r['full_model_requests_per_s']:.1f} req/s "
             f"the full model serves; latency budgets are multiples of {r['baseline_full_alone_ms']:.1f} ms "
             f"(one request alone at every expert)"]
    head = f"{'class':<10}{'served':>8}{'rejected':>9}{'lat budget':>12}{'lat met':>9}{'money met':>10}  TierSets by window"
    lines += [head, "-" * len(head)]
    for name, c in r["classes"].items():
        lb = f"{c['latency_budget_ms']:.0f} ms" if c["latency_budget_ms"] else "-"
        lm = f"{c['latency_compliance']:.0%}" if c["latency_compliance"] is not None else "-"
        mm = f"{c['monetary_compliance']:.0%}" if c["monetary_compliance"] is not None else "-"
        wins = " | ".join(", ".join(f"{t} {n}" for t, n in sorted(w.items(), key=lambda kv: -kv[1])) or "-"
                          for w in c["tiers_by_window"])
        lines.append(f"{name:<10}{c['served']:>8}{c['rejected']:>9}{lb:>12}{lm:>9}{mm:>10}  {wins}")
    return "\n".join(lines)


def run(cfg) -> dict:
    from litellm_pipeline.config.build import build_engine, to_plain
    from litellm_pipeline.tasks import write_json

    plain = to_plain(cfg)
    s = load_settings(plain.get("budget_load"))
    engine = build_engine(plain)
    result = run_load(engine, s, plain["model"].get("path") is None)
    print(format_report(result))
    path = write_json(result, "budget_load.json")
    print(f"wrote {path}")
    return result
