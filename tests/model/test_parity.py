"""Token-for-token parity with transformers on tiny random checkpoints of every supported family.

For each architecture: three prompts of different lengths generated together in one batch (and, for the
engine, in one continuous batch), 24 greedy tokens identical to ``transformers.generate`` and per-token
log-probabilities within 1e-3, float32.
"""

from __future__ import annotations

import json

import pytest
import torch
from hf_models import ARCHS, build_model, hf_generate, random_prompts, save_checkpoint

from litellm_pipeline import LLM, SamplingParams
from litellm_pipeline.model.config import ModelConfig

NEW_TOKENS = 24
LENGTHS = (5, 13, 31)


def _ours(path, prompts, **kw):
    llm = LLM(model=str(path), **kw)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    assert llm.engine.rt.pool.is_empty()
    return [(o.token_ids, [lp[t] for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs]


def _assert_parity(ref, ours):
    for i, ((rt, rl), (ot, ol)) in enumerate(zip(ref, ours)):
        assert ot == rt, f"prompt {i}: tokens differ\n ours {ot}\n hf   {rt}"
        diff = max(abs(a - b) for a, b in zip(rl, ol))
        assert diff < 1e-3, f"prompt {i}: logprob differs by {diff}"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_parity(arch, hf_checkpoint):
    path = hf_checkpoint(arch)
    prompts = random_prompts(LENGTHS, seed=1)
    _assert_parity(hf_generate(path, prompts, NEW_TOKENS), _ours(path, prompts))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("attention_bias", [False, True])
def test_attention_biases_follow_transformers(arch, attention_bias):
    """Which projections carry a bias is what transformers builds: q/k/v/o on Llama and Qwen3 (dense, MoE) with
    attention_bias, q/k/v only (always) on Qwen2 and Qwen2-MoE, none on Mistral and Mixtral whatever the config."""
    model = build_model(arch, attention_bias=attention_bias)
    attn = model.model.layers[0].self_attn
    cfg = model.config.to_dict()
    cfg["architectures"] = [type(model).__name__]
    ours = ModelConfig.from_dict(cfg)
    assert ours.attention_bias == (attn.q_proj.bias is not None)
    assert ours.o_bias == (attn.o_proj.bias is not None)


@pytest.mark.parametrize("layer_ops", ["torch", "cpu_fused"])
def test_llama_attention_bias_parity(layer_ops, hf_checkpoint):
    """A Llama saved with attention_bias: true has q/k/v AND o_proj biases; all four load and apply, op by op
    (torch) and through the fused decode calls (cpu_fused)."""
    from safetensors import safe_open

    path = hf_checkpoint("llama", attention_bias=True)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for layer in range(2):
            for proj in "qkvo":
                b = f.get_tensor(f"model.layers.{layer}.self_attn.{proj}_proj.bias")
                assert b.abs().min() > 0, f"{proj}_proj bias of layer {layer} has zeros"
    prompts = random_prompts(LENGTHS, seed=8)
    llm = LLM(model=str(path), overrides=[f"pipeline.stages.decode.params.layer_ops={layer_ops}"])
    model = llm.engine.rt.model
    assert all(layer.self_attn.o_bias is not None for layer in model.layers)
    calls = []
    if layer_ops == "cpu_fused" and model.layers[0].fused_decode is not None:  # the C++ kernels built
        whole, tokens = model.fused_decode_layers, model.decode_tokens  # the whole-model decode takes the o bias too
        assert whole is not None
        model.fused_decode_layers = lambda *a, **k: calls.append(1) or whole(*a, **k)
        model.decode_tokens = lambda *a, **k: calls.append(1) or tokens(*a, **k)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    assert llm.engine.rt.pool.is_empty()
    assert bool(calls) == (layer_ops == "cpu_fused" and model.layers[0].fused_decode is not None)
    ours = [(o.token_ids, [lp[t] for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs]
    _assert_parity(hf_generate(path, prompts, NEW_TOKENS), ours)


def test_parity_with_chunked_prefill_and_small_blocks(hf_checkpoint):
    """The same tokens when prompts are prefilled in 8-token chunks over 4-token KV blocks."""
    path = hf_checkpoint("mixtral")
    prompts = random_prompts(LENGTHS, seed=2)
    ours = _ours(path, prompts, block_size=4, max_num_batched_tokens=8)
    _assert_parity(hf_generate(path, prompts, NEW_TOKENS), ours)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 16, "rope_theta": 10000.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0},
    ],
    ids=lambda r: r["rope_type"],
)
def test_rope_scaling_parity(rope, tmp_path):
    """Scaled RoPE as the checkpoint's config asks, with prompts past the original context."""
    path = save_checkpoint("llama", tmp_path, rope_parameters=rope, max_position_embeddings=128)
    prompts = random_prompts((7, 29), seed=3)
    _assert_parity(hf_generate(path, prompts, NEW_TOKENS), _ours(path, prompts))


def test_dynamic_ntk_parity(tmp_path):
    """Dynamic NTK rescales with the sequence length; transformers does it per forward, so one prompt."""
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    path = save_checkpoint("llama", tmp_path, rope_parameters=rope, max_position_embeddings=24)
    prompts = random_prompts((12,), seed=4)  # crosses 24 positions while generating
    _assert_parity(hf_generate(path, prompts, NEW_TOKENS), _ours(path, prompts, max_model_len=48))


def test_legacy_rope_scaling_keys(tmp_path):
    """Hub checkpoints spell RoPE as rope_theta + rope_scaling{type: ...}; both spellings load the same."""
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    path = save_checkpoint("llama", tmp_path, rope_parameters=rope)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg["rope_theta"], cfg["rope_scaling"] = 10000.0, {"type": "linear", "factor": 2.0}
    (path / "config.json").write_text(json.dumps(cfg))
    prompts = random_prompts((9, 20), seed=5)
    ref = hf_generate(save_checkpoint("llama", tmp_path / "ref", rope_parameters=rope), prompts, NEW_TOKENS)
    _assert_parity(ref, _ours(path, prompts))


def test_sharded_checkpoint_parity(tmp_path):
    """A checkpoint split into shards with model.safetensors.index.json loads to the same model."""
    from hf_models import _write_tokenizer, build_model

    model = build_model("qwen2_moe")
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    _write_tokenizer(tmp_path, model.config.max_position_embeddings, model.config.vocab_size)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    prompts = random_prompts((6, 17), seed=6)
    _assert_parity(hf_generate(tmp_path, prompts, NEW_TOKENS), _ours(tmp_path, prompts))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(dtype, hf_checkpoint):
    """Lower-precision weights load and generate; the first greedy token agrees with float32."""
    path = hf_checkpoint("mixtral")
    prompts = random_prompts((8, 16), seed=7)
    llm = LLM(model=str(path), dtype=dtype)
    assert llm.engine.rt.model.embed_tokens.dtype == getattr(torch, dtype)
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    ref = hf_generate(path, prompts, 4)
    assert [o.token_ids[0] for o in outs] == [r[0][0] for r in ref]


def test_float16_checkpoint_loads_in_every_precision(tmp_path):
    """A checkpoint stored in float16 (safetensors F16) runs in float16, bfloat16 and float32; greedy tokens of the
    16-bit runs start as transformers' float32 run of the same weights does."""
    import transformers  # noqa: F401
    from hf_models import _write_tokenizer, build_model

    model = build_model("llama", seed=3).to(torch.float16)
    model.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path, model.config.max_position_embeddings, model.config.vocab_size)
    prompts = random_prompts((7, 15), seed=9)
    ref = hf_generate(tmp_path, prompts, 4)
    for dtype in ("float16", "bfloat16", "float32"):
        llm = LLM(model=str(tmp_path), dtype=dtype)
        assert llm.engine.rt.model.embed_tokens.dtype == getattr(torch, dtype)
        outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert [o.token_ids[0] for o in outs] == [r[0][0] for r in ref], dtype
