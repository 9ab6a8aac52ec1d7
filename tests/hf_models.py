"""Tiny Hugging Face checkpoints + reference greedy generation for parity tests.

Everything here is built with ``transformers`` / ``tokenizers`` only, so it can be
used as ground truth for ``litellm_pipeline``'s own loader and runtime:

* :func:`tiny_config` -- a tiny config per architecture that still exercises every
  feature a loader has to get right (GQA/MQA, explicit ``head_dim``, attention bias,
  q/k norm, sliding window, tied embeddings, MoE routing variants, shared expert).
* :func:`save_checkpoint` -- seeds torch, builds the model with
  ``AutoModelForCausalLM.from_config``, re-initialises the weights with a large std
  (so greedy argmax is decided by clear logit gaps, not float noise), and writes
  ``model.safetensors`` + ``config.json`` + ``generation_config.json`` + a byte-level
  ``tokenizer.json`` / ``tokenizer_config.json``.
* :func:`hf_generate` -- one batched, left-padded, greedy ``model.generate`` call;
  returns generated ids and the log-prob of each chosen token.
* :func:`hf_logprobs_full` -- same generation, full log-softmax rows per step.

Token ids: 0 = ``<s>`` (bos), 1 = ``</s>`` (eos), 2 = ``<pad>``; byte ``b`` is id ``3 + b``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import torch

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe")

BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
BYTE_OFFSET = 3  # byte b -> token id 3 + b
VOCAB_SIZE = 384  # ids 259..383 are the non-special added tokens "<|extra_i|>" (random models do emit them)
MISTRAL_SLIDING_WINDOW = 8

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
    tie_word_embeddings=False,
)

_ARCH_OVERRIDES: dict[str, dict[str, Any]] = {
    # tied lm_head: model.safetensors has no lm_head.weight
    "llama": dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # q/k/v bias (Qwen2 always has it; there is no attention_bias field)
    "qwen2": dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # MQA (1 kv head), head_dim 32 != hidden/heads (16), q_norm/k_norm of size head_dim
    "qwen3": dict(
        num_key_value_heads=1,
        head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # sliding window on every layer
    "mistral": dict(sliding_window=MISTRAL_SLIDING_WINDOW, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # 4 experts, top-2, softmax over the top-k logits (== renormalised top-k probs)
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None, rms_norm_eps=1e-5),
    # 4 experts, top-2, NOT renormalised, plus a sigmoid-gated shared expert
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    # 4 experts, top-2, renormalised
    "qwen3_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
}


def tiny_config(arch: str, **overrides):
    """A tiny ``transformers`` config for ``arch`` (see module docstring). ``overrides`` win."""
    from transformers import AutoConfig

    if arch not in _ARCH_OVERRIDES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    kw = {**_COMMON, **_ARCH_OVERRIDES[arch], **overrides}
    return AutoConfig.for_model(arch, **kw)


# --------------------------------------------------------------------------- weights


@torch.no_grad()
def _reinit_(model: torch.nn.Module, seed: int, init_std: float, logit_scale: float, embed_std: float) -> None:
    """Deterministic, deliberately "loud" init (the transformers default, std 0.02, gives
    near-uniform logits whose argmax is decided by float noise).

    * every 2-D linear weight: normal(0, init_std / sqrt(fan_in)) (variance preserving);
    * fused expert tensors (3-D, [experts, out, in]): same, per expert;
    * MoE router weights: 2x that, so top-k choices are far from ties;
    * embeddings: normal(0, embed_std); default 1.0 (same scale as the block outputs, which
      keeps random models from collapsing into repeating one token), but 0.05 with a tied
      lm_head (otherwise e_x . h makes the model echo its input token forever);
    * lm_head (untied): normal(0, logit_scale / sqrt(hidden)) -> logits std ~logit_scale,
      top1-top2 gaps are typically ~1, rarely < 1e-2;
    * RMSNorm weights (incl. q_norm/k_norm): 1 + uniform(-0.25, 0.25) (not all ones, so a
      loader that ignores them is caught); with a tied lm_head the final norm weight is
      additionally scaled by logit_scale / (embed_std * sqrt(hidden)) to get the same logit std;
    * biases: normal(0, 0.5) (nonzero, so a loader that drops them is caught).
    """
    g = torch.Generator().manual_seed(seed)

    def normal_(t: torch.Tensor, std: float) -> None:
        t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).mul_(std).to(t.dtype))

    hidden = model.config.hidden_size
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        module, _, leaf = name.rpartition(".")
        if "norm" in module.rpartition(".")[2]:  # input_layernorm, post_attention_layernorm, norm, q_norm, k_norm
            p.copy_(1.0 + (torch.rand(p.shape, generator=g) - 0.5) * 0.5)
            if tied and module == "model.norm":
                p.mul_(logit_scale / (embed_std * math.sqrt(hidden)))
        elif name.endswith("embed_tokens.weight"):
            normal_(p, embed_std)
        elif name.startswith("lm_head"):
            normal_(p, logit_scale / math.sqrt(hidden))
        elif leaf == "bias":
            normal_(p, 0.5)
        elif p.dim() == 3:  # fused experts [E, out, in]
            normal_(p, init_std / math.sqrt(p.shape[-1]))
        elif p.dim() == 2:
            std = init_std / math.sqrt(p.shape[-1])
            if module.endswith("mlp.gate") or module.endswith("block_sparse_moe.gate"):
                std *= 2.0  # router
            normal_(p, std)
        else:
            normal_(p, 0.5)
    if tied:
        model.tie_weights()


# --------------------------------------------------------------------------- tokenizer


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode char table (the ByteLevel alphabet), in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tokenizer(vocab_size: int = VOCAB_SIZE):
    """Byte-level BPE (no merges): ``<s>``=0, ``</s>``=1, ``<pad>``=2, byte b = 3 + b, and
    non-special added tokens ``<|extra_i|>`` = 259 + i up to ``vocab_size``."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    vocab = {"<s>": BOS_ID, "</s>": EOS_ID, "<pad>": PAD_ID}
    b2u = bytes_to_unicode()
    for b in range(256):
        vocab[b2u[b]] = BYTE_OFFSET + b
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<s>", "</s>", "<pad>")])
    # ids 259..vocab_size-1 exist in the model (random models do emit them): make them decodable
    extra = [AddedToken(f"<|extra_{i}|>", special=False, normalized=False) for i in range(vocab_size - BYTE_OFFSET - 256)]
    if extra:
        tok.add_tokens(extra)
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A",
        pair="<s> $A <s> $B",
        special_tokens=[("<s>", BOS_ID)],
    )
    return tok


