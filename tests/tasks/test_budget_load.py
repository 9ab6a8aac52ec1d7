"""+recipe=budget_load at a small size: every class reported, money always within budget, TierSets adapt."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from litellm_pipeline.tasks.budget_load import (
    BudgetClass,
    LoadSettings,
    format_report,
    pool,
    run_load,
)


def test_budget_load_recipe_reports_every_class(tmp_path):
    cmd = [sys.executable, "-m", "litellm_pipeline", "+recipe=budget_load", "budget_load.requests=30",
           "budget_load.windows=2", "budget_load.repeats=2", f"hydra.run.dir={tmp_path}/run"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads((tmp_path / "run" / "budget_load.json").read_text())
    assert set(r["classes"]) == {"tight", "loose", "cheap"} and len(r["repeats"]) == 2
    for one in r["repeats"]:
        assert one["arrival_requests_per_s"] > one["full_model_requests_per_s"]  # overloaded by construction
        assert sum(c["requests"] for c in one["classes"].values()) == 30
        for c in one["classes"].values():
            assert len(c["tiers_by_window"]) == 2
            assert sum(sum(w.values()) for w in c["tiers_by_window"]) == c["served"]
    assert len(r["other_cores"]) == 2 and len(r["busy"]) == 2
    for name, c in r["classes"].items():  # pooled: the repeats' counts summed, reasons and intervals given
        per = [one["classes"][name] for one in r["repeats"]]
        assert c["requests"] == sum(x["requests"] for x in per) and c["served"] == sum(x["served"] for x in per)
        assert sum(c["rejected_by_reason"].values()) == c["rejected"]
        assert set(c["rejected_by_reason"]) <= {"budget", "overloaded"}
        if c["latency_budgeted"]:
            lo, hi = c["latency_ci95"]
            assert lo <= c["latency_compliance"] <= hi
    cheap = r["classes"]["cheap"]
    if cheap["served"]:
        assert cheap["monetary_compliance"] == 1.0  # money is a hard limit
    assert "tight" in proc.stdout and "TierSets chosen by time window" in proc.stdout
    assert "rejected (budget / overloaded)" in proc.stdout and "other processes' CPU use per repeat" in proc.stdout


def test_wilson_interval():
    from litellm_pipeline.tasks.budget_load import wilson

    assert wilson(0, 0) is None
    lo, hi = wilson(19, 20)
    assert abs(lo - 0.7639) < 1e-3 and abs(hi - 0.9911) < 1e-3  # the score interval of 19 / 20
    lo, hi = wilson(50, 100)
    assert abs(lo - 0.4038) < 1e-3 and abs(hi - 0.5962) < 1e-3
    for n in range(1, 120):  # the interval holds the observed rate, all met and none met included
        for k in range(n + 1):
            lo, hi = wilson(k, n)
            assert 0.0 <= lo <= k / n <= hi <= 1.0, (k, n)
        assert wilson(n, n)[1] == 1.0 and wilson(0, n)[0] == 0.0


def test_tighter_latency_budgets_get_cheaper_tiersets():
    from litellm_pipeline import LLM

    # deep: without a limit every request gets every expert; a latency budget under load must buy fewer
    llm = LLM(overrides=["pipeline.stages.select_tier.params.mode=deep"])
    s = LoadSettings(requests=24, overload=1.5, max_tokens=8, windows=1, classes=[
        BudgetClass(name="tight", share=1, latency_x=1.2), BudgetClass(name="free", share=1)])
    r = run_load(llm.engine, s, demo=True)
    experts = {}
    for name, c in r["classes"].items():
        tiers = c["tiers_by_window"][0]
        n = sum(tiers.values())
        experts[name] = sum(_experts(llm, t) * k for t, k in tiers.items()) / max(1, n)
    assert experts["free"] == 32 and experts["tight"] < experts["free"]
    assert "tight" in format_report(pool([r], 0.3))
    assert not llm.engine.has_unfinished() and llm.engine.rt.pool.is_empty()


def _experts(llm, tier: str) -> int:
    if tier in llm.engine.rt.tiers:
        return sum(llm.engine.rt.tiers[tier].experts_per_layer)
    return sum(int(k) for k in tier.removeprefix("auto:").split("-")) if "-" in tier else 4 * int(tier[5:])


class _Req:
    def __init__(self, max_tokens: int, done: int = 0, budget_max_tokens=None):
        from litellm_pipeline.sampling import SamplingParams

        self.params = SamplingParams(max_tokens=max_tokens)
        self.output_ids = [0] * done
        self.budget_max_tokens = budget_max_tokens


def test_steps_until_a_slot_frees_follow_the_queue():
    from litellm_pipeline.stages.select_tier import steps_until_free_slot

    # a free slot: no wait
    assert steps_until_free_slot([_Req(10)], [], 2) == 0
    # two slots held for 3 and 8 more tokens: the first frees after 3 steps
    assert steps_until_free_slot([_Req(10, done=7), _Req(8)], [], 2) == 3
    # one waiting request (5 tokens) takes that slot until step 8; the other frees at 8 as well
    assert steps_until_free_slot([_Req(10, done=7), _Req(8)], [_Req(5)], 2) == 8
    # a monetary token cap shortens a request's hold
    assert steps_until_free_slot([_Req(10, budget_max_tokens=2), _Req(8)], [], 2) == 2


def test_a_full_engine_predicts_the_wait_for_a_slot():
    from litellm_pipeline import LLM, SamplingParams

    llm = LLM(overrides=["pipeline.stages.select_tier.params.mode=balanced"], max_num_seqs=2)
    stage = next(s for s in llm.engine.request_stages if type(s).__name__ == "SelectTier")
    idle = stage._load(llm.engine.rt.scheduler.load())
    assert idle.wait_ms == 0 and idle.batch == 1
    reqs = [llm.engine.add_request("a3,b7;b", SamplingParams(max_tokens=20, ignore_eos=True)) for _ in range(3)]
    llm.engine.step()  # two run, one waits
    busy = stage._load(llm.engine.rt.scheduler.load())
    step_ms = stage.selector.predict(stage.selector.default, 1, 1, type(idle)(batch=2)).per_token_ms
    assert busy.batch == 2
    # the new request waits for the first slot to free (19 steps) and for the queued prompt to be prefilled
    assert busy.wait_ms >= 19 * step_ms
    for r in reqs:
        llm.engine.abort(r.request_id)
    assert llm.engine.rt.pool.is_empty()


def test_measured_step_times_correct_the_predictions():
    from litellm_pipeline import LLM
    from litellm_pipeline.budget.latency import LatencyTracker
    from litellm_pipeline.budget.selector import Load
    from litellm_pipeline.telemetry.events import StepFinished

    tr = LatencyTracker()
    assert tr.step_ms(8) is None
    for _ in range(5):
        tr.publish(StepFinished(batch_size=8, prefill_tokens=0, decode_tokens=8, duration_s=0.012, num_running=8,
                                num_waiting=0, free_blocks=10))
    tr.publish(StepFinished(batch_size=1, prefill_tokens=30, decode_tokens=0, duration_s=5.0, num_running=1,
                            num_waiting=0, free_blocks=10))  # a prefill-only step: the prefill terms, not decode
    # only one batch size seen: no slope to go by, so a larger batch takes what was measured (never less)
    assert tr.step_ms(8) == pytest.approx(12.0, rel=0.01) and tr.step_ms(64) == pytest.approx(12.0, rel=0.01)
    assert tr.prefill_ms(30) > 1000  # the slow prefill-only step is what a prompt costs

    llm = LLM(overrides=["pipeline.stages.select_tier.params.mode=balanced"])
    stage = next(s for s in llm.engine.request_stages if type(s).__name__ == "SelectTier")
    sel, load = stage.selector, Load(batch=8)
    plain = sel.predict(sel.default, 5, 10, load)  # nothing measured yet: the cost model alone
    sel.tracker = tr
    slow = sel.predict(sel.default, 5, 10, load)
    assert slow.per_token_ms >= 12.0 - 1e-6 > plain.per_token_ms  # the measured step time wins
    assert slow.latency_ms > plain.latency_ms


def test_a_request_that_would_make_one_in_flight_miss_its_budget_is_refused(monkeypatch):
    from litellm_pipeline import LLM, SamplingParams
    from litellm_pipeline.errors import OverloadedError
    from litellm_pipeline.tiers.cost_model import Prediction

    llm = LLM(overrides=["pipeline.stages.select_tier.params.mode=balanced"])
    engine = llm.engine
    stage = next(s for s in engine.request_stages if type(s).__name__ == "SelectTier")
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    first = engine.add_request("a3,b7;b", params, budget={"latency_cost_ms": 60_000})
    engine.step()
    # a step at batch 2 predicted 10x slower than at batch 1: 19 steps fit the first request's budget
    # at 1 s each but not at 10 s each
    real = stage.selector.predict
    fake = lambda ts, p, m, load: Prediction(0.0, 1000.0 if load.batch <= 1 else 10_000.0, 0.0, 0.0)  # noqa: E731
    monkeypatch.setattr(stage.selector, "predict", fake)
    with pytest.raises(OverloadedError, match=r"would make request 'req-\d+' miss its latency_cost_ms=60000"):
        engine.add_request("c1,d2;c", params)
    monkeypatch.setattr(stage.selector, "predict", real)
    second = engine.add_request("c1,d2;c", params)  # with the real step times it fits
    while not (first.finished and second.finished):
        engine.step()
    assert first.cost.budget_met["latency_cost_ms"]
    assert engine.rt.pool.is_empty()


def test_step_model_recovers_the_line_and_keeps_slopes_non_negative():
    import random

    from litellm_pipeline.budget.step_model import StepModel

    m = StepModel(decay=1.0)
    assert m.predict(4) is None and m.prefill_ms(10) is None
    rng = random.Random(0)
    for _ in range(400):  # fixed 0.6 ms, 0.05 per row, 0.01 per prompt token, 0.3 for a step with a prefill
        rows, tokens = rng.randint(1, 64), rng.choice([0, 0, 16, 100, 400])
        m.add(rows, tokens, 0.6 + 0.05 * rows + 0.01 * tokens + (0.3 if tokens else 0) + rng.gauss(0, 0.02))
    a, b, c, d = m.coef()
    assert a == pytest.approx(0.6, abs=0.02) and b == pytest.approx(0.05, rel=0.02)
    assert c == pytest.approx(0.01, rel=0.02) and d == pytest.approx(0.3, abs=0.02)
    assert m.predict(32, 100) == pytest.approx(0.6 + 1.6 + 1.0 + 0.3, rel=0.02)
    assert m.prefill_ms(100) == pytest.approx(1.3, rel=0.03)
    # steps that get faster with more rows (noise): the slope is dropped, not made negative
    m = StepModel()
    for rows, ms in ((1, 5.0), (32, 4.0), (64, 3.0)):
        m.add(rows, 0, ms)
    assert m.coef()[1] == 0.0 and m.predict(64) == pytest.approx(4.0, rel=0.01)  # the (weighted) mean


def test_time_between_steps_counts_into_the_step_time(monkeypatch):
    from litellm_pipeline.budget import latency
    from litellm_pipeline.budget.latency import LatencyTracker
    from litellm_pipeline.telemetry.events import StepFinished

    clock = [0.0]
    monkeypatch.setattr(latency.time, "perf_counter", lambda: clock[0])
    tr = LatencyTracker(alpha=1.0)

    def step(at_s: float, pending: int = 4):
        clock[0] = at_s
        tr.publish(StepFinished(batch_size=4, prefill_tokens=0, decode_tokens=4, duration_s=0.002,
                                num_running=pending, num_waiting=0, free_blocks=10))

    step(1.0)
    step(1.002)  # back to back: the step time is what was measured
    assert tr.step_ms(4) == pytest.approx(2.0)
    for i in range(1, 40):  # 2 ms steps, each 2 ms after the last one ended: the serving loop doubles them
        step(1.002 + 0.004 * i)
    assert tr.step_ms(4) == pytest.approx(4.0, rel=0.01)
    step(1.162, pending=0)  # the engine ran out of work: the idle time until the next step is not overhead
    step(9.0)
    assert tr.step_ms(4) == pytest.approx(4.0, rel=0.01)
