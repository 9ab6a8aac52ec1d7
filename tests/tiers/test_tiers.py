"""TierSet resolution against a checkpoint, and BudgetSpec validation."""

from __future__ import annotations

import pytest

from litellm_pipeline import BudgetSpec
from litellm_pipeline.config.schema import TierSection
from litellm_pipeline.errors import ConfigError
from litellm_pipeline.model.loader import load_model_config
from litellm_pipeline.tiers import TierSet, resolve_tiers


@pytest.fixture(scope="module")
def moe(hf_checkpoint):
    return load_model_config(hf_checkpoint("mixtral"))


def test_spellings_resolve_to_expert_counts(moe):
    n, native = moe.num_experts, moe.experts_per_token
    tiers = resolve_tiers(
        {"a": TierSection(experts_per_token=1, cost=0.1), "b": TierSection(), "c": TierSection(experts_per_token="2x"),
         "d": TierSection(experts_per_token="all"), "e": TierSection(experts_per_token=1, allowed_experts=[2, 0, 2])},
        moe,
    )
    assert tiers["a"] == TierSet("a", (1,) * moe.num_layers, 0.1)
    assert tiers["b"].experts_per_token == native and tiers["c"].experts_per_token == min(n, 2 * native)
    assert tiers["d"].experts_per_token == n and tiers["e"].allowed_experts == (0, 2)


def test_too_many_experts_or_bad_ids_name_the_key(moe):
    with pytest.raises(ConfigError, match=r"tiers.big.experts_per_token: 99 exceeds the model's"):
        resolve_tiers({"big": TierSection(experts_per_token=99)}, moe)
    with pytest.raises(ConfigError, match=r"tiers.odd.allowed_experts: must hold at least 2 distinct"):
        resolve_tiers({"odd": TierSection(experts_per_token=2, allowed_experts=[1, 1])}, moe)


def test_dense_model_gets_zero_expert_tiers(hf_checkpoint):
    dense = load_model_config(hf_checkpoint("llama"))
    t = resolve_tiers({"fast": TierSection(experts_per_token=1, price={"output_1k": 2})}, dense)["fast"]
    assert t.experts_per_token == 0 and t.experts_per_layer == () and t.price.output_1k == 2.0


def test_per_layer_counts_and_prices(moe):
    layers, native = moe.num_layers, moe.experts_per_token
    spec = ["native", 1] + ["all"] * (layers - 2)
    t = resolve_tiers({"m": TierSection(experts_per_token=spec, price={"prompt_1k": 0.5, "output_1k": 1.5})}, moe)["m"]
    assert t.experts_per_layer == (native, 1) + (moe.num_experts,) * (layers - 2) and t.uniform_k is None
    assert t.price.of(1000, 2000) == pytest.approx(0.5 + 3.0)
    with pytest.raises(ConfigError, match=rf"tiers.m.experts_per_token: a per-layer list .* has {layers} layers"):
        resolve_tiers({"m": TierSection(experts_per_token=[1])}, moe)


def test_budget_spec_limits_are_optional_and_positive():
    assert BudgetSpec().unlimited
    b = BudgetSpec(latency_cost_ms=200, latency_per_token_ms=20, monetary_cost_units=0.5)
    assert not b.unlimited and b.monetary_cost_units == 0.5
    with pytest.raises(ValueError, match=r"latency_cost_ms: must be > 0"):
        BudgetSpec(latency_cost_ms=0)
    with pytest.raises(ValueError, match="monetary_cost_units"):
        BudgetSpec(monetary_cost_units=float("inf"))
    with pytest.raises(ValueError, match="cost_usd: unknown key"):
        BudgetSpec(cost_usd=1)
