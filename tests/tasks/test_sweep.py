"""Sweeps through Hydra multirun (basic, joblib and submitit-local launchers) and the report they feed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from litellm_pipeline.tasks.report import label, markdown, pareto

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


def test_pareto_frontier_and_labels():
    pts = [(1.0, 0.5), (2.0, 0.9), (1.5, 0.4), (3.0, 0.9), (0.5, 0.1)]
    assert pareto(pts) == [4, 0, 1]
    r = {"overrides": ["+recipe=sweep", "sweep.tier=deep"], "tier": "deep"}
    assert label(r) == "sweep.tier=deep" and label({"overrides": [], "tier": None, "mode": "balanced"}) == "mode=balanced"
    row = {"overrides": [], "tier": "fast", "quality": 0.5, "latency_ms": {"p50": 2.0, "p99": 3.0},
           "tokens_per_s": 10.0, "monetary": {"mean": 0.001, "total": 0.01}, "budget_compliance": {}, "rejected": 2,
           "tiers_chosen": {"fast": 8}}
    assert "| fast | 0.500 | 2.0 | 3.0 | 10 | 0.00100 | - (2 rejected) | fast 8 | latency/money |" in markdown([row])


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
