"""``+recipe=report report.sweep_dir=DIR``: a table (Markdown and CSV) and a Pareto plot of a sweep's ``sweep.json``.

One row / point per job: quality against latency and against money per request. Quality counts rejected requests
as failures (the sweep scores them wrong), and the latency the frontier compares is the p50 over every request, a
rejected one never answered (``latency_ms.p50_all``): a job that rejects half its requests has no such latency and
is not drawn on that panel, however fast the few it served. A job is on the frontier of a panel when no other job
has at least its quality at no more latency (or money) and is strictly better in one of the two.

Points are coloured by tier (the job's ``sweep.tier``, else the tier its requests got most) and marked by budget;
on the plot a job is its number in the table, where it is named by the overrides that differ between jobs (those
every job shares are said once, above the table and in the plot's title).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from litellm_pipeline.errors import ConfigError, section_settings
from litellm_pipeline.tasks.sweep import fmt, load_results

_TIER_ORDER = ("fast", "balanced", "deep", "max")
_MARKERS = "osD^vPX*<>ph"


class ReportSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    sweep_dir: str | None = None
    out_dir: str | None = None  # null: sweep_dir


def report_settings(section: Any) -> ReportSettings:
    s = section_settings(ReportSettings, section, "report")
    if s.sweep_dir is None:
        raise ConfigError("report.sweep_dir: name the multirun directory of a sweep (report.sweep_dir=multirun/...)")
    return s


def _own(r: dict) -> list[str]:
    return [o for o in r.get("overrides", []) if not o.startswith(("+recipe=", "hydra."))]


def label(r: dict) -> str:
    """What a job ran: its command-line overrides (the sweep's own keys), else its tier / mode."""
    keep = _own(r)
    return " ".join(keep) if keep else (r.get("tier") or f"mode={r.get('mode')}")


def shared(results: list[dict]) -> list[str]:
    """The overrides every job of a sweep of several jobs ran with (said once, not on every point)."""
    if len(results) < 2:
        return []
    common = set(_own(results[0])).intersection(*(_own(r) for r in results[1:]))
    return [o for o in _own(results[0]) if o in common]


def labels(results: list[dict]) -> list[str]:
    """Per job, the overrides that differ between the jobs; a job with none named by its tier / mode."""
    common = set(shared(results))
    out = []
    for r in results:
        keep = [o for o in _own(r) if o not in common]
        out.append(" ".join(keep) if keep else (r.get("tier") or f"mode={r.get('mode')}"))
    return out


def tier_of(r: dict) -> str:
    """The job's tier: ``sweep.tier``, else the one its requests got most (``none`` if it served nothing)."""
    if r.get("tier"):
        return r["tier"]
    chosen = r.get("tiers_chosen") or {}
    return max(chosen, key=lambda t: (chosen[t], t)) if chosen else "none"


def budget_of(r: dict) -> str:
    """The job's budget as the limits it set (``no budget`` where none)."""
    b = {k: v for k, v in (r.get("budget") or {}).items() if v is not None}
    return ", ".join(f"{k.replace('_cost_units', '').replace('_cost_ms', ' ms').replace('_ms', ' ms')} <= {v:g}"
                     for k, v in sorted(b.items())) or "no budget"


def latency(r: dict) -> float | None:
    """p50 latency over every request, rejected ones never answered (older sweep.json files: None where half or
    more were rejected, else the served p50)."""
    lat = r["latency_ms"]
    if "p50_all" in lat:
        return lat["p50_all"]
    return None if 2 * r.get("rejected", 0) >= r.get("requests", 1) else lat["p50"]


def money(r: dict) -> float | None:
    """Money per served request (what a request is charged; None where nothing was served)."""
    return r["monetary"]["mean"]


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points (cost, quality) no other point dominates (lower cost, higher quality), by cost."""
    idx = []
    for i, (c, q) in enumerate(points):
        dominated = any((c2 <= c and q2 >= q) and (c2 < c or q2 > q) for j, (c2, q2) in enumerate(points) if j != i)
        if not dominated:
            idx.append(i)
    return sorted(idx, key=lambda i: (points[i][0], -points[i][1]))


def _front(results: list[dict], x_of) -> set[int]:
    """Indices (into ``results``) on the frontier of quality against ``x_of``, among jobs where it is known."""
    keep = [i for i, r in enumerate(results) if x_of(r) is not None and math.isfinite(x_of(r))]
    return {keep[j] for j in pareto([(x_of(results[i]), results[i]["quality"]) for i in keep])}


COLUMNS = ("#", "run", "tier", "budget", "quality", "latency p50 ms (all)", "latency p50 ms (served)",
           "latency p99 ms (served)", "tokens/s", "money / request", "rejected", "budget met", "tiers chosen",
           "frontier")


def rows(results: list[dict]) -> list[list[str]]:
    """The table's cells, a row per job (the columns of ``COLUMNS``)."""
    lat_front, money_front = _front(results, latency), _front(results, money)
    out = []
    for i, (r, name) in enumerate(zip(results, labels(results))):
        comp = ", ".join(f"{k} {v:.0%}" for k, v in r["budget_compliance"].items()) or "-"
        tiers = ", ".join(f"{t} {n}" for t, n in sorted(r["tiers_chosen"].items(), key=lambda kv: -kv[1]))
        front = "/".join(x for x, on in (("latency", i in lat_front), ("money", i in money_front)) if on)
        out.append([str(i + 1), name, tier_of(r), budget_of(r), f"{r['quality']:.3f}", fmt(latency(r), ".1f"),
                    fmt(r["latency_ms"]["p50"], ".1f"), fmt(r["latency_ms"]["p99"], ".1f"),
                    fmt(r["tokens_per_s"], ".0f"), fmt(money(r), ".5f"),
                    f"{r.get('rejected', 0)} of {r.get('requests', '?')}", comp, tiers or "-", front])
    return out


def markdown(results: list[dict]) -> str:
    common = shared(results)
    head = f"Every job ran with: {' '.join(common)}\n\n" if common else ""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows(results)]
    return head + "\n".join(lines) + "\n"