def _write_tokenizer(path: Path, max_len: int, vocab_size: int) -> None:
    build_tokenizer(vocab_size).save(str(path / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (path / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


# --------------------------------------------------------------------------- checkpoint


def build_model(
    arch: str, seed: int = 0, init_std: float = 1.0, logit_scale: float = 8.0, embed_std: float | None = None, **overrides
):
    """The re-initialised float32 ``transformers`` model (not saved)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, **overrides)
    if embed_std is None:
        embed_std = 0.05 if cfg.tie_word_embeddings else 1.0
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _reinit_(model, seed, init_std, logit_scale, embed_std)
    return model.eval()


def save_checkpoint(
    arch: str,
    path,
    seed: int = 0,
    init_std: float = 1.0,
    logit_scale: float = 8.0,
    embed_std: float | None = None,
    **overrides,
) -> Path:
    """Write a tiny HF checkpoint for ``arch`` into ``path`` (created if needed) and return it.

    ``init_std`` scales the variance-preserving linear init, ``logit_scale`` is the std of
    the final logits, ``embed_std`` the embedding std (see :func:`_reinit_`). ``overrides`` go to :func:`tiny_config`.
    """
    from transformers import GenerationConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = build_model(arch, seed=seed, init_std=init_std, logit_scale=logit_scale, embed_std=embed_std, **overrides)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path, model.config.max_position_embeddings, model.config.vocab_size)
    return path


# --------------------------------------------------------------------------- reference generation

_MODEL_CACHE: dict[tuple, Any] = {}


def load_hf_model(path, dtype=torch.float32, attn_implementation: str | None = None):
    """``AutoModelForCausalLM.from_pretrained`` (cached per path + weights mtime / dtype / attn impl)."""
    from transformers import AutoModelForCausalLM

    path = Path(path).resolve()
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns if weights.exists() else None  # re-saved checkpoint -> reload
    key = (str(path), stamp, str(dtype), attn_implementation)
    model = _MODEL_CACHE.get(key)
    if model is None:
        kw = {"dtype": dtype}
        if attn_implementation is not None:
            kw["attn_implementation"] = attn_implementation
        model = AutoModelForCausalLM.from_pretrained(str(path), **kw).eval()
        _MODEL_CACHE[key] = model
    return model


def _left_pad(prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("need at least one non-empty prompt")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


@torch.no_grad()
def _generate_logits(
    path, prompts, max_new_tokens: int, dtype, ignore_eos: bool, attn_implementation: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (generated ids [B, T], raw float32 logits [B, T, V]) from ONE batched generate."""
    from transformers import GenerationConfig

    model = load_hf_model(path, dtype=dtype, attn_implementation=attn_implementation)
    ids, mask = _left_pad(prompts)
    gen_cfg = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        # no eos at all -> no logits processor touches the scores; every row runs to the end
        eos_token_id=None if ignore_eos else EOS_ID,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        output_logits=True,
        return_dict_in_generate=True,
    )
    # generate() fills every None field of `gen_cfg` from model.generation_config (which has
    # eos_token_id=1 from generation_config.json), so eos_token_id=None alone does NOT disable
    # EOS: swap in a neutral model-level generation config for the duration of the call.
    saved = model.generation_config
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, pad_token_id=PAD_ID)
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg)
    finally:
        model.generation_config = saved
    if ignore_eos and out.sequences.shape[1] - ids.shape[1] != max_new_tokens:
        raise AssertionError("generate() stopped early although EOS was disabled")
    new = out.sequences[:, ids.shape[1]:]
    logits = torch.stack([step.float() for step in out.logits], dim=1)
    return new, logits


