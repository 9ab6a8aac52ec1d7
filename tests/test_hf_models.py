"""Checks of the tiny-HF-checkpoint helper (tests/hf_models.py) that parity tests rely on."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import (  # noqa: E402
    ARCHS,
    BOS_ID,
    BYTE_OFFSET,
    EOS_ID,
    MISTRAL_SLIDING_WINDOW,
    PAD_ID,
    VOCAB_SIZE,
    hf_generate,
    hf_logits,
    hf_logprobs_full,
    random_prompts,
    save_checkpoint,
    tiny_config,
)
from safetensors import safe_open  # noqa: E402

MAX_NEW = 8
PROMPTS = random_prompts([5, 11, 17], seed=1234)
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


def _keys(path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def _config_json(path) -> dict:
    return json.loads((path / "config.json").read_text())


# --------------------------------------------------------------------------- config / files


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_config_features(arch):
    cfg = tiny_config(arch)
    assert cfg.model_type == arch
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (VOCAB_SIZE, 64, 2, 4)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert cfg.max_position_embeddings == 512
    assert cfg.num_key_value_heads == (1 if arch == "qwen3" else 2)
    assert cfg.tie_word_embeddings == (arch == "llama")
    if arch == "qwen3":
        assert cfg.head_dim == 32 != cfg.hidden_size // cfg.num_attention_heads
    if arch == "mistral":
        assert cfg.sliding_window == MISTRAL_SLIDING_WINDOW
    elif arch in ("qwen2", "qwen3", "qwen3_moe", "mixtral", "llama"):
        assert getattr(cfg, "sliding_window", None) is None
    if arch in MOE_ARCHS:
        n_exp = cfg.num_local_experts if arch == "mixtral" else cfg.num_experts
        assert (n_exp, cfg.num_experts_per_tok) == (4, 2)
    if arch == "qwen2_moe":
        assert cfg.norm_topk_prob is False and cfg.shared_expert_intermediate_size > 0
    if arch == "qwen3_moe":
        assert cfg.norm_topk_prob is True
    assert tiny_config(arch, num_hidden_layers=1).num_hidden_layers == 1


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_layout(arch, hf_checkpoint):
    path = hf_checkpoint(arch)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).is_file(), name
    keys = _keys(path)
    print(f"\n[{arch}] safetensors keys (layer 0 + globals):")
    for k in sorted(keys):
        if ".layers.1." not in k:
            print(f"  {k} {keys[k]}")
    print(f"[{arch}] config.json: {json.dumps(_config_json(path), sort_keys=True)}")

    assert ("lm_head.weight" in keys) == (arch != "llama")  # tied -> not stored
    attn = "model.layers.0.self_attn."
    has_bias = arch in ("qwen2", "qwen2_moe")
    assert (attn + "q_proj.bias" in keys) == has_bias
    assert (attn + "k_proj.bias" in keys) == has_bias
    assert attn + "o_proj.bias" not in keys
    if arch in ("qwen3", "qwen3_moe"):
        hd = 32 if arch == "qwen3" else 16
        assert keys[attn + "q_norm.weight"] == keys[attn + "k_norm.weight"] == (hd,)
    if arch == "qwen3":
        assert keys[attn + "q_proj.weight"] == (4 * 32, 64)
        assert keys[attn + "k_proj.weight"] == keys[attn + "v_proj.weight"] == (1 * 32, 64)
        assert keys[attn + "o_proj.weight"] == (64, 4 * 32)

    # MoE: transformers 5 fuses experts in memory (experts.gate_up_proj / experts.down_proj)
    # but save_pretrained writes the classic per-expert layout.
    assert not any("gate_up_proj" in k for k in keys)
    if arch == "mixtral":
        for e in range(4):
            for w in ("w1", "w2", "w3"):
                assert f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight" in keys
        assert keys["model.layers.0.block_sparse_moe.gate.weight"] == (4, 64)
        assert keys["model.layers.0.block_sparse_moe.experts.0.w1.weight"] == (128, 64)
        assert keys["model.layers.0.block_sparse_moe.experts.0.w2.weight"] == (64, 128)
    elif arch in ("qwen2_moe", "qwen3_moe"):
        for e in range(4):
            for w in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.0.mlp.experts.{e}.{w}.weight" in keys
        assert keys["model.layers.0.mlp.gate.weight"] == (4, 64)
        assert keys["model.layers.0.mlp.experts.0.gate_proj.weight"] == (32, 64)
        assert keys["model.layers.0.mlp.experts.0.down_proj.weight"] == (64, 32)
        if arch == "qwen2_moe":
            assert keys["model.layers.0.mlp.shared_expert.gate_proj.weight"] == (48, 64)
            assert keys["model.layers.0.mlp.shared_expert_gate.weight"] == (1, 64)
        else:
            assert not any("shared_expert" in k for k in keys)
    else:
        assert keys["model.layers.0.mlp.gate_proj.weight"] == (128, 64)


def test_checkpoint_is_deterministic_and_not_default_init(tmp_path):
    a = save_checkpoint("qwen3", tmp_path / "a", seed=7)
    b = save_checkpoint("qwen3", tmp_path / "b", seed=7)
    c = save_checkpoint("qwen3", tmp_path / "c", seed=8)
    with safe_open(str(a / "model.safetensors"), "pt") as fa, safe_open(str(b / "model.safetensors"), "pt") as fb, \
            safe_open(str(c / "model.safetensors"), "pt") as fc:
        for k in fa.keys():
            assert torch.equal(fa.get_tensor(k), fb.get_tensor(k)), k
        q = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(fa.get_tensor(q), fc.get_tensor(q))
        assert fa.get_tensor(q).std() > 0.05  # far above transformers' 0.02 default
        norm = fa.get_tensor("model.layers.0.self_attn.q_norm.weight")
        assert not torch.all(norm == 1)  # norm weights are randomised around 1


def test_tokenizer(hf_checkpoint):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    path = hf_checkpoint("llama")
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert raw.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    text = "hi é👋"
    ids = raw.encode(text).ids
    assert ids == [BOS_ID] + [BYTE_OFFSET + b for b in text.encode()]
    assert raw.decode(ids, skip_special_tokens=True) == text
    assert raw.decode([BYTE_OFFSET + 255, BYTE_OFFSET + 0]) == b"\xff\x00".decode("utf-8", "replace")
    assert raw.decode([VOCAB_SIZE - 1]) == f"<|extra_{VOCAB_SIZE - 1 - BYTE_OFFSET - 256}|>"

    tok = AutoTokenizer.from_pretrained(str(path))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert tok(text)["input_ids"] == ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hey"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<s><|user|>\nhey\n<|assistant|>\n"


# --------------------------------------------------------------------------- reference generation


def _min_gap(logits: torch.Tensor) -> float:
    top2 = logits.topk(2, dim=-1).values
    return float((top2[..., 0] - top2[..., 1]).min())


def _check_batched_vs_alone(path, prompts):
    batched = hf_generate(path, prompts, MAX_NEW)
    assert len(batched) == len(prompts)
    for prompt, (toks, lps) in zip(prompts, batched):
        assert len(toks) == MAX_NEW and len(lps) == MAX_NEW
        assert all(0 <= t < VOCAB_SIZE for t in toks)
        assert all(lp <= 0.0 for lp in lps)
        alone_toks, alone_lps = hf_generate(path, [prompt], MAX_NEW)[0]
        assert alone_toks == toks, f"left padding changed the greedy output for a {len(prompt)}-token prompt"
        assert alone_lps == pytest.approx(lps, abs=1e-3)
    return batched


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_reference(arch, hf_checkpoint):
    path = hf_checkpoint(arch)
    batched = _check_batched_vs_alone(path, PROMPTS)

    new, logits = hf_logits(path, PROMPTS, MAX_NEW)
    assert new.shape == (len(PROMPTS), MAX_NEW) and logits.shape == (len(PROMPTS), MAX_NEW, VOCAB_SIZE)
    assert torch.isfinite(logits).all()
    # greedy == argmax of the raw logits (no logits processor touched them)
    assert torch.equal(new, logits.argmax(-1))
    assert [t for t, _ in batched] == new.tolist()
    gap = _min_gap(logits)
    print(f"\n[{arch}] tokens={new.tolist()} min top1-top2 gap={gap:.4f} logit std={logits.std():.2f}")
    assert gap > 1e-3, "near-tied logits: greedy parity would be decided by float noise"
    # not a degenerate model: some variety across prompts / steps
    assert len(set(new.flatten().tolist())) >= 4


def test_logprobs_full(hf_checkpoint):
    path = hf_checkpoint("qwen2_moe")
    full = hf_logprobs_full(path, PROMPTS, MAX_NEW)
    gen = hf_generate(path, PROMPTS, MAX_NEW)
    assert len(full) == len(PROMPTS)
    for rows, (toks, lps) in zip(full, gen):
        assert len(rows) == MAX_NEW
        for row, t, lp in zip(rows, toks, lps):
            assert row.shape == (VOCAB_SIZE,) and row.dtype == torch.float32
            assert float(torch.logsumexp(row, 0)) == pytest.approx(0.0, abs=1e-5)
            assert int(row.argmax()) == t
            assert float(row[t]) == pytest.approx(lp, abs=1e-6)


def test_generate_bf16(hf_checkpoint):
    out = hf_generate(hf_checkpoint("qwen3"), PROMPTS, 4, dtype=torch.bfloat16)
    assert [len(t) for t, _ in out] == [4, 4, 4]


@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen3_moe"])
def test_ignore_eos(arch, hf_checkpoint):
    """These tiny models do emit EOS (id 1) mid-sequence: by default it is not a stop token
    (plain argmax, every row runs max_new_tokens); ignore_eos=False stops right after it."""
    path = hf_checkpoint(arch)
    free = hf_generate(path, PROMPTS, MAX_NEW)
    assert any(EOS_ID in toks[:-1] for toks, _ in free), "fixture no longer exercises EOS"
    stopped = hf_generate(path, PROMPTS, MAX_NEW, ignore_eos=False)
    for (a, lpa), (b, lpb) in zip(free, stopped):
        n = a.index(EOS_ID) + 1 if EOS_ID in a else len(a)
        assert b == a[:n]
        assert lpb == pytest.approx(lpa[:n], abs=1e-4)


# --------------------------------------------------------------------------- sliding window


def test_mistral_long_prompts_batched_vs_alone(hf_checkpoint):
    path = hf_checkpoint("mistral")
    prompts = random_prompts([3, 2 * MISTRAL_SLIDING_WINDOW + 4, 4 * MISTRAL_SLIDING_WINDOW], seed=99)
    _check_batched_vs_alone(path, prompts)
    # the window really is active: without it the long prompts decode differently
    windowed = hf_logits(path, prompts, MAX_NEW)[1]
    full_path = hf_checkpoint("mistral", sliding_window=None)
    full = hf_logits(full_path, prompts, MAX_NEW)[1]
    assert torch.allclose(windowed[0, 0], full[0, 0], atol=1e-4)  # 3 tokens < window: identical first step
    assert not torch.allclose(windowed[2], full[2], atol=1e-2)


def test_mistral_window_is_q_minus_k_lt_window(tmp_path):
    """One layer: the last query sees key j iff (q - j) < sliding_window (the window counts
    the query itself, i.e. it attends to the last `sliding_window` tokens)."""
    w = MISTRAL_SLIDING_WINDOW
    path = save_checkpoint("mistral", tmp_path / "m1", num_hidden_layers=1)
    n = 3 * w
    base = random_prompts([n], seed=5)[0]

    def last_logits(prompt):
        return hf_logits(path, [prompt], 1)[1][0, 0]

    ref = last_logits(base)
    q = n - 1
    for dist, visible in ((w - 1, True), (w, False), (w + 3, False)):
        pert = list(base)
        pert[q - dist] = BYTE_OFFSET + (base[q - dist] - BYTE_OFFSET + 128) % 256
        changed = not torch.allclose(last_logits(pert), ref, atol=1e-5)
        assert changed == visible, f"q - k = {dist}"
