"""select_tier modes over budgets on the demo MoE: per-layer TierSets, prices, solvers in the engine, the
monetary cap, infeasible budgets, cost records and their events."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from litellm_pipeline import LLM, BudgetSpec, SamplingParams
from litellm_pipeline.budget.selector import Load
from litellm_pipeline.demo import CHECKPOINT_DIR
from litellm_pipeline.demo.network import MoeForTraining, NetworkConfig
from litellm_pipeline.errors import ConfigError, InvalidRequestError
from litellm_pipeline.telemetry import MemorySink, RequestCosted, TierSelected

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from _engine_util import assert_pool_empty  # noqa: E402

PROMPTS = ["12+34=", "rev:abcdef=", "sort:93172=", "copy:x7z=", "a3,b7,c1;b"]


def make(mode: str = "fixed", *overrides: str, **kw) -> LLM:
    return LLM(overrides=[f"pipeline.stages.select_tier.params.mode={mode}", "telemetry=memory", *overrides], **kw)


def greedy(n: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def balanced() -> LLM:
    return make("balanced")


# --- TierSets per layer and prices ------------------------------------------------------------------------------


def test_per_layer_tier_runs_and_differs_from_uniform_ones():
    llm = LLM(overrides=["+tiers.mixed.experts_per_token=[1,1,8,8]", "+tiers.mixed.price.output_1k=3"])
    ts = llm.engine.rt.tiers["mixed"]
    assert ts.experts_per_layer == (1, 1, 8, 8) and ts.experts_per_token == [1, 1, 8, 8] and ts.uniform_k is None
    assert ts.price.output_1k == 3.0 and ts.price.prompt_1k == 0.0
    outs = {t: llm.generate(PROMPTS, greedy(6, logprobs=0), tier=t) for t in ("fast", "mixed", "max")}
    lp = {t: [o.logprobs[0][o.token_ids[0]] for o in outs[t]] for t in outs}
    assert lp["mixed"] != lp["fast"] and lp["mixed"] != lp["max"]


def test_per_layer_routing_matches_the_training_network():
    """The engine's per-layer expert counts compute what the plain-torch Mixtral computes at the same counts."""
    import json

    from safetensors.torch import load_file

    cfg = json.loads((CHECKPOINT_DIR / "config.json").read_text())
    net = MoeForTraining(NetworkConfig.from_hf(cfg))
    net.load_state_dict({k: v.float() for k, v in load_file(CHECKPOINT_DIR / "model.safetensors").items()})
    net.eval()
    llm = LLM(overrides=["+tiers.mixed.experts_per_token=[2,1,4,8]"])
    prompt = "copy:k2v9q="
    (out,) = llm.generate(prompt, greedy(1, logprobs=5), tier="mixed")
    ids = torch.tensor([out.prompt_token_ids])
    k = torch.tensor([2, 1, 4, 8])[:, None, None].expand(4, *ids.shape)
    with torch.no_grad():
        logits, _ = net(ids, torch.ones_like(ids, dtype=torch.bool), k)
    ref = torch.log_softmax(logits[0, -1].float(), -1)
    assert out.token_ids[0] == int(ref.argmax())
    for tok, lp in out.logprobs[0].items():
        assert abs(lp - float(ref[tok])) < 1e-3


def test_a_per_layer_request_does_not_change_its_neighbours():
    llm = LLM(overrides=["+tiers.mixed.experts_per_token=[1,2,4,8]"])
    alone = [llm.generate(p, greedy(8, logprobs=0))[0] for p in PROMPTS]
    specs = [{"tier": "mixed"}, {}, {"tier": "mixed"}, {}, {}]
    from litellm_pipeline import RequestSpec

    mixed = llm.generate([RequestSpec(p, greedy(8, logprobs=0), **s) for p, s in zip(PROMPTS, specs)])
    for a, m, s in zip(alone, mixed, specs):
        if not s:
            assert a.token_ids == m.token_ids
            assert max(abs(x[t] - y[t]) for x, y, t in zip(a.logprobs, m.logprobs, a.token_ids)) < 1e-4


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("tiers.fast.experts_per_token=[1,2]", ["tiers.fast.experts_per_token", "4 layers", "2 entries"]),
        ("tiers.fast.experts_per_token=[1,2,2,99]", ["tiers.fast.experts_per_token[3]", "99", "8 experts"]),
        ("tiers.fast.experts_per_token=[1,lots,2,2]", ["tiers.fast", "lots", "per-layer list"]),
        ("tiers.fast.price.output_1k=-1", ["tiers.fast.price.output_1k", ">= 0"]),
        ("budget.solver=simplex", ["budget.solver", "simplex", "exact", "greedy"]),
        ("budget.on_infeasible=shrug", ["budget.on_infeasible", "reject", "cheapest"]),
        ("budget.choices=[1,16]", ["budget.choices", "16", "8 experts"]),
        ("budget.monetary_cost_units=0", ["budget.monetary_cost_units", "> 0"]),
        ("pipeline.stages.select_tier.params.mode=cheap", ["mode", "cheap", "balanced", "deep"]),
    ],
)
def test_invalid_tiers_and_budget_config_name_the_key(override, words):
    with pytest.raises(ConfigError) as err:
        LLM(overrides=[override])
    for w in words:
        assert w in str(err.value), (w, str(err.value))


