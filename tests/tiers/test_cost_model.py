"""The cost and quality model: the analytic estimate, profiles, prices of per-layer mixes, the latency tracker."""

from __future__ import annotations

import json

import pytest

from litellm_pipeline.budget.latency import LatencyTracker, bucket
from litellm_pipeline.config.schema import TierSection
from litellm_pipeline.demo import CHECKPOINT_DIR
from litellm_pipeline.errors import ConfigError
from litellm_pipeline.model.loader import load_model_config
from litellm_pipeline.telemetry import RequestCosted
from litellm_pipeline.tiers import TierSet, resolve_tiers
from litellm_pipeline.tiers.cost_model import CostModel

PRICED = {
    "fast": TierSection(experts_per_token=1, price={"prompt_1k": 0.25, "output_1k": 0.5}),
    "balanced": TierSection(price={"prompt_1k": 0.5, "output_1k": 1.0}),
    "max": TierSection(experts_per_token="all", price={"prompt_1k": 1.0, "output_1k": 2.0}),
}


@pytest.fixture(scope="module")
def demo():
    mc = load_model_config(CHECKPOINT_DIR)
    return mc, resolve_tiers(PRICED, mc)


def test_analytic_costs_rise_with_experts_and_batch(demo):
    mc, tiers = demo
    cm = CostModel.analytic(mc, tiers)
    assert cm.source == "analytic" and cm.choices == (1, 2, 8) and len(cm.layers) == mc.num_layers
    layer = cm.layers[0]
    assert [layer.prefill_ms[k] for k in cm.choices] == sorted(layer.prefill_ms[k] for k in cm.choices)
    for k in cm.choices:
        steps = [layer.decode_ms[k][b] for b in sorted(layer.decode_ms[k])]
        assert steps == sorted(steps)
    q = [layer.quality[k] for k in cm.choices]
    assert q == sorted(q) and layer.quality[2] == 0.0  # the checkpoint's own top-2 is the reference
    fast, bal, full = (cm.predict(tiers[t], 20, 10) for t in ("fast", "balanced", "max"))
    assert fast.latency_ms < bal.latency_ms < full.latency_ms and fast.quality < bal.quality < full.quality
    assert bal.monetary == pytest.approx((20 * 0.5 + 10 * 1.0) / 1000)
    assert cm.predict(tiers["balanced"], 20, 10, batch=16).per_token_ms > bal.per_token_ms
    assert cm.predict(tiers["balanced"], 20, 10, wait_ms=5.0).latency_ms == pytest.approx(bal.latency_ms + 5.0)


def test_prices_of_per_layer_mixes_interpolate_between_tiers(demo):
    mc, tiers = demo
    cm = CostModel.analytic(mc, tiers, choices=[1, 2, 4, 8])
    assert cm.price_at(2) == tiers["balanced"].price
    p4 = cm.price_at(4)  # between balanced (2) and max (8)
    assert p4.output_1k == pytest.approx(1.0 + (2.0 - 1.0) * 2 / 6)
    mix = cm.mixed_price((1, 1, 2, 2))
    assert mix.output_1k == pytest.approx(0.75) and mix.prompt_1k == pytest.approx(0.375)


def test_a_dense_model_has_no_layer_choices(hf_checkpoint):
    mc = load_model_config(hf_checkpoint("llama"))
    tiers = resolve_tiers(PRICED, mc)
    cm = CostModel.analytic(mc, tiers)
    assert cm.layers == () and cm.predict(tiers["max"], 10, 10).monetary == pytest.approx(0.03)


def _profile(mc, choices=(1, 2, 8)):
    layer = {
        "prefill_ms": {str(k): 0.01 * k for k in choices},
        "decode_ms": {str(k): {"1": 0.1 * k, "8": 0.2 * k} for k in choices},
        "quality": {str(k): -0.1 / k for k in choices},
    }
    return {"model": "demo", "machine": "test", "choices": list(choices),
            "fixed": {"prefill_ms": 0.05, "decode_ms": {"1": 1.0, "8": 2.0}},
            "layers": [layer] * mc.num_layers, "base_quality": 0.9}


