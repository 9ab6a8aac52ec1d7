"""cache.dtype: a float16 / bfloat16 KV cache under float32 weights (half the bytes a decode step reads per cached
token). Every path attends over the same rounded K/V: the whole-model decode call, the per-layer blocks, the ops
one by one and the sdpa reference; preemption, the warm tier and the prefix cache keep outputs; the pool holds twice
the blocks in the same memory; a cache the kernels cannot read is refused by name."""

from __future__ import annotations

import pytest
import torch
from _engine_util import events
from hf_models import random_prompts

from litellm_pipeline import LLM, SamplingParams
from litellm_pipeline.errors import ConfigError
from litellm_pipeline.telemetry import RequestPreempted

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)


def _generate(llm, prompts, params=PARAMS):
    outs = llm.generate(prompts, params)
    assert llm.engine.rt.pool.is_empty()
    return [(o.token_ids, [lp[t] for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
def test_every_attention_path_reads_the_same_rounded_cache(arch, kv, hf_checkpoint):
    path = str(hf_checkpoint(arch))
    prompts = random_prompts((5, 13, 40), seed=3)
    runs = {}
    for mode in ("model", "layer", "ops", "sdpa"):
        over = [f"cache.dtype={kv}"] + (["pipeline.stages.decode.params.attention=sdpa"] if mode == "sdpa" else [])
        llm = LLM(model=path, overrides=over)
        model = llm.engine.rt.model
        k_cache, v_cache = llm.engine.rt.kv_caches[0]
        assert k_cache.dtype == v_cache.dtype == getattr(torch, kv)
        assert model.embed_tokens.dtype == torch.float32
        if mode in ("layer", "ops"):
            model.fused_decode_layers = None
        if mode == "ops":
            for layer in model.layers:
                layer.fused_decode = None
        runs[mode] = _generate(llm, prompts)
    # the C++ paths round and read alike, bit for bit
    assert runs["model"] == runs["layer"] == runs["ops"]
    # sdpa attends over the same values with torch's arithmetic: the same tokens, logprobs within float32 noise
    assert [t for t, _ in runs["sdpa"]] == [t for t, _ in runs["ops"]]
    for (_, a), (_, b) in zip(runs["sdpa"], runs["ops"]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 2e-3
    # and the rounding is real: a float32 cache gives other logprobs (close: same model)
    full = _generate(LLM(model=path), prompts)
    drift = max(abs(x - y) for (_, a), (_, b) in zip(full, runs["ops"]) for x, y in zip(a, b))
    assert 0 < drift < 0.1, drift


def test_the_pool_holds_twice_the_blocks_in_the_same_memory(hf_checkpoint):
    path = str(hf_checkpoint("llama"))
    over = ["cache.memory_gb=0.001", "engine.max_num_seqs=10000"]
    wide = LLM(model=path, overrides=over).engine.rt.pool.num_blocks
    narrow = LLM(model=path, overrides=over + ["cache.dtype=float16"]).engine.rt.pool.num_blocks
    assert narrow == 2 * wide


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_and_the_warm_tier_keep_outputs(hf_checkpoint, mode):
    path = str(hf_checkpoint("mixtral"))
    prompts = random_prompts((20, 28, 12, 33), seed=16)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    base = ["cache.dtype=bfloat16"]
    fresh = LLM(model=path, overrides=base + ["cache.enable_prefix_caching=false"])
    want = [o.token_ids for o in fresh.generate(prompts, params)]
    llm = LLM(model=path, overrides=base + ["cache.block_size=4", "cache.num_blocks=24", f"engine.preemption={mode}",
                                            "cache.warm_blocks=64"])
    assert llm.engine.rt.kv.warm is None or llm.engine.rt.kv.warm.kv[0][0].dtype == torch.bfloat16
    sink = events(llm)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert {e.mode for e in sink.of(RequestPreempted)} == {mode}
    again = llm.generate(prompts[:1], params)[0]  # its blocks come back from the prefix cache
    assert again.num_cached_tokens > 0 and again.token_ids == want[0]
    assert llm.engine.rt.pool.is_empty()


@pytest.mark.parametrize("over,match", [
    (["cache.dtype=int8"], "cache.dtype: 'int8' is not one of"),
    (["device.dtype=bfloat16", "cache.dtype=float16"], "cache.dtype=float16 under device.dtype=bfloat16"),
    (["device.dtype=float16", "cache.dtype=float32"], "cache.dtype=float32 under device.dtype=float16"),
])
def test_a_cache_dtype_the_kernels_cannot_read_is_refused_by_name(hf_checkpoint, over, match):
    with pytest.raises(ConfigError, match=match):
        LLM(model=str(hf_checkpoint("llama")), overrides=over)
