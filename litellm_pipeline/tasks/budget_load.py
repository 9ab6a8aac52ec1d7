"""``+recipe=budget_load``: cost-adaptive routing under load, shown.

Requests of several budget classes arrive (Poisson, seeded) faster than the full model can serve them; the
select_tier stage (mode ``balanced``) picks each one's TierSet from its budget, the current load and the
latency it has seen so far. The report gives, per class: requests served and rejected, the TierSets chosen
in each time window, latency-budget compliance (goal >= 95%) and monetary compliance (must be 100%).

Latency budgets are multiples (``latency_x``) of the end-to-end latency of one request alone at every
expert, measured at the start, so a class means the same on any machine; money is absolute.

The load runs ``repeats`` times (seeds ``seed``, ``seed + 1``, ...) on one engine; each class's compliance is
given per repeat and pooled with a 95% Wilson interval, and its rejections by reason (``budget``: its own
budget no longer fits; ``overloaded``: admitting it would make requests in flight miss theirs). Beside the
figures stands the CPU time other processes used during each repeat (cores): a 2-core machine shared with
anything else breaks any latency prediction, and the report says so where it happened.
"""

from __future__ import annotations

import math
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
    repeats: int = Field(default=3, ge=1)  # seeds seed .. seed + repeats - 1, pooled with a confidence interval
    busy_cores: float = Field(default=0.3, ge=0)  # other processes' CPU use above which a repeat is flagged
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
            "rejected_by_reason": dict(Counter(r["reason"] for r in rows if r["rejected"])),
            "latency_met": sum(r["met"]["latency_cost_ms"] for r in served if "latency_cost_ms" in r["met"]),
            "latency_budgeted": sum("latency_cost_ms" in r["met"] for r in served),
            "monetary_met": sum(r["met"]["monetary_cost_units"] for r in served if "monetary_cost_units" in r["met"]),
            "monetary_budgeted": sum("monetary_cost_units" in r["met"] for r in served),
            "latency_budget_ms": c.latency_x * base_ms if c.latency_x else None,
            "monetary_budget": c.monetary_cost_units,
            "latency_compliance": share("latency_cost_ms"),
            "monetary_compliance": share("monetary_cost_units"),
            "latency_ms_p50": statistics.median(lat) if lat else None,
            "tiers_by_window": windows,
        }
    return {"baseline_full_alone_ms": base_ms, "full_model_requests_per_s": full_rate,
            "arrival_requests_per_s": rate, "seconds": elapsed, "classes": per_class}


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
    """The 95% Wilson score interval of k successes in n trials (None for n = 0)."""
    if n == 0:
        return None
    p = k / n
    d = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    # it always holds p: where rounding puts a bound a hair past it (k = 0 or k = n), the bound is p itself
    return max(0.0, min(mid - half, p)), min(1.0, max(mid + half, p))


def pool(runs: list[dict], busy_cores: float) -> dict:
    """The repeats of one load pooled: per class the counts summed, compliance per repeat and pooled with its
    Wilson interval, rejections by reason; each repeat's contention and whether it was busy."""
    classes = {}
    for name in runs[0]["classes"]:
        per = [r["classes"][name] for r in runs]
        out = {k: sum(c[k] for c in per) for k in ("requests", "served", "rejected", "latency_met",
                                                  "latency_budgeted", "monetary_met", "monetary_budgeted")}
        out["rejected_by_reason"] = dict(sum((Counter(c["rejected_by_reason"]) for c in per), Counter()))
        for key in ("latency", "monetary"):
            out[f"{key}_compliance"] = (out[f"{key}_met"] / out[f"{key}_budgeted"] if out[f"{key}_budgeted"]
                                        else None)
            out[f"{key}_ci95"] = wilson(out[f"{key}_met"], out[f"{key}_budgeted"])
            out[f"{key}_by_repeat"] = [c[f"{key}_compliance"] for c in per]
        out["latency_budget_ms"] = [c["latency_budget_ms"] for c in per]
        out["monetary_budget"] = per[0]["monetary_budget"]
        classes[name] = out
    cores = [r.get("other_cores") for r in runs]  # None: not measured
    return {"repeats": runs, "classes": classes, "other_cores": cores,
            "busy": [c is not None and c > busy_cores for c in cores]}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _ci(ci: tuple[float, float] | None) -> str:
    return "" if ci is None else f" [{ci[0]:.0%}, {ci[1]:.0%}]"


def format_report(r: dict) -> str:
    first = r["repeats"][0]
    lines = [f"{len(r['repeats'])} repeat(s); arrivals {first['arrival_requests_per_s']:.1f} req/s against "
             f"{first['full_model_requests_per_s']:.1f} req/s the full model serves; latency budgets are multiples "
             f"of {first['baseline_full_alone_ms']:.1f} ms (one request alone at every expert, measured per repeat)"]
    cores = ", ".join("-" if c is None else f"{c:.2f}" for c in r["other_cores"])
    lines.append(f"other processes' CPU use per repeat (cores): {cores}")
    if any(r["busy"]):
        lines.append("  busy in repeat(s) " + ", ".join(str(i + 1) for i, b in enumerate(r["busy"]) if b) +
                     ": another process took CPU time there, so latency predictions could not hold; read those "
                     "repeats' latency compliance with that in mind, or rerun on a quiet machine")
    head = (f"{'class':<10}{'served':>8}{'rejected (budget / overloaded)':>32}  {'latency met [95% CI]':<24}"
            f"{'per repeat':<18}{'money met [95% CI]':<22}")
    lines += [head, "-" * len(head)]
    for name, c in r["classes"].items():
        why = c["rejected_by_reason"]
        rej = f"{c['rejected']} ({why.get('budget', 0)} / {why.get('overloaded', 0)})"
        lat = _pct(c["latency_compliance"]) + _ci(c["latency_ci95"])
        reps = " ".join(_pct(x) for x in c["latency_by_repeat"])
        money = _pct(c["monetary_compliance"]) + _ci(c["monetary_ci95"])
        lines.append(f"{name:<10}{c['served']:>8}{rej:>32}  {lat:<24}{reps:<18}{money:<22}")
    lines.append("TierSets chosen by time window (first repeat):")
    for name, c in first["classes"].items():
        wins = " | ".join(", ".join(f"{t} {n}" for t, n in sorted(w.items(), key=lambda kv: -kv[1])) or "-"
                          for w in c["tiers_by_window"])
        lines.append(f"  {name:<10}{wins}")
    return "\n".join(lines)


def run(cfg) -> dict:
    from litellm_pipeline.bench.machine import CpuMonitor
    from litellm_pipeline.config.build import build_engine, to_plain
    from litellm_pipeline.tasks import write_json

    plain = to_plain(cfg)
    s = load_settings(plain.get("budget_load"))
    engine = build_engine(plain)
    demo = plain["model"].get("path") is None
    runs = []
    for i in range(s.repeats):
        mon = CpuMonitor()
        one = run_load(engine, s.model_copy(update={"seed": s.seed + i}), demo)
        one["other_cores"] = mon.mark(f"repeat {i + 1}")["other_cores"]
        runs.append(one)
    result = pool(runs, s.busy_cores)
    print(format_report(result))
    path = write_json(result, "budget_load.json")
    print(f"wrote {path}")
    return result