def test_a_profile_is_loaded_and_used(demo, tmp_path):
    mc, tiers = demo
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(_profile(mc)))
    cm = CostModel.from_profile(path, mc, tiers)
    assert cm.source == str(path) and cm.base_quality == 0.9
    p = cm.predict(tiers["balanced"], 10, 5, batch=1)
    layers = mc.num_layers
    assert p.latency_ms == pytest.approx(10 * (0.05 + layers * 0.02) + 5 * (1.0 + layers * 0.2))
    assert p.per_token_ms == pytest.approx(1.0 + layers * 0.2)
    assert p.quality == pytest.approx(0.9 - layers * 0.05)
    # between measured batch sizes the decode cost is interpolated
    assert cm.predict(tiers["balanced"], 10, 5, batch=4).per_token_ms == pytest.approx(
        (1.0 + 3 / 7) + layers * (0.2 + 0.2 * 3 / 7))


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (lambda d: d["layers"].pop(), ["describes", "MoE layers"]),
        (lambda d: d["layers"][0]["quality"].pop("8"), ["lacks costs for expert count(s) [8]"]),
        (lambda d: d.pop("fixed"), ["cannot read cost profile", "KeyError"]),
    ],
)
def test_a_bad_profile_names_what_is_wrong(demo, tmp_path, mutate, words):
    mc, tiers = demo
    data = _profile(mc)
    data["layers"] = [json.loads(json.dumps(layer)) for layer in data["layers"]]
    mutate(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as err:
        CostModel.from_profile(path, mc, tiers)
    assert "budget.profile" in str(err.value)
    for w in words:
        assert w in str(err.value)
    with pytest.raises(ConfigError, match="cannot read cost profile"):
        CostModel.from_profile(tmp_path / "missing.json", mc, tiers)


@pytest.mark.parametrize("ks", [(1, 1, 1, 1), (2, 1, 8, 2), (8, 8, 8, 8), (3, 5, 1, 2)])
@pytest.mark.parametrize("batch", [1, 3, 16, 100])
def test_a_prediction_is_its_layers_options_summed(demo, ks, batch):
    """predict (cached per expert counts and batch) and the solver's per-layer options (cached per layer, count and
    batch) say the same: the fixed part plus each layer's option at its count, at any lengths, asked twice."""
    mc, tiers = demo
    cm = CostModel.analytic(mc, tiers, choices=(1, 2, 4, 8))
    ts = TierSet("t", ks)
    for prompt, out in ((7, 3), (120, 40), (7, 3)):
        lat, tok = cm.fixed(prompt, out, batch)
        quality = cm.base_quality
        for i, k in enumerate(ks):
            near = min(cm.choices, key=lambda c: (abs(c - k), -c))
            l_lat, l_tok, _, l_q = cm.layer_option(i, near, prompt, out, batch)
            lat, tok, quality = lat + l_lat, tok + l_tok, quality + l_q
        p = cm.predict(ts, prompt, out, batch, wait_ms=2.5)
        assert p.latency_ms == pytest.approx(lat + 2.5) and p.per_token_ms == pytest.approx(tok)
        assert p.quality == pytest.approx(quality)


def test_latency_tracker_follows_measurements_per_tier_and_bucket():
    t = LatencyTracker(alpha=0.5)
    assert t.factors("balanced", 3) == (1.0, 1.0)
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 64, 65)] == [1, 2, 4, 4, 8, 64, 128]

    def costed(tier, batch, pred, actual, tok_pred=1.0, tok=2.0):
        t.publish(RequestCosted("r", tier, batch, pred, tok_pred, actual, tok))

    costed("balanced", 3, 10.0, 30.0)
    e2e, tok = t.factors("balanced", 4)  # same bucket
    assert e2e == pytest.approx(3.0) and tok == pytest.approx(2.0)
    assert t.factors("fast", 3) == pytest.approx((3.0, 2.0))  # no data for fast: the bucket's factor
    # another bucket without data: the nearest bucket seen (here the only one) stands in for it
    assert t.factors("balanced", 1) == pytest.approx((3.0, 2.0))
    costed("balanced", 1, 10.0, 15.0, tok=1.5)
    assert t.factors("balanced", 1) == pytest.approx((1.5, 1.5))  # its own once measured
    assert t.factors("max", 2) == pytest.approx((3.0, 2.0))  # 2 is as near to 1 as to 4: the larger wins
    assert t.factors("max", 64) == pytest.approx((3.0, 2.0))  # far away, still the nearest
    costed("balanced", 3, 10.0, 1e6)  # one stall is clipped to 20x
    assert t.factors("balanced", 3)[0] < 20.0
    t.publish(RequestCosted("r", "balanced", 3, 10.0, 1.0, 10.0, None))  # a one-token output: e2e only
    assert t.observations("balanced", 3) == 3
    assert LatencyTracker().factors("balanced", 3) == (1.0, 1.0)  # nothing measured at all


def test_latency_tracker_learns_against_the_uncorrected_prediction():
    """Requests are predicted with the factors of their time; what they took is compared with the cost model's own
    prediction, so a model that is 2x too optimistic converges to a factor of 2 (compared with the corrected
    prediction it would settle at sqrt(2), and every request planned at the budget's edge would finish late)."""
    t = LatencyTracker(alpha=0.3)
    raw, raw_tok = 10.0, 1.0
    for _ in range(40):
        f, g = t.factors("balanced", 1)
        t.publish(RequestCosted("r", "balanced", 1, raw * f, raw_tok * g, 2 * raw, 3 * raw_tok, (), (f, g)))
    assert t.factors("balanced", 1) == pytest.approx((2.0, 3.0), rel=1e-3)


def test_tierset_views():
    ts = TierSet("m", (1, 2, 2, 8))
    assert ts.uniform_k is None and ts.experts_per_token == [1, 2, 2, 8]
    assert TierSet("u", (2, 2)).experts_per_token == 2 and TierSet("d", ()).uniform_k == 0
