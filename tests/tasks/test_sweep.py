"""Sweeps through Hydra multirun (basic, joblib and submitit-local launchers) and the report they feed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from litellm_pipeline.tasks.report import label, labels, latency, markdown, pareto, rows, shared

QUICK = ["sweep.per_task=2", "sweep.max_tokens=8"]


def run(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "litellm_pipeline", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ})
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def jobs(root: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(root.rglob("sweep.json"))]


def test_tier_sweep_then_report_end_to_end(tmp_path):
    sweep_dir = tmp_path / "sweep"
    run(["-m", "+recipe=sweep", "sweep.tier=fast,max", *QUICK, f"hydra.sweep.dir={sweep_dir}"], tmp_path)
    found = jobs(sweep_dir)
    assert sorted(j["tier"] for j in found) == ["fast", "max"]
    for j in found:
        assert j["requests"] == 10 and 0.0 <= j["quality"] <= 1.0 and set(j["accuracy_by_task"]) == {
            "add", "reverse", "sort", "copy", "recall"}
        assert j["latency_ms"]["p50"] > 0 and j["tokens_per_s"] > 0 and j["monetary"]["total"] > 0
        assert j["tiers_chosen"] == {j["tier"]: 10} and f"sweep.tier={j['tier']}" in j["overrides"]
    money = {j["tier"]: j["monetary"]["total"] for j in found}
    assert money["fast"] < money["max"]  # fast's prices are a quarter of max's
    proc = run(["+recipe=report", f"report.sweep_dir={sweep_dir}"], tmp_path)
    table = (sweep_dir / "report.md").read_text()
    assert "sweep.tier=fast" in table and "sweep.tier=max" in table and table in proc.stdout
    assert (sweep_dir / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_budget_sweep_with_the_joblib_launcher_reports_compliance(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    sweep_dir = tmp_path / "sweep"
    run(["-m", "+recipe=sweep", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
         "pipeline.stages.select_tier.params.mode=balanced", "budget.monetary_cost_units=0.0075,1.0", *QUICK,
         f"hydra.sweep.dir={sweep_dir}"], tmp_path)
    found = {j["budget"]["monetary_cost_units"]: j for j in jobs(sweep_dir)}
    assert set(found) == {0.0075, 1.0}
    for cap, j in found.items():
        assert j["mode"] == "balanced"
        served = j["requests"] - j["rejected"]
        if served:
            assert j["budget_compliance"]["monetary_cost_units"] == 1.0  # money is a hard limit
            assert j["monetary"]["mean"] <= cap
    assert found[0.0075]["monetary"]["total"] < found[1.0]["monetary"]["total"]


def test_submitit_local_launcher_runs_a_job(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep_dir = tmp_path / "sweep"
    run(["-m", "+recipe=sweep", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10",
         "sweep.tier=fast", *QUICK, f"hydra.sweep.dir={sweep_dir}"], tmp_path)
    (j,) = jobs(sweep_dir)
    assert j["tier"] == "fast" and j["requests"] == 10


def test_the_slurm_launcher_config_composes(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    out = run(["+recipe=sweep", "hydra/launcher=slurm", "--cfg", "hydra", "-p", "hydra.launcher"], tmp_path).stdout
    assert "SlurmLauncher" in out and "cpus_per_task: 2" in out and "timeout_min: 60" in out


def _job(tier, cap, quality, p50, money, rejected=0, requests=10, extra=()):
    return {"overrides": ["+recipe=sweep", "sweep.per_task=2", f"sweep.tier={tier}",
                          f"budget.monetary_cost_units={cap}", *extra],
            "tier": tier, "mode": "fixed", "budget": {"monetary_cost_units": cap, "latency_cost_ms": None},
            "requests": requests, "rejected": rejected, "quality": quality,
            "latency_ms": {"p50": p50, "p99": 2 * p50, "p50_all": p50 if 2 * rejected < requests else None},
            "tokens_per_s": 100.0, "monetary": {"mean": money, "total": money * (requests - rejected)},
            "budget_compliance": {"monetary_cost_units": 1.0}, "tiers_chosen": {tier: requests - rejected}}


def test_pareto_frontier_and_labels():
    pts = [(1.0, 0.5), (2.0, 0.9), (1.5, 0.4), (3.0, 0.9), (0.5, 0.1)]
    assert pareto(pts) == [4, 0, 1]
    r = {"overrides": ["+recipe=sweep", "sweep.tier=deep"], "tier": "deep"}
    assert label(r) == "sweep.tier=deep" and label({"overrides": [], "tier": None, "mode": "balanced"}) == "mode=balanced"
    jobs_ = [_job("fast", 0.012, 0.8, 2.0, 0.001), _job("max", 0.012, 0.99, 5.0, 0.004)]
    # what every job shares is said once; a point is named by what differs
    assert labels(jobs_) == ["sweep.tier=fast", "sweep.tier=max"]
    assert shared(jobs_) == ["sweep.per_task=2", "budget.monetary_cost_units=0.012"]
    table = markdown(jobs_)
    assert table.startswith("Every job ran with: sweep.per_task=2 budget.monetary_cost_units=0.012")
    assert ("| 1 | sweep.tier=fast | fast | monetary <= 0.012 | 0.800 | 2.0 | 2.0 | 4.0 | 100 | 0.00100 | 0 of 10 |"
            in table)


def test_the_frontier_counts_rejected_requests_as_failures():
    """A job that rejects 6 of its 10 requests (quality 0.1, the 4 it served fast and cheap) has no latency over
    every request: not on the latency frontier (nor drawn there), where it would dominate with its served p50."""
    jobs_ = [_job("fast", 0.005, 0.1, 0.5, 0.0005, rejected=6), _job("fast", 1.0, 0.8, 2.0, 0.001),
             _job("max", 1.0, 0.99, 5.0, 0.004)]
    cells = {r[0]: r for r in rows(jobs_)}
    assert cells["1"][5] == "-" and cells["1"][6] == "0.5" and cells["1"][10] == "6 of 10"
    assert "latency" not in cells["1"][-1] and cells["1"][-1] == "money"  # cheapest: on the money frontier
    assert cells["2"][-1] == "latency/money" and cells["3"][-1] == "latency/money"
    # an older sweep.json without p50_all: half or more rejected has no latency either
    old = {**jobs_[0], "latency_ms": {"p50": 0.5, "p99": 1.0}}
    assert latency(old) is None and latency({**old, "rejected": 4}) == 0.5


def test_points_drawn_on_one_another_share_one_label():
    """Jobs at the same money and quality (a fixed tier under several money budgets) are labelled "1,2,5", not
    with numbers printed over each other; points apart keep their own labels."""
    from litellm_pipeline.tasks.report import point_groups

    pts = [(0.005, 0.77), (0.005, 0.77), (0.010, 1.0), (0.0150, 1.0), (0.00502, 0.771), (0.015, 0.5)]
    assert point_groups(pts) == [((0.005, 0.77), [0, 1, 4]), ((0.010, 1.0), [2]), ((0.015, 1.0), [3]),
                                 ((0.015, 0.5), [5])]
    assert point_groups([]) == [] and point_groups([(1.0, 1.0)]) == [((1.0, 1.0), [0])]


@pytest.mark.parametrize("n", [2, 8, 24, 40])
def test_report_plot_reads_at_2_to_40_jobs_without_warnings(tmp_path, n):
    """Tiers coloured, budgets marked, one legend, no warning from matplotlib (tight layout, crowded ticks), jobs
    numbered as in the table, which names them by what differs; the CSV holds the table."""
    import warnings

    import matplotlib.image as mpimg

    from litellm_pipeline.tasks import report

    tiers = ["fast", "balanced", "deep", "max"]
    caps = [0.003, 0.006, 0.012, 0.024, 0.048, 0.096, 0.192, 0.384, 0.768, 1.5]
    jobs_ = [_job(tiers[i % 4], caps[i // 4 % 10], 0.5 + 0.05 * (i % 4) + 0.001 * i, 1.0 + i % 4 + 0.01 * i,
                  0.001 * (1 + i % 4)) for i in range(n)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        png = report.plot(jobs_, tmp_path / "p.png")
    img = mpimg.imread(png)
    assert img.shape[0] >= 500 and img.shape[1] >= 1200
    names = report.labels(jobs_)
    assert all("sweep.per_task" not in x for x in names)  # shared: said once
    csv_path = report.write_csv(jobs_, tmp_path / "r.csv")
    import csv

    with csv_path.open() as f:
        got = list(csv.reader(f))
    assert got[0] == list(report.COLUMNS) and len(got) == n + 1 and got[1][2] == "fast"


def test_report_without_a_sweep_dir_names_the_key(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "litellm_pipeline", "+recipe=report", f"report.sweep_dir={tmp_path}",
                           f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "no sweep.json under" in proc.stderr


def test_results_load_in_job_order_whatever_the_folder_names(tmp_path):
    from litellm_pipeline.tasks.sweep import load_results

    for name in ("10", "2", "b1", "b0"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "sweep.json").write_text(json.dumps({"job": name}))
    assert [r["job"] for r in load_results(tmp_path)] == ["2", "10", "b0", "b1"]


def test_a_checkpoint_sweep_scores_the_full_model_as_itself(tmp_path, hf_checkpoint):
    """Beyond the demo model quality is the share of greedy tokens equal to the full model's: 1.0 at the full
    model, every tier making max_tokens tokens (a run that stops at EOS would count its missing tokens)."""
    ck = hf_checkpoint("qwen3_moe")
    sweep_dir = tmp_path / "sweep"
    run(["-m", "+recipe=sweep", f"model.path={ck}", "sweep.tier=max", *QUICK, f"hydra.sweep.dir={sweep_dir}"],
        tmp_path)
    (job,) = jobs(sweep_dir)
    assert job["quality"] == 1.0 and job["accuracy_by_task"] is None


def test_an_unknown_sweep_tier_is_refused_before_the_model_loads(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "litellm_pipeline", "+recipe=sweep", "sweep.tier=nosuch",
                           "model.path=/nonexistent/checkpoint", f"hydra.run.dir={tmp_path}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    # the checkpoint path does not exist: had the engine been built first, that would be the error
    assert proc.returncode != 0 and "sweep.tier: unknown tier 'nosuch'" in proc.stderr + proc.stdout
    assert "fast, balanced, deep, max" in proc.stderr + proc.stdout