def hf_generate(
    path,
    prompts: list[list[int]],
    max_new_tokens: int,
    dtype=torch.float32,
    *,
    ignore_eos: bool = True,
    attn_implementation: str | None = None,
) -> list[tuple[list[int], list[float]]]:
    """Greedy reference: one batched, left-padded ``generate`` over all prompts.

    Returns, per prompt, (generated token ids, log-prob of each chosen token under the raw
    logits). With ``ignore_eos`` (default) EOS is not a stop token, so every prompt yields
    exactly ``max_new_tokens`` tokens and the tokens are the plain argmax of the raw logits.
    With ``ignore_eos=False`` generation stops after EOS (included in the output).
    """
    new, logits = _generate_logits(path, prompts, max_new_tokens, dtype, ignore_eos, attn_implementation)
    logp = torch.log_softmax(logits, dim=-1)
    results = []
    for b in range(len(prompts)):
        toks = new[b].tolist()
        if not ignore_eos and EOS_ID in toks:
            toks = toks[: toks.index(EOS_ID) + 1]
        lps = [float(logp[b, t, tok]) for t, tok in enumerate(toks)]
        results.append((toks, lps))
    return results


def hf_logprobs_full(
    path,
    prompts: list[list[int]],
    max_new_tokens: int,
    dtype=torch.float32,
    *,
    attn_implementation: str | None = None,
) -> list[list[torch.Tensor]]:
    """Per prompt, per generated step: the full float32 ``log_softmax`` row ([vocab_size])."""
    _, logits = _generate_logits(path, prompts, max_new_tokens, dtype, True, attn_implementation)
    logp = torch.log_softmax(logits, dim=-1)
    return [[logp[b, t].clone() for t in range(logp.shape[1])] for b in range(len(prompts))]


def hf_logits(path, prompts, max_new_tokens: int, dtype=torch.float32, *, attn_implementation=None):
    """(generated ids [B, T], raw float32 logits [B, T, V]) of the batched greedy run."""
    return _generate_logits(path, prompts, max_new_tokens, dtype, True, attn_implementation)


def random_prompts(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Random byte-token prompts (ids in 3..258), one per length."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(BYTE_OFFSET, BYTE_OFFSET + 256, (n,), generator=g).tolist() for n in lengths]


def sentencepiece_tokenizer(chat_template=None) :
    """A Llama-style BPE tokenizer (Metaspace, byte fallback for everything outside a tiny alphabet), built here."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors

    from litellm_pipeline.text.tokenizer import Tokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    pieces = list("▁abcdefghijklmnopqrstuvwxyz!,") + ["▁w", "▁h", "ll", "▁he", "▁hell", "or", "▁wor", "ld"]
    vocab.update({p: len(vocab) + i for i, p in enumerate(pieces)})
    merges = [("▁", "w"), ("▁", "h"), ("l", "l"), ("▁h", "e"), ("▁he", "ll"), ("o", "r"), ("▁w", "or"), ("l", "d")]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return Tokenizer.from_tokenizer(tok, eos_token="</s>", bos_token="<s>", chat_template=chat_template)
