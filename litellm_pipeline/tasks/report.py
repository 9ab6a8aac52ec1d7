"""``+recipe=report report.sweep_dir=DIR``: a Markdown table and a Pareto plot of a sweep's ``sweep.json`` files.

One row / point per job: quality against end-to-end latency p50 and against monetary cost per request. A job is
on the frontier of a panel when no other job has at least its quality at no more latency (or money) and is
strictly better in one of the two; the frontier is drawn through those jobs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from litellm_pipeline.errors import ConfigError, section_settings
from litellm_pipeline.tasks.sweep import fmt, load_results


class ReportSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    sweep_dir: str | None = None
    out_dir: str | None = None  # null: sweep_dir


def report_settings(section: Any) -> ReportSettings:
    s = section_settings(ReportSettings, section, "report")
    if s.sweep_dir is None:
        raise ConfigError("report.sweep_dir: name the multirun directory of a sweep (report.sweep_dir=multirun/...)")
    return s


def label(r: dict) -> str:
    """What distinguishes a job: its command-line overrides (the sweep's own keys), else its tier / mode."""
    keep = [o for o in r.get("overrides", []) if not o.startswith(("+recipe=", "hydra."))]
    return " ".join(keep) if keep else (r.get("tier") or f"mode={r.get('mode')}")


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points (cost, quality) no other point dominates (lower cost, higher quality), by cost."""
    idx = []
    for i, (c, q) in enumerate(points):
        dominated = any((c2 <= c and q2 >= q) and (c2 < c or q2 > q) for j, (c2, q2) in enumerate(points) if j != i)
        if not dominated:
            idx.append(i)
    return sorted(idx, key=lambda i: (points[i][0], -points[i][1]))


def _money(r: dict) -> float:
    return r["monetary"]["mean"] if r["monetary"]["mean"] is not None else 0.0


def _served(results: list[dict]) -> list[int]:
    return [i for i, r in enumerate(results) if r["latency_ms"]["p50"] is not None]


def _front(results: list[dict], x_of) -> set[int]:
    """Indices (into ``results``) on the frontier of quality against ``x_of``, among jobs that served anything."""
    keep = _served(results)
    return {keep[j] for j in pareto([(x_of(results[i]), results[i]["quality"]) for i in keep])}


def markdown(results: list[dict]) -> str:
    lat_front = _front(results, lambda r: r["latency_ms"]["p50"])
    money_front = _front(results, _money)
    lines = [
        "| run | quality | latency p50 ms | latency p99 ms | tokens/s | money / request | budget met | tiers chosen | frontier |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(results):
        comp = ", ".join(f"{k} {v:.0%}" for k, v in r["budget_compliance"].items()) or "-"
        if r.get("rejected"):
            comp += f" ({r['rejected']} rejected)"
        tiers = ", ".join(f"{t} {n}" for t, n in sorted(r["tiers_chosen"].items(), key=lambda kv: -kv[1]))
        front = "/".join(x for x, on in (("latency", i in lat_front), ("money", i in money_front)) if on) or ""
        lines.append(
            f"| {label(r)} | {r['quality']:.3f} | {fmt(r['latency_ms']['p50'], '.1f')} | "
            f"{fmt(r['latency_ms']['p99'], '.1f')} | {fmt(r['tokens_per_s'], '.0f')} | {_money(r):.5f} | {comp} | "
            f"{tiers or '-'} | {front} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=100)
    panels = (("latency p50 (ms)", lambda r: r["latency_ms"]["p50"] or 0.0), ("monetary cost per request", _money))
    results = [results[i] for i in _served(results)]
    for ax, (xlabel, x_of) in zip(axes, panels):
        pts = [(x_of(r), r["quality"]) for r in results]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], zorder=3)
        for (x, y), r in zip(pts, results):
            ax.annotate(label(r), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        front = pareto(pts)
        ax.step([pts[i][0] for i in front], [pts[i][1] for i in front], where="post", color="tab:red", lw=1.2,
                label="Pareto frontier", zorder=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("quality")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle("quality against latency and cost, one point per sweep job")
    fig.tight_layout()
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
    png = plot(results, out / "pareto.png")
    print(table)
    print(f"wrote {out / 'report.md'} and {png}")
    return {"runs": len(results), "table": table, "plot": str(png)}
