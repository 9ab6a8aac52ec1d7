"""CUDA paths: the same engine on a GPU (skipped cleanly without one)."""

from __future__ import annotations

import pytest
import torch
from hf_models import hf_generate, random_prompts

from litellm_pipeline import LLM, SamplingParams
from litellm_pipeline.telemetry import MemorySink, RequestPreempted

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mixtral", "qwen2_moe"])
def test_cuda_float32_greedy_parity(arch, hf_checkpoint):
    path = hf_checkpoint(arch)
    prompts = random_prompts((5, 19, 33), seed=21)
    llm = LLM(model=str(path), device="cuda", dtype="float32")
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0))
    ref = hf_generate(path, prompts, 16)
    for o, (toks, lps) in zip(outs, ref):
        assert o.token_ids == toks
        assert max(abs(o.logprobs[i][t] - lp) for i, (t, lp) in enumerate(zip(toks, lps))) < 1e-3
    assert llm.engine.rt.pool.is_empty()


def test_cuda_warm_tier_is_pinned_and_swap_keeps_outputs(hf_checkpoint):
    path = str(hf_checkpoint("mixtral"))
    prompts = random_prompts((20, 28, 12, 33), seed=22)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in LLM(model=path, device="cuda", dtype="float32").generate(prompts, params)]
    llm = LLM(model=path, device="cuda", dtype="float32", block_size=4, num_blocks=24,
              overrides=["telemetry=memory"], **{"engine.preemption": "swap", "cache.warm_blocks": 64})
    assert llm.engine.rt.kv.warm.kv[0][0].is_pinned()
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    sink = llm.engine.bus.sink(MemorySink)
    assert any(e.mode == "swap" for e in sink.of(RequestPreempted)) and llm.engine.rt.pool.is_empty()


def test_auto_device_picks_cuda(hf_checkpoint):
    llm = LLM(model=str(hf_checkpoint("llama")), device="auto")
    assert llm.engine.rt.device.type == "cuda"
