"""Bad checkpoints: every failure names the file (or lists what is supported) and leaves nothing behind."""

from __future__ import annotations

import json
import shutil

import pytest

from litellm_pipeline import LLM
from litellm_pipeline.model.config import CheckpointError
from litellm_pipeline.text.tokenizer import TokenizerError


@pytest.fixture
def ckpt(hf_checkpoint, tmp_path):
    """A private copy of a tiny MoE checkpoint that a test may damage."""
    dst = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoint("qwen2_moe"), dst)
    return dst


def test_missing_config_json(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        LLM(model=str(ckpt))


def test_corrupt_config_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"corrupt JSON in .*config.json"):
        LLM(model=str(ckpt))


def test_unsupported_architecture_lists_supported(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as exc:
        LLM(model=str(ckpt))
    msg = str(exc.value)
    assert "GPT2LMHeadModel" in msg
    for arch in ("LlamaForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "Qwen3ForCausalLM"):
        assert arch in msg


def test_missing_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        LLM(model=str(ckpt))


def test_corrupt_weights_file(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        LLM(model=str(ckpt))


def test_garbage_weights_header(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=r"corrupt safetensors file .*model\.safetensors"):
        LLM(model=str(ckpt))


def test_missing_shard_named(ckpt, tmp_path):
    from hf_models import _write_tokenizer, build_model

    sharded = tmp_path / "sharded"
    model = build_model("llama")
    model.save_pretrained(sharded, max_shard_size="100KB")
    _write_tokenizer(sharded, 512, 384)
    victim = sorted(sharded.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError) as exc:
        LLM(model=str(sharded))
    assert victim.name in str(exc.value) and "missing" in str(exc.value)


def test_weight_missing_from_checkpoint(ckpt):
    from safetensors.torch import load_file, save_file

    tensors = load_file(ckpt / "model.safetensors")
    tensors.pop("model.layers.1.mlp.experts.2.up_proj.weight")
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"lacks weights .*layers\.1\.mlp\.w13"):
        LLM(model=str(ckpt))


def test_shape_mismatch_named(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["hidden_size"] = 48
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="shape mismatch"):
        LLM(model=str(ckpt))


def test_missing_tokenizer_named(ckpt):
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        LLM(model=str(ckpt))