def write_csv(results: list[dict], path: Path) -> Path:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        w.writerows(rows(results))
    return path


def point_groups(points: list[tuple[float, float]], near: float = 0.012) -> list[tuple[tuple[float, float], list[int]]]:
    """The points (x, y) grouped where they would be drawn on one another: within ``near`` of each axis's span
    of each other (single linkage). Each group: its first point and the indices in it, in order."""
    if not points:
        return []
    spans = [max(v) - min(v) or 1.0 for v in zip(*points)]
    group = list(range(len(points)))

    def root(i):
        while group[i] != i:
            i = group[i]
        return i

    for i, a in enumerate(points):
        for j in range(i):
            if all(abs(u - v) <= near * s for u, v, s in zip(a, points[j], spans)):
                group[root(i)] = root(j)
    out: dict[int, list[int]] = {}
    for i in range(len(points)):
        out.setdefault(root(i), []).append(i)
    return [(points[m[0]], m) for m in sorted(out.values())]


def plot(results: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    tiers = sorted({tier_of(r) for r in results},
                   key=lambda t: (_TIER_ORDER.index(t) if t in _TIER_ORDER else len(_TIER_ORDER), t))
    budgets = list(dict.fromkeys(budget_of(r) for r in results))
    cmap = plt.get_cmap("tab10")
    colour = {t: cmap(i % 10) for i, t in enumerate(tiers)}
    marker = {b: _MARKERS[i % len(_MARKERS)] for i, b in enumerate(budgets)}
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.2), dpi=100, layout="constrained")
    panels = (("latency p50 over every request (ms)", latency), ("money per served request", money))
    for ax, (xlabel, x_of) in zip(axes, panels):
        shown = [i for i, r in enumerate(results) if x_of(r) is not None and math.isfinite(x_of(r))]
        for i in shown:
            r = results[i]
            ax.scatter(x_of(r), r["quality"], color=colour[tier_of(r)], marker=marker[budget_of(r)], s=46,
                       edgecolors="black", linewidths=0.4, zorder=3)
        pts = [(x_of(results[i]), results[i]["quality"]) for i in shown]
        for (x, q), members in point_groups(pts):  # points drawn on one another get one label: "1,2,5"
            ax.annotate(",".join(str(shown[j] + 1) for j in members), (x, q), textcoords="offset points",
                        xytext=(4, 3), fontsize=7, zorder=4).set_in_layout(False)
        front = pareto(pts)
        if front:
            ax.step([pts[j][0] for j in front], [pts[j][1] for j in front], where="post", color="tab:red", lw=1.2,
                    zorder=2)
        missing = len(results) - len(shown)
        ax.set_xlabel(xlabel + (f"\n{missing} job(s) not drawn: half or more of their requests rejected"
                                if missing else ""))
        ax.set_ylabel("quality (rejected requests count as failures)")
        ax.xaxis.set_major_locator(MaxNLocator(nbins=6))
        ax.ticklabel_format(axis="x", style="sci", scilimits=(-3, 4), useOffset=False)
        ax.grid(True, alpha=0.3)
    handles = [Line2D([], [], ls="", marker="o", color=colour[t], markeredgecolor="black", label=f"tier {t}")
               for t in tiers]
    handles += [Line2D([], [], ls="", marker=marker[b], color="grey", label=b) for b in budgets]
    handles.append(Line2D([], [], color="tab:red", lw=1.2, label="Pareto frontier"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 6), fontsize=8, frameon=False)
    common = shared(results)
    title = (f"quality against latency and money, {len(results)} sweep jobs (numbered as in report.md; a rejected "
             "request counts as a failure and is never answered)")
    if common:
        title += "\nevery job: " + " ".join(common)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
    return path


def run(cfg) -> dict:
    from litellm_pipeline.config.build import to_plain

    plain = to_plain(cfg)
    s = report_settings(plain.get("report"))
    results = load_results(s.sweep_dir)
    out = Path(s.out_dir or s.sweep_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(results)
    (out / "report.md").write_text(table)
    csv_path = write_csv(results, out / "report.csv")
    png = plot(results, out / "pareto.png")
    print(table)
    print(f"wrote {out / 'report.md'}, {csv_path} and {png}")
    return {"runs": len(results), "table": table, "plot": str(png), "csv": str(csv_path)}
