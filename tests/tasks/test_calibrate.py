"""+recipe=calibrate on the demo model: a profile the solvers load, with costs and quality effects that make sense."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from litellm_pipeline import LLM, SamplingParams
from litellm_pipeline.tasks.calibrate import sequence_logits


def test_sequence_logits_match_the_engine():
    llm = LLM()
    (out,) = llm.generate("rev:abcde=", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3))
    model = llm.engine.rt.model
    ids = out.prompt_token_ids + out.token_ids[:-1]
    logits = sequence_logits(model, ids, None, model.embed_tokens.dtype)
    n = len(out.prompt_token_ids)
    lp = torch.log_softmax(logits[n - 1 :], -1)
    assert lp.argmax(-1).tolist() == out.token_ids
    for row, got in zip(lp, out.logprobs):
        for tok, v in got.items():
            assert abs(float(row[tok]) - v) < 1e-4


@pytest.fixture(scope="module")
def profile_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("calib")
    cmd = [sys.executable, "-m", "litellm_pipeline", "+recipe=calibrate", "calibrate.batch_sizes=[1,4]",
           "calibrate.repeats=1", "calibrate.decode_steps=2", "calibrate.prompts=3", "calibrate.continuation=4",
           "calibrate.accuracy_per_task=2", "calibrate.check_prompts=3", "calibrate.progress=false",
           f"hydra.run.dir={tmp}/run"]
    proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = (tmp / "run").glob("cost_profile-*[!k].json")
    return proc.stdout, path


def test_calibrate_writes_a_profile_the_budget_solvers_load(profile_run):
    stdout, path = profile_run
    assert "embedded-demo-model" in path.name and "wrote" in stdout and "budget.profile=" in stdout
    data = json.loads(path.read_text())
    assert data["model"] == "embedded demo model" and data["choices"] == [1, 2, 4, 8] and len(data["layers"]) == 4
    assert set(data["accuracy"]) == {"fast", "balanced", "deep", "max"}
    for layer in data["layers"]:
        assert all(layer["prefill_ms"][k] > 0 for k in layer["prefill_ms"])
        assert set(layer["decode_ms"]["1"]) == {"1", "4"}
        # the full model agrees with itself: all experts in one layer changes nothing
        assert layer["top1"]["8"] == 1.0 and layer["kl"]["8"] < 1e-6 and layer["quality"]["8"] == 0.0
        assert layer["kl"]["1"] >= layer["kl"]["8"]
    assert data["fixed"]["prefill_ms"] >= 0 and set(data["fixed"]["decode_ms"]) == {"1", "4"}
    # it says what its table holds and whether its timings were stable
    assert "the MoE block's time per decode step at batch 1" in stdout
    t = data["timings"]
    assert t["measured"] == 4 * 4 * 3 + 1 and t["stable_spread"] == 0.1  # layers x k x (prefill, b=1, b=4), prefill
    assert ("timings stable: all 49" in stdout) == (not t["unstable"])
    assert all(u["runs"] >= 4 and u["spread"] > 0.1 for u in t["unstable"])
    # then how far predictions err with the analytic model and with the profile, three prompts one at a time
    check = json.loads(path.with_name(path.stem + "-prediction_check.json").read_text())
    assert set(check) == {"analytic", "profile"}
    for c in check.values():
        assert c["own"]["n"] == c["corrected"]["n"] == 3 and c["first"]["n"] == 1
        assert c["own"]["median_abs"] >= 0 and c["first"]["median_abs"] == abs(c["first"]["mean"])
    assert "latency predictions, 3 prompts one at a time" in stdout and "corrected by the tracker" in stdout
    llm = LLM(overrides=["pipeline.stages.select_tier.params.mode=balanced", f"budget.profile={path}"])
    assert llm.engine.rt.cost_model.source == str(path)
    (o,) = llm.generate("12+34=", SamplingParams(max_tokens=4, temperature=0.0), budget={"monetary_cost_units": 1.0})
    assert o.cost.cost_model == str(path) and o.cost.predicted_latency_ms > 0


def test_timings_repeat_until_stable_or_say_they_are_not(monkeypatch):
    """A timing whose runs spread gets more runs, up to max_repeats, and is named if still spread; a steady one
    stops at four runs (fewer say nothing about spread)."""
    from litellm_pipeline.tasks import calibrate as cal

    clock = [0.0]
    monkeypatch.setattr(cal.time, "perf_counter", lambda: clock[0])
    steady = cal.Timings(repeats=1, stable_spread=0.1, max_repeats=40)
    calls = []

    def run(ms):
        def fn():
            calls.append(1)
            clock[0] += ms() / 1e3
        return fn

    assert steady.median_ms(run(lambda: 2.0), "steady") == pytest.approx(2.0)
    assert len(calls) == 1 + 4 and steady.unstable == []  # a warm-up, then four runs
    flip = iter([1.0, 5.0] * 100)
    noisy = cal.Timings(repeats=2, stable_spread=0.1, max_repeats=10)
    noisy.median_ms(run(lambda: next(flip)), "noisy one")
    assert noisy.unstable == [{"what": "noisy one", "runs": 10, "spread": pytest.approx(1.333, abs=1e-3)}]
    # one slow run (after the warm-up) among steady ones: more runs settle it (8 runs: 4, then 2 more twice)
    slow_first = iter([2.0, 9.0] + [2.0] * 100)
    settles = cal.Timings(repeats=2, stable_spread=0.1, max_repeats=40)
    calls.clear()
    assert settles.median_ms(run(lambda: next(slow_first)), "settles") == pytest.approx(2.0)
    assert settles.unstable == [] and len(calls) == 1 + 8


def test_calibrate_refuses_a_dense_model(hf_checkpoint, tmp_path):
    cmd = [sys.executable, "-m", "litellm_pipeline", "+recipe=calibrate", f"model.path={hf_checkpoint('llama')}",
           "calibrate.progress=false", f"hydra.run.dir={tmp_path}/run"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "dense model" in proc.stderr and "Traceback" not in proc.stderr
