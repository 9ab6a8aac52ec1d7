"""Train the demo MoE on the skills corpus and write it as a Hugging Face checkpoint (``+recipe=train_demo``).

Seeded and reproducible for a given thread count (torch's CPU reductions depend on it). Each sequence is
``<s> prompt answer </s>`` right-padded; the loss is on the answer and its ``</s>`` only. Each sequence is
trained at an expert count drawn from ``tier_mix`` (experts per token -> weight), so every compute tier the runtime
offers (fast = 1 expert ... max = all) is a configuration the model has seen; ``{2: 1.0}`` trains plain top-2.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import pydantic
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from safetensors.torch import save_file
from tqdm import tqdm

from litellm_pipeline.demo.network import MixtralForTraining, NetworkConfig
from litellm_pipeline.demo.skills import Example, check_tasks, heldout, training_stream
from litellm_pipeline.demo.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_char_tokenizer
from litellm_pipeline.errors import ConfigError, format_validation_error


class TrainSettings(BaseModel):
    """The ``train:`` config section (see recipes/train_demo.yaml for the shipped values)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    out_dir: str | None = None  # null: <hydra run dir>/checkpoint
    seed: int = 0
    steps: int = Field(default=5000, ge=1)
    batch_size: int = Field(default=64, ge=1)
    lr: float = Field(default=3e-3, gt=0)
    min_lr_ratio: float = Field(default=0.05, ge=0, le=1)  # cosine decays to lr * this
    warmup_steps: int = Field(default=200, ge=0)
    weight_decay: float = Field(default=0.05, ge=0)
    grad_clip: float = Field(default=1.0, gt=0)
    aux_loss_coef: float = Field(default=0.01, ge=0)
    tier_mix: dict[int, float] = {1: 0.2, 2: 0.4, 4: 0.2, 8: 0.2}
    # task -> share of the training examples (the slow learners, add and recall, get more)
    tasks: dict[str, float] = {"add": 0.3, "reverse": 0.15, "sort": 0.15, "copy": 0.15, "recall": 0.25}
    threads: int | None = Field(default=None, ge=1)  # torch.set_num_threads; null: leave as is
    dtype: Literal["bfloat16", "float32"] = "bfloat16"  # of the saved weights
    eval_every: int = Field(default=0, ge=0)  # greedy exact match on held-out prompts every N steps (0: at the end)
    eval_per_task: int = Field(default=20, ge=1)
    progress: bool = True
    # the network (a MixtralForCausalLM)
    hidden_size: int = Field(default=128, ge=8)
    intermediate_size: int = Field(default=128, ge=8)
    num_hidden_layers: int = Field(default=4, ge=1)
    num_attention_heads: int = Field(default=4, ge=1)
    num_key_value_heads: int = Field(default=2, ge=1)
    num_local_experts: int = Field(default=8, ge=1)
    num_experts_per_tok: int = Field(default=2, ge=1)
    max_position_embeddings: int = Field(default=64, ge=32)
    rope_theta: float = Field(default=10000.0, gt=0)

    @field_validator("tasks")
    @classmethod
    def _known_tasks(cls, v: dict[str, float]) -> dict[str, float]:
        check_tasks(list(v))
        if not v or min(v.values()) < 0 or sum(v.values()) <= 0:
            raise ValueError("weights must be >= 0 with a positive sum")
        return v

    @field_validator("tier_mix")
    @classmethod
    def _weights(cls, v: dict[int, float]) -> dict[int, float]:
        if not v or min(v.values()) < 0 or sum(v.values()) <= 0:
            raise ValueError("weights must be >= 0 with a positive sum")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "TrainSettings":
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if self.hidden_size % heads or heads % kv or (self.hidden_size // heads) % 2:
            raise ValueError("hidden_size / num_attention_heads must be an even whole number (RoPE) and "
                             "num_attention_heads a multiple of num_key_value_heads")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError("num_experts_per_tok must be <= num_local_experts")
        bad = [k for k in self.tier_mix if not 1 <= k <= self.num_local_experts]
        if bad:
            raise ValueError(f"tier_mix: expert counts must be in 1..{self.num_local_experts} (got {bad})")
        return self

    def network(self, vocab_size: int) -> NetworkConfig:
        keys = NetworkConfig.__dataclass_fields__
        return NetworkConfig(vocab_size=vocab_size, **{k: v for k, v in self.model_dump().items() if k in keys})


def train_settings(section: Any) -> TrainSettings:
    try:
        return TrainSettings.model_validate(section or {})
    except pydantic.ValidationError as exc:
        raise ConfigError("invalid train config:\n" + format_validation_error(exc, "train")) from exc


def encode_batch(examples: list[Example], tokenizer, max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, valid, target mask) [B, T]: ``<s> prompt answer </s>`` right-padded; targets = answer + ``</s>``."""
    rows, spans = [], []
    for ex in examples:
        prompt = tokenizer.encode(ex.prompt)  # with the leading <s>
        answer = tokenizer.encode(ex.answer, add_special_tokens=False) + [EOS_ID]
        rows.append(prompt + answer)
        spans.append(len(prompt))
    t = max(len(r) for r in rows)
    if t > max_len:
        raise ValueError(f"an example is {t} tokens, over max_position_embeddings {max_len}")
    ids = torch.full((len(rows), t), PAD_ID, dtype=torch.long)
    valid = torch.zeros(len(rows), t, dtype=torch.bool)
    target = torch.zeros(len(rows), t, dtype=torch.bool)
    for i, (r, p) in enumerate(zip(rows, spans)):
        ids[i, : len(r)] = torch.tensor(r)
        valid[i, : len(r)] = True
        target[i, p : len(r)] = True
    return ids, valid, target


def lr_at(step: int, s: TrainSettings) -> float:
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    frac = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


@torch.no_grad()
def greedy_accuracy(model: MixtralForTraining, examples: list[Example], tokenizer, k: int) -> dict[str, float]:
    """Exact match of greedy answers with ``k`` experts per token, per task and "all" (no KV cache: short sequences)."""
    model.eval()
    right: dict[str, list[bool]] = {}
    for ex in examples:
        ids = tokenizer.encode(ex.prompt)
        out: list[int] = []
        for _ in range(len(ex.answer) + 1):
            x = torch.tensor([ids + out])
            logits, _ = model(x, torch.ones_like(x, dtype=torch.bool), torch.full_like(x, k))
            nxt = int(logits[0, -1].argmax())
            if nxt == EOS_ID:
                break
            out.append(nxt)
        right.setdefault(ex.task, []).append(tokenizer.decode(out) == ex.answer)
    model.train()
    acc = {t: round(sum(v) / len(v), 3) for t, v in right.items()}
    acc["all"] = round(sum(map(sum, right.values())) / max(1, len(examples)), 3)
    return acc


def save_checkpoint(model: MixtralForTraining, tokenizer, target: Path, dtype: str, extra: dict) -> Path:
    """Write config.json, model.safetensors, tokenizer files, generation_config.json and training.json (atomically)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    cfg = model.cfg.hf_config(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, torch_dtype=dtype)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "do_sample": False}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tokenizer.save(tmp)
    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    state = {k: v.detach().to(torch_dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "training.json").write_text(json.dumps(extra, indent=2) + "\n")
    for f in tmp.iterdir():  # mkdtemp and safetensors create owner-only files; the checkpoint ships
        f.chmod(0o644)
    tmp.chmod(0o755)
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    return target


def train(s: TrainSettings, out_dir: Path) -> dict:
    """Train with settings ``s`` and write the checkpoint to ``out_dir``; returns the training summary."""
    if s.threads:
        torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    tokenizer = build_char_tokenizer()
    model = MixtralForTraining(s.network(tokenizer.vocab_size))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=s.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    stream = training_stream(s.seed, dict(s.tasks))
    rng = random.Random(f"tiers:{s.seed}")
    ks, kw = list(s.tier_mix), list(s.tier_mix.values())
    probe = heldout(s.eval_per_task, seed=s.seed + 99, tasks=tuple(s.tasks))
    history = []
    t0 = time.perf_counter()
    bar = tqdm(range(s.steps), desc="train demo MoE", disable=not s.progress, dynamic_ncols=True)
    ema = None
    for step in bar:
        batch = [next(stream) for _ in range(s.batch_size)]
        ids, valid, target = encode_batch(batch, tokenizer, s.max_position_embeddings)
        k = torch.tensor(rng.choices(ks, kw, k=len(batch)))[:, None].expand_as(ids)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, s)
        logits, aux = model(ids[:, :-1], valid[:, :-1], k[:, :-1])
        tgt = target[:, 1:]
        ce = F.cross_entropy(logits[tgt], ids[:, 1:][tgt])
        loss = ce + s.aux_loss_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        ema = ce.item() if ema is None else 0.98 * ema + 0.02 * ce.item()
        bar.set_postfix(loss=f"{ema:.4f}", aux=f"{aux.item():.3f}", lr=f"{lr_at(step, s):.1e}", refresh=False)
        last = step + 1 == s.steps
        if (s.eval_every and (step + 1) % s.eval_every == 0) or last:
            acc = {kk: greedy_accuracy(model, probe, tokenizer, kk) for kk in sorted(set(ks) | {s.num_experts_per_tok})}
            history.append({"step": step + 1, "loss": round(ema, 5), "exact_match_by_experts": acc})
            bar.write(f"step {step + 1}: loss {ema:.4f}, held-out exact match by experts per token:")
            for kk, a in acc.items():
                bar.write(f"  k={kk}: " + "  ".join(f"{t} {v:.2f}" for t, v in a.items()))
    elapsed = time.perf_counter() - t0
    summary = {
        "settings": s.model_dump(mode="json"),
        "torch_threads": torch.get_num_threads(),
        "train_seconds": round(elapsed, 1),
        "parameters": sum(p.numel() for p in model.parameters()),
        "history": history,
    }
    save_checkpoint(model, tokenizer, out_dir, s.dtype, summary)
    return summary


def run_training(cfg) -> dict:
    """The ``train_demo`` task: train with the ``train:`` section, write to ``train.out_dir`` or <run dir>/checkpoint."""
    from litellm_pipeline.builder import to_plain
    from litellm_pipeline.demo import output_dir

    s = train_settings(to_plain(cfg).get("train"))
    out = Path(s.out_dir) if s.out_dir else output_dir() / "checkpoint"
    summary = train(s, out)
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    print(f"wrote {out} ({summary['parameters'] / 1e6:.2f} M parameters, {size:.1f} MiB, "
          f"{summary['train_seconds']:.0f} s on {summary['torch_threads']} thread(s))")
    return summary