# --- modes ---------------------------------------------------------------------------------------------------


def test_every_output_carries_a_cost_record(balanced):
    outs = balanced.generate(PROMPTS, greedy(5))
    for o in outs:
        c = o.cost
        assert c is not None and c.mode == "balanced" and c.cost_model == "analytic" and c.feasible
        assert c.tier == o.tier and len(c.experts_per_layer) == 4
        assert c.latency_ms > 0 and c.monetary > 0 and c.predicted_latency_ms > 0 and c.budget_met == {}
        assert c.as_dict()["experts_per_layer"] == list(c.experts_per_layer)
    sink = balanced.engine.rt.bus.sink(MemorySink)
    picked = {e.request_id: e for e in sink.of(TierSelected)}
    assert all(picked[o.request_id].tier == o.tier for o in outs)
    costed = {e.request_id for e in sink.of(RequestCosted)}
    assert {o.request_id for o in outs} <= costed


def test_fixed_mode_keeps_the_configured_tier_and_checks_the_budget():
    llm = make("fixed")
    (o,) = llm.generate("12+34=", greedy(4), budget={"latency_cost_ms": 1e6})
    assert o.tier == "balanced" and o.cost.mode == "fixed" and o.cost.budget_met == {"latency_cost_ms": True}
    (o,) = llm.generate("12+34=", greedy(4), tier="max")
    assert o.tier == "max" and o.cost.experts_per_layer == (8, 8, 8, 8)


def test_deep_spends_more_than_balanced_under_the_same_budget(balanced):
    deep = make("deep")
    budget = BudgetSpec(monetary_cost_units=0.012)
    (b,) = balanced.generate("rev:abcdef=", greedy(8), budget=budget)
    (d,) = deep.generate("rev:abcdef=", greedy(8), budget=budget)
    (free,) = deep.generate("rev:abcdef=", greedy(8))
    assert free.tier == "max"  # nothing limits deep: the most quality
    assert sum(d.cost.experts_per_layer) >= sum(b.cost.experts_per_layer)
    assert d.cost.predicted_quality >= b.cost.predicted_quality
    for o in (b, d):
        assert o.cost.predicted_monetary <= 0.012 + 1e-12 and o.cost.monetary <= 0.012 + 1e-12
        assert o.cost.budget_met == {"monetary_cost_units": True}


def test_max_mode_runs_every_expert_and_only_checks():
    llm = make("max")
    (o,) = llm.generate("12+34=", greedy(4), budget={"latency_per_token_ms": 1e-6})
    assert o.cost.experts_per_layer == (8, 8, 8, 8) and o.tier == "max"
    assert not o.cost.feasible and o.cost.budget_met == {"latency_per_token_ms": False}


def test_tighter_money_buys_fewer_experts(balanced):
    spent = []
    for cap in (1.0, 0.012, 0.009, 0.0075):
        (o,) = balanced.generate("sort:93172=", greedy(8), budget={"monetary_cost_units": cap})
        assert o.cost.monetary <= cap + 1e-12
        spent.append(sum(o.cost.experts_per_layer))
    assert spent == sorted(spent, reverse=True) and spent[0] > spent[-1]


def test_greedy_solver_serves_too():
    llm = make("balanced", "budget.solver=greedy")
    (o,) = llm.generate("12+34=", greedy(6), budget={"monetary_cost_units": 0.01})
    assert o.cost.monetary <= 0.01 and o.cost.feasible


# --- infeasible budgets and the monetary cap ---------------------------------------------------------------------


