"""RoPE against transformers' LlamaRotaryEmbedding / apply_rotary_pos_emb (the oracle)."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from litellm_pipeline.model.rope import (
    RotaryEmbedding,
    apply_rotary,
    rope_parameters_from_config,
)

HEAD_DIM = 64
MAX_POS = 256

CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                    "mscale_all_dim": 0.707, "beta_fast": 4, "beta_slow": 2, "original_max_position_embeddings": 64},
    "yarn_no_truncate": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "truncate": False,
                         "original_max_position_embeddings": 64},
    "yarn_attention_factor": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "attention_factor": 0.8,
                              "original_max_position_embeddings": 64},
    "yarn_factor_from_lengths": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": None,
                                 "original_max_position_embeddings": 64},
}


def hf_config(rope_parameters: dict, max_pos: int = MAX_POS) -> dict:
    return {"hidden_size": HEAD_DIM * 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": HEAD_DIM,
            "intermediate_size": 32, "num_hidden_layers": 1, "vocab_size": 16, "max_position_embeddings": max_pos,
            "rope_parameters": dict(rope_parameters)}


def hf_cos_sin(config: dict, position_ids: torch.Tensor, dtype=torch.float32):
    """cos/sin [T, D] from a fresh transformers module for one forward over `position_ids` [T]."""
    rotary = LlamaRotaryEmbedding(LlamaConfig(**config))
    x = torch.zeros(1, position_ids.shape[0], HEAD_DIM, dtype=dtype)
    cos, sin = rotary(x, position_ids[None])
    return cos[0], sin[0]


def ours(config: dict, device=None) -> RotaryEmbedding:
    return RotaryEmbedding(HEAD_DIM, rope_parameters_from_config(config), config["max_position_embeddings"], device)


def assert_close(actual, expected):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_cos_sin_matches_transformers(name):
    config = hf_config(CASES[name])
    positions = torch.arange(3 * MAX_POS)  # well past both the original and the configured context
    rotary = ours(config)
    rotary.cos_sin(positions[:8])  # tables of the default length, kept per dtype: reserve must replace them
    rotary.reserve(positions.shape[0])
    cos, sin = rotary.cos_sin(positions)
    hf_cos, hf_sin = hf_cos_sin(config, positions)
    assert_close(cos, hf_cos)
    assert_close(sin, hf_sin)
    # a gathered, unordered subset reads the same rows as the full forward
    subset = torch.tensor([700, 3, 64, 65, 0, 255])
    assert_close(rotary.cos_sin(subset)[0], hf_cos[subset])


def test_scaling_changes_the_embedding():
    """Guards the comparisons above against a scaling that silently does nothing."""
    positions = torch.arange(2 * MAX_POS)
    default = ours(hf_config(CASES["default"]))
    default.reserve(positions.shape[0])
    plain = default.cos_sin(positions)[0]
    for name in ("linear", "llama3", "yarn", "yarn_mscale"):
        params = dict(CASES[name], rope_theta=10000.0)
        rotary = ours(hf_config(params))
        rotary.reserve(positions.shape[0])
        assert (rotary.cos_sin(positions)[0] - plain).abs().max() > 1e-2, name
    yarn = ours(hf_config(CASES["yarn_mscale"]))
    assert yarn.attention_scaling != 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cos_sin_cast_matches_transformers(dtype):
    config = hf_config(CASES["yarn"])
    positions = torch.arange(MAX_POS)
    cos, sin = ours(config).cos_sin(positions, dtype=dtype)
    hf_cos, hf_sin = hf_cos_sin(config, positions, dtype)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)


def test_dynamic_single_sequence_beyond_original_max():
    config = hf_config({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    rotary = ours(config)
    for length in (MAX_POS // 2, MAX_POS, MAX_POS + 1, 3 * MAX_POS + 7):
        positions = torch.arange(length)
        hf_cos, hf_sin = hf_cos_sin(config, positions)
        cos, sin = rotary.cos_sin(positions, torch.full((length,), length))
        assert_close(cos, hf_cos)
        assert_close(sin, hf_sin)
        assert_close(rotary.cos_sin(positions)[1], hf_sin)  # seq_lens=None: one sequence
    # past the original max the NTK base really moves
    long = torch.arange(3 * MAX_POS)
    default = ours(hf_config(CASES["default"]))
    default.reserve(long.shape[0])
    assert (rotary.cos_sin(long)[0] - default.cos_sin(long)[0]).abs().max() > 1e-2


def test_dynamic_mixed_batch_uses_each_tokens_seq_len():
    """A step packing a long prefill, a decode token past the original max and a short one."""
    config = hf_config({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})
    pieces = [torch.arange(300), torch.tensor([400]), torch.arange(10, 20)]
    positions = torch.cat(pieces)
    seq_lens = torch.cat([torch.full_like(p, int(p.max()) + 1) for p in pieces])
    cos, sin = ours(config).cos_sin(positions, seq_lens)
    expected = [hf_cos_sin(config, p) for p in pieces]
    assert_close(cos, torch.cat([c for c, _ in expected]))
    assert_close(sin, torch.cat([s for _, s in expected]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_matches_transformers(dtype):
    torch.manual_seed(0)
    T, Hq, Hk = 37, 4, 2
    config = hf_config(CASES["yarn"])
    positions = torch.arange(T) * 5
    q = torch.randn(T, Hq, HEAD_DIM, dtype=dtype)
    k = torch.randn(T, Hk, HEAD_DIM, dtype=dtype)
    cos, sin = ours(config).cos_sin(positions, dtype=dtype)
    q_rot, k_rot = apply_rotary(q, k, cos, sin)
    hf_cos, hf_sin = hf_cos_sin(config, positions, dtype)
    # transformers' layout: [B, H, T, D] with cos/sin [B, T, D] unsqueezed at dim 1
    hf_q, hf_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos[None], hf_sin[None]
    )
    assert q_rot.dtype == dtype and k_rot.dtype == dtype
    assert torch.equal(q_rot, hf_q[0].transpose(0, 1)) and torch.equal(k_rot, hf_k[0].transpose(0, 1))
    # fp32 tables handed to bf16 activations still round like transformers (cast first, then multiply)
    cos32, sin32 = ours(config).cos_sin(positions)
    assert torch.equal(apply_rotary(q, k, cos32, sin32)[0], q_rot)


def test_parameters_new_style():
    params = rope_parameters_from_config(hf_config(CASES["llama3"]))
    assert params == {**CASES["llama3"], "max_position_embeddings": MAX_POS}
    assert rope_parameters_from_config({"max_position_embeddings": 8}) == {
        "rope_type": "default", "rope_theta": 10000.0, "max_position_embeddings": 8}


def test_parameters_old_style():
    config = {"rope_theta": 50000.0, "rope_scaling": {"type": "linear", "factor": 2.0}, "max_position_embeddings": 64}
    assert rope_parameters_from_config(config) == {
        "rope_type": "linear", "rope_theta": 50000.0, "factor": 2.0, "max_position_embeddings": 64}
    # legacy yarn: pretraining length defaults to max_position_embeddings, a top-level value overrides it
    yarn = {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
            "max_position_embeddings": 512}
    assert rope_parameters_from_config(yarn)["original_max_position_embeddings"] == 512
    yarn["original_max_position_embeddings"] = 128
    params = rope_parameters_from_config(yarn)
    assert params["original_max_position_embeddings"] == 128
    # ... and that is what transformers ends up using too
    config = {**hf_config({}, max_pos=512), **yarn}
    del config["rope_parameters"]
    hf = LlamaRotaryEmbedding(LlamaConfig.from_dict(config))
    rotary = RotaryEmbedding(HEAD_DIM, params, 512)
    assert torch.equal(rotary.inv_freq, hf.inv_freq) and rotary.attention_scaling == hf.attention_scaling


@pytest.mark.parametrize("rope_type", ["mrope", "longrope", "su"])
def test_unsupported_rope_type_is_named(rope_type):
    config = {"max_position_embeddings": 64, "rope_scaling": {"type": rope_type, "factor": 2.0}}
    with pytest.raises(ValueError, match=rope_type) as info:
        rope_parameters_from_config(config)
    assert "yarn" in str(info.value)  # lists the supported ones
    with pytest.raises(ValueError, match=rope_type):
        RotaryEmbedding(HEAD_DIM, {"rope_type": rope_type, "rope_theta": 1.0}, 64)


def test_missing_scaling_key_is_named():
    with pytest.raises(ValueError, match="low_freq_factor"):
        rope_parameters_from_config({"max_position_embeddings": 64,
                                     "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["default", "llama3", "yarn_mscale", "dynamic"])
def test_cuda_matches_transformers(name):
    params = CASES.get(name, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    config = hf_config(params)
    positions = torch.arange(2 * MAX_POS, device="cuda")
    rotary = ours(config, device="cuda")
    rotary.reserve(positions.shape[0])
    cos, sin = rotary.cos_sin(positions, torch.full_like(positions, positions.shape[0]))
    hf = LlamaRotaryEmbedding(LlamaConfig(**config)).to("cuda")
    hf_cos, hf_sin = hf(torch.zeros(1, 1, device="cuda"), positions[None])
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])


def test_tables_live_on_the_device_the_model_is_built_on():
    """The loader builds a model under ``with torch.device(...)``: the rotary tables follow it (a GPU model's
    positions index tables on the GPU), while inv_freq is computed on the CPU first, as transformers does."""
    from litellm_pipeline.model.rope import RotaryEmbedding

    params = {"rope_type": "default", "rope_theta": 10000.0}
    cpu = RotaryEmbedding(16, params, 64)
    with torch.device("meta"):
        elsewhere = RotaryEmbedding(16, params, 64)
    assert cpu.device.type == "cpu" and cpu.tables()[0].device.type == "cpu"
    assert elsewhere.device.type == "meta" and elsewhere.inv_freq.device.type == "meta"
    assert all(t.device.type == "meta" and t.shape == (64, 16) for t in elsewhere.tables())
