"""Config validation at build time: one message naming the key path and what is allowed; nothing runs."""

from __future__ import annotations

import pytest

from litellm_pipeline import LLM
from litellm_pipeline.config.build import build_engine
from litellm_pipeline.config.compose import compose
from litellm_pipeline.errors import ConfigError
from litellm_pipeline.stages.base import Stage


def _build(*overrides: str, model=None):
    cfg = compose(list(overrides) + ([f"model.path={model}"] if model else []))
    return build_engine(cfg)


@pytest.mark.parametrize(
    "override, expect",
    [
        ("cache.block_size=0", ["cache.block_size", ">= 1", "got 0"]),
        ("cache.block_size=abc", ["cache.block_size", "abc"]),
        ("engine.max_num_seqs=-1", ["engine.max_num_seqs", ">= 1"]),
        ("device.dtype=float64", ["device.dtype", "float32", "bfloat16", "float16"]),
        ("device.type=tpu", ["device.type", "cpu", "cuda"]),
        ("+cache.colour=blue", ["cache.colour", "unknown key"]),
        ("+bogus=1", ["bogus", "unknown key"]),
        ("sampling.temperature=-1", ["sampling.temperature", ">= 0", "<= 100", "-1"]),
        ("sampling.top_p=0", ["sampling.top_p"]),
        ("tiers.fast.experts_per_token=0", ["tiers.fast", "experts_per_token", ">= 1"]),
        ("tiers.fast.experts_per_token=lots", ["tiers.fast", "lots", "native"]),
        ("tiers.fast.cost=-2", ["tiers.fast.cost", ">= 0"]),
    ],
)
def test_bad_values_name_the_key_and_the_allowed_range(override, expect, tmp_path):
    # model.path points at an empty directory: a config error must come before any checkpoint access
    with pytest.raises(ConfigError) as exc:
        _build(override, model=tmp_path)
    for text in expect:
        assert text in str(exc.value), str(exc.value)


def test_tier_asking_for_more_experts_than_the_model_has(hf_checkpoint, monkeypatch):
    from litellm_pipeline.model import loader

    def must_not_load(*a, **k):  # the check is against config.json, before any weight is read
        raise AssertionError("weights were loaded before the tier check")

    monkeypatch.setattr("litellm_pipeline.config.build.load_model", must_not_load)
    path = hf_checkpoint("mixtral")  # 4 experts
    with pytest.raises(ConfigError) as exc:
        _build("tiers.max.experts_per_token=9", model=path)
    msg = str(exc.value)
    assert "tiers.max.experts_per_token" in msg and "9" in msg and "4 experts" in msg and "1..4" in msg
    assert loader is not None


def test_unknown_stage_implementation_lists_known(tmp_path):
    with pytest.raises(ConfigError) as exc:
        _build("pipeline.stages.sample.impl=nope", model=tmp_path)
    msg = str(exc.value)
    assert "pipeline.stages.sample.impl" in msg and "'nope'" in msg and "sample" in msg and "emit" in msg


def test_unknown_stage_parameter(tmp_path):
    with pytest.raises(ConfigError) as exc:
        _build("+pipeline.stages.prefill.params.speed=11", model=tmp_path)
    assert "pipeline.stages.prefill.params" in str(exc.value) and "speed" in str(exc.value)


@pytest.mark.parametrize("override, starts", [
    ("pipeline.stages.sample.params.sampler=nosuch", "pipeline.stages.sample.params.sampler: unknown sampler 'nosuch'"),
    ("pipeline.stages.decode.params.attention=nosuch",
     "pipeline.stages.decode.params.attention: unknown attention 'nosuch'"),
    ("pipeline.stages.select_tier.params.tier=nosuch", "pipeline.stages.select_tier.params.tier: unknown tier 'nosuch'"),
])
def test_a_stage_parameter_error_names_its_key_once(override, starts):
    with pytest.raises(ConfigError) as exc:
        _build(override)  # the demo model
    assert str(exc.value).startswith(starts) and str(exc.value).count("pipeline.stages") == 1, str(exc.value)


def test_order_naming_an_undeclared_stage(tmp_path):
    with pytest.raises(ConfigError) as exc:
        _build("pipeline.order=[admit,select_tier,route,prefill,decode,filter,sample,emit]", model=tmp_path)
    assert "filter" in str(exc.value) and "pipeline.order" in str(exc.value) or "order" in str(exc.value)


def test_stage_whose_inputs_nothing_upstream_produces(tmp_path):
    # sample needs the logits that decode produces: putting it first breaks the data flow
    with pytest.raises(ConfigError) as exc:
        _build("pipeline.order=[admit,select_tier,route,prefill,sample,decode,emit]", model=tmp_path)
    msg = str(exc.value)
    assert "'sample'" in msg and "logits" in msg and "no stage before it produces" in msg


class LateRequestStage(Stage):
    level = "request"
    inputs = ("request",)

    def __call__(self, ctx) -> None:
        pass


def test_request_stage_after_step_stage_is_rejected(tmp_path):
    with pytest.raises(ConfigError) as exc:
        _build(
            f"+pipeline.stages.late={{impl: '{__name__}:LateRequestStage'}}",
            "pipeline.order=[admit,select_tier,route,prefill,decode,sample,emit,late]",
            model=tmp_path,
        )
    assert "'late' is request-level but comes after a step-level stage" in str(exc.value)


def test_missing_model_directory_is_named(tmp_path):
    from litellm_pipeline.model.config import CheckpointError

    with pytest.raises(CheckpointError) as exc:
        _build(model=tmp_path / "nowhere")
    assert "nowhere" in str(exc.value)


def test_max_model_len_beyond_checkpoint(hf_checkpoint):
    with pytest.raises(ConfigError) as exc:
        _build("model.max_model_len=100000", model=hf_checkpoint("llama"))
    assert "100000" in str(exc.value) and "512" in str(exc.value)


def test_cuda_requested_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ConfigError) as exc:
        _build("device=cuda", model=tmp_path)
    assert "device.type" in str(exc.value) and "cuda" in str(exc.value)


def test_tier_spellings_resolve_against_the_checkpoint(hf_checkpoint):
    from litellm_pipeline.config.build import resolve_tiers
    from litellm_pipeline.config.schema import TierSection
    from litellm_pipeline.model.loader import load_model_config

    mc = load_model_config(hf_checkpoint("mixtral"))  # 4 experts, top-2
    specs = {"a": 1, "b": "native", "c": "2x", "d": "3x", "e": "all"}
    tiers = resolve_tiers({k: TierSection(experts_per_token=v) for k, v in specs.items()}, mc)
    assert [tiers[k].experts_per_token for k in "abcde"] == [1, 2, 4, 4, 4]


@pytest.mark.parametrize("key, value", [("num_blocks", 10**13), ("num_blocks", 10**8), ("cache.warm_blocks", 10**12)])
def test_kv_cache_larger_than_free_memory_is_refused_before_allocating(hf_checkpoint, key, value):
    with pytest.raises(ConfigError) as exc:
        LLM(model=str(hf_checkpoint("llama")), **{key: value})
    msg = str(exc.value)
    assert msg.startswith(f"cache.{key.split('.')[-1]}: {value} blocks") and "GiB free" in msg