def test_an_impossible_budget_is_rejected_naming_the_cheapest_cost(balanced):
    with pytest.raises(InvalidRequestError) as err:
        balanced.generate("12+34=", greedy(8), budget={"monetary_cost_units": 1e-4})
    msg = str(err.value)
    assert "budget" in msg and "monetary_cost_units=0.0001" in msg and "cheapest TierSet (fast" in msg
    assert "monetary_cost_units=0.00575" in msg  # 7 prompt + 8 output tokens at fast's prices
    (ok,) = balanced.generate("12+34=", greedy(4))  # the engine goes on
    assert ok.finished
    assert_pool_empty(balanced)


def test_on_infeasible_cheapest_runs_the_cheapest_and_flags_it():
    llm = make("balanced", "budget.on_infeasible=cheapest")
    (o,) = llm.generate("12+34=", greedy(8), budget={"latency_cost_ms": 1e-3})
    assert o.tier == "fast" and not o.cost.feasible and o.cost.budget_met == {"latency_cost_ms": False}


def test_the_monetary_budget_is_hard_in_fixed_mode():
    llm = make("fixed")
    # balanced: 0.5 / 1.0 per 1k prompt / output tokens; 7 prompt tokens cost 0.0035, each output 0.001
    (o,) = llm.generate("12+34=", greedy(16), budget={"monetary_cost_units": 0.0085})
    assert o.finish_reason == "budget" and len(o.token_ids) == 5
    assert o.cost.monetary == pytest.approx(0.0085) and o.cost.budget_met == {"monetary_cost_units": True}
    with pytest.raises(InvalidRequestError, match="budget: cannot be met"):
        llm.generate("12+34=", greedy(16), budget={"monetary_cost_units": 0.004})
    assert_pool_empty(llm)


def test_the_configured_default_budget_applies_to_requests_without_one():
    llm = make("balanced", "budget.monetary_cost_units=0.009")
    (o,) = llm.generate("sort:93172=", greedy(8))
    assert o.cost.budget == BudgetSpec(monetary_cost_units=0.009) and o.cost.monetary <= 0.009
    (o,) = llm.generate("sort:93172=", greedy(8), budget={"monetary_cost_units": 1.0})
    assert o.cost.budget.monetary_cost_units == 1.0  # the request's own budget wins


def test_latency_estimates_follow_what_requests_took():
    import math

    llm = make("balanced")
    tracker = llm.engine.request_stages[1].tracker
    assert tracker.observations(None, 1) == 0 and tracker.factors(None, 1) == (1.0, 1.0)
    for _ in range(3):
        llm.generate("12+34=", greedy(4))
    costed = [e for e in llm.engine.rt.bus.sink(MemorySink).of(RequestCosted) if e.batch == 1]
    assert len(costed) == 3 and tracker.observations(None, 1) == 3 and tracker.observations("balanced", 1) == 3
    # the first 1/alpha observations weigh alike: the factors are the geometric means of measured / predicted,
    # each clipped to 1/20..20 (a cold first request can take longer than that)

    def mean(ratios):
        return math.exp(sum(max(-math.log(20), min(math.log(20), math.log(r))) for r in ratios) / len(ratios))

    # measured against the cost model's own prediction: each request's correction divided out
    assert costed[0].correction == (1.0, 1.0) and costed[1].correction != (1.0, 1.0)
    e2e = mean([e.latency_ms / (e.predicted_latency_ms / e.correction[0]) for e in costed])
    tok = mean([e.per_token_ms / (e.predicted_per_token_ms / e.correction[1]) for e in costed])
    assert tracker.factors(None, 1) == pytest.approx((e2e, tok))
    assert tracker.factors("balanced", 1) == pytest.approx((e2e, tok))
    balanced = llm
    sel = balanced.engine.request_stages[1].selector
    ts = balanced.engine.rt.tiers["balanced"]
    raw = sel.cost.predict(ts, 7, 4, 1)
    now = sel.predict(ts, 7, 4, Load())
    f, g = sel._factors("balanced", 1)
    assert now.latency_ms == pytest.approx(raw.latency_ms * f) and now.per_token_ms == pytest.approx(raw.per_token_ms * g)
    # the requests' own factors, raised where the measured step time says more
    rf, rg = tracker.factors("balanced", 1)
    assert f >= rf and g >= rg
    assert g == pytest.approx(max(rg, tracker.step_ms(1) / sel.cost.predict(sel.default, 1, 1, 1).per_token_ms))


def test_latency_headroom_keeps_a_share_of_the_budget_out_of_the_plan():
    """The solver plans for latency_cost_ms x (1 - budget.latency_headroom): a budget the deepest TierSet just
    fits without headroom buys a cheaper one with it, and one that only fits without is refused with it."""
    tight = make("deep", "budget.latency_headroom=0")
    roomy = make("deep", "budget.latency_headroom=0.5")
    sel_t = next(s for s in tight.engine.request_stages if type(s).__name__ == "SelectTier").selector
    full = sel_t.predict(sel_t.full, 5, 8, Load()).latency_ms
    budget = BudgetSpec(latency_cost_ms=full * 1.01)
    assert sel_t.select(None, budget, 5, 8).tierset.experts_per_layer == sel_t.full.experts_per_layer
    sel_r = next(s for s in roomy.engine.request_stages if type(s).__name__ == "SelectTier").selector
    got = sel_r.select(None, budget, 5, 8)
    assert sum(got.tierset.experts_per_layer) < sum(sel_r.full.experts_per_layer)
    assert got.predicted.latency_ms <= full * 1.01 * 0.5 + 1e-9
    cheapest = sel_r.predict(sel_r.solved_tierset((1,) * 4), 5, 8, Load()).latency_ms
    with pytest.raises(InvalidRequestError, match="latency_cost_ms") as err:
        sel_r.select(None, BudgetSpec(latency_cost_ms=cheapest * 1.5), 5, 8)  # fits, but not in half of it
    assert "50% of a latency limit is planned with (budget.latency_headroom)" in str(err.value)
    with pytest.raises(ConfigError, match="budget.latency_headroom"):
        make("deep", "budget.latency_headroom=1")



def test_a_plan_its_own_tiersets_measurements_say_would_finish_late_is_refused_up_front():
    """The solver plans with what requests at every TierSet took; where requests at the TierSet it picks took far
    longer than predicted, the pick's own corrected prediction is checked against the plan before it runs: refused
    up front (an invalid-request error naming the budget), not served late."""
    llm = make("deep", "budget.latency_headroom=0")
    stage = next(s for s in llm.engine.request_stages if type(s).__name__ == "SelectTier")
    tracker, sel = stage.tracker, stage.selector
    full = sel.full.name
    for _ in range(10):  # requests at the full TierSet took 4x what the cost model said
        tracker.publish(RequestCosted("r", full, 1, 10.0, 1.0, 40.0, 4.0))
    for _ in range(30):  # the rest as predicted: the factor over every TierSet comes back near 1
        tracker.publish(RequestCosted("r", "fast", 1, 10.0, 1.0, 10.0, 1.0))
    f_all = sel._factors(None, 1)[0]
    f_full = sel._factors(full, 1)[0]
    assert f_all < 1.1 and f_full > 3.5
    raw = sel.cost.predict(sel.full, 5, 8, 1).latency_ms
    budget = BudgetSpec(latency_cost_ms=raw * 1.5)  # the full model fits by the factor over every TierSet
    problem = sel.problem(budget, 5, 8, Load())
    assert sel.solver.solve(problem).ks(problem) == sel.full.experts_per_layer
    got = sel.select(None, budget, 5, 8)  # not the full model: its own measurements say 4x
    assert got.tierset.name != full and got.tierset.name in llm.engine.rt.tiers
    assert got.predicted.latency_ms <= budget.latency_cost_ms
    # the configured tier of the highest quality whose own prediction keeps the budget
    fits = [t for t in llm.engine.rt.tiers.values()
            if sel.predict(t, 5, 8, Load()).latency_ms <= budget.latency_cost_ms]
    assert got.predicted.quality == max(sel.predict(t, 5, 8, Load()).quality for t in fits)
    # where no configured tier keeps it by its own measurements (each took 10x): refused up front
    for t in llm.engine.rt.tiers.values():
        for _ in range(10):
            tracker.publish(RequestCosted("r", t.name, 1, 10.0, 1.0, 100.0, 10.0))
    for _ in range(30):
        tracker.publish(RequestCosted("r", "auto:2", 1, 10.0, 1.0, 10.0, 1.0))
    assert sel._factors(None, 1)[0] < 1.1
    with pytest.raises(InvalidRequestError, match="budget: cannot be met"):
        sel.select(None, budget, 5, 8)
