"""Train the demo MoE on the skills corpus and write it as a Hugging Face checkpoint (``+recipe=train_demo``).

Seeded and reproducible for a given thread count (torch's CPU reductions depend on it). Each sequence is
``<s> prompt answer </s>`` right-padded; the loss is on the answer and its ``</s>`` only. Each sequence is
trained at an expert count drawn from ``tier_mix`` (experts per token -> weight, the same in every layer), or, for a
``per_layer`` share of the sequences, at one count per layer drawn from ``layer_mix``; ``tier_mix={2: 1.0}
per_layer=0`` trains plain top-2.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from safetensors.torch import save_file
from tqdm import tqdm

from litellm_pipeline.demo.network import MoeForTraining, NetworkConfig
from litellm_pipeline.demo.skills import Example, check_tasks, heldout, training_stream
from litellm_pipeline.demo.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_char_tokenizer
from litellm_pipeline.errors import section_settings


class TrainSettings(BaseModel):
    """The ``train:`` config section (see recipes/train_demo.yaml for the shipped values)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    out_dir: str | None = None  # null: <hydra run dir>/checkpoint
    seed: int = 0
    steps: int = Field(default=12000, ge=1)
    batch_size: int = Field(default=64, ge=1)
    lr: float = Field(default=3e-3, gt=0)
    min_lr_ratio: float = Field(default=0.05, ge=0, le=1)  # cosine decays to lr * this
    warmup_steps: int = Field(default=200, ge=0)
    weight_decay: float = Field(default=0.05, ge=0)
    grad_clip: float = Field(default=1.0, gt=0)
    aux_loss_coef: float = Field(default=0.01, ge=0)
    # weight of the split loss: a token routed to k > 1 experts is pushed towards even weights, so no one expert
    # carries it alone and fewer experts than trained cost quality (the tiers' staircase)
    split_loss_coef: float = Field(default=0.0, ge=0)
    # weight of the spill loss: the router mass outside the native top-k, so the trained counts (native and up)
    # all see about the whole mixture and one expert sees only its share of it
    spill_loss_coef: float = Field(default=0.0, ge=0)
    # "example": every sequence weighs the same whatever its answer's length (a one-digit recall answer counts as
    # much as an eight-letter reversal); "token": every answer token weighs the same
    loss_weighting: Literal["example", "token"] = "example"
    tier_mix: dict[int, float] = {2: 0.5, 4: 0.25, 8: 0.25}
    # share of the sequences whose expert count is drawn per layer (from layer_mix) rather than once (tier_mix)
    per_layer: float = Field(default=0.5, ge=0, le=1)
    layer_mix: dict[int, float] = {1: 0.3, 2: 0.4, 4: 0.15, 8: 0.15}
    # task -> share of the training examples (the slow learners, add and recall, get more)
    tasks: dict[str, float] = {"add": 0.3, "reverse": 0.1, "sort": 0.1, "copy": 0.1, "recall": 0.4}
    # questions per recall training sequence (a3,b7,c1;b7;c1;a3): more scored bindings per context
    recall_questions: int = Field(default=4, ge=1)
    # data-parallel worker processes (gloo all-reduce); each draws the same global batch and trains on its slice
    workers: int = Field(default=2, ge=1)
    threads: int | None = Field(default=None, ge=1)  # torch threads per worker; null: 1 with workers > 1, else as is
    curve_every: int = Field(default=10, ge=1)  # loss_curve in training.json: the mean loss over each N steps
    dtype: Literal["bfloat16", "float32"] = "bfloat16"  # of the saved weights
    eval_every: int = Field(default=0, ge=0)  # greedy exact match on held-out prompts every N steps (0: at the end)
    eval_per_task: int = Field(default=20, ge=1)
    progress: bool = True
    # the network: a MixtralForCausalLM, or a Qwen3MoeForCausalLM (q/k norm; top-k renormalised only with
    # norm_topk_prob: without it a token at fewer experts keeps only their softmax share)
    family: Literal["mixtral", "qwen3_moe"] = "mixtral"
    norm_topk_prob: bool = True
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

    @field_validator("tier_mix", "layer_mix")
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
        if self.workers > self.batch_size:
            raise ValueError(f"workers ({self.workers}) must be <= batch_size ({self.batch_size})")
        if self.family == "mixtral" and not self.norm_topk_prob:
            raise ValueError("norm_topk_prob: false needs family qwen3_moe (a Mixtral router always renormalises)")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError("num_experts_per_tok must be <= num_local_experts")
        for name in ("tier_mix", "layer_mix"):
            bad = [k for k in getattr(self, name) if not 1 <= k <= self.num_local_experts]
            if bad:
                raise ValueError(f"{name}: expert counts must be in 1..{self.num_local_experts} (got {bad})")
        return self

    def network(self, vocab_size: int) -> NetworkConfig:
        keys = NetworkConfig.__dataclass_fields__
        return NetworkConfig(vocab_size=vocab_size, **{k: v for k, v in self.model_dump().items() if k in keys})


def train_settings(section: Any) -> TrainSettings:
    return section_settings(TrainSettings, section, "train")


def encode_batch(examples: list[Example], tokenizer, max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, valid, target mask) [B, T]: ``<s> prompt answer [question answer ...] </s>`` right-padded; targets =
    every answer and the final ``</s>`` (a follow-up question's own characters are context, not targets)."""
    rows, marks = [], []
    for ex in examples:
        row = tokenizer.encode(ex.prompt)  # with the leading <s>
        mark = [False] * len(row)
        for question, answer in ((None, ex.answer), *ex.followups):
            if question is not None:
                q = tokenizer.encode(question, add_special_tokens=False)
                row, mark = row + q, mark + [False] * len(q)
            a = tokenizer.encode(answer, add_special_tokens=False)
            row, mark = row + a, mark + [True] * len(a)
        rows.append(row + [EOS_ID])
        marks.append(mark + [True])
    t = max(len(r) for r in rows)
    if t > max_len:
        raise ValueError(f"an example is {t} tokens, over max_position_embeddings {max_len}")
    ids = torch.full((len(rows), t), PAD_ID, dtype=torch.long)
    valid = torch.zeros(len(rows), t, dtype=torch.bool)
    target = torch.zeros(len(rows), t, dtype=torch.bool)
    for i, (r, m) in enumerate(zip(rows, marks)):
        ids[i, : len(r)] = torch.tensor(r)
        valid[i, : len(r)] = True
        target[i, : len(r)] = torch.tensor(m)
    return ids, valid, target


def answer_loss(logits: torch.Tensor, labels: torch.Tensor, target: torch.Tensor, weighting: str) -> torch.Tensor:
    """Cross-entropy over the ``target`` positions, each sequence weighing the same ("example") or each token."""
    ce = F.cross_entropy(logits[target], labels[target], reduction="none")
    if weighting == "token":
        return ce.mean()
    per_row = target.sum(1)
    w = (1.0 / per_row.clamp(min=1).float())[:, None].expand_as(target)[target]
    return (ce * w).sum() / int((per_row > 0).sum())


def lr_at(step: int, s: TrainSettings) -> float:
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    frac = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


@torch.no_grad()
def greedy_accuracy(model: MoeForTraining, examples: list[Example], tokenizer, k: int) -> dict[str, float]:
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


def save_checkpoint(model: MoeForTraining, tokenizer, target: Path, dtype: str, extra: dict) -> Path:
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
    if "loss_curve" in extra:
        save_loss_plot(extra, tmp / "loss.png")
    for f in tmp.iterdir():  # mkdtemp and safetensors create owner-only files; the checkpoint ships
        f.chmod(0o644)
    tmp.chmod(0o755)
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    return target


def _data_parallel(rank: int, workers: int, rendezvous: str):
    """Join the ``workers``-process gloo group; a no-op for one worker."""
    if workers == 1:
        return None
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=workers,
                            timeout=datetime.timedelta(minutes=10))
    return dist


def _reduce_grads(dist, params: list[torch.nn.Parameter]) -> None:
    """Sum every worker's gradients in place (one flat all-reduce); afterwards all workers hold the same bits."""
    flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in params])
    dist.all_reduce(flat)
    i = 0
    for p in params:
        n = p.numel()
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.copy_(flat[i : i + n].view_as(p))
        i += n


def _worker(rank: int, s: TrainSettings, out_dir: Path | None, rendezvous: str, parent: int | None = None) -> dict | None:
    """One data-parallel worker: every worker draws the same global batch and trains on its slice ``rank::workers``;
    gradients are summed across workers, so each step sees the whole batch. Rank 0 evaluates, reports and saves."""
    threads_before = torch.get_num_threads()
    threads = s.threads or (1 if s.workers > 1 else None)
    if threads:
        torch.set_num_threads(threads)
    dist = _data_parallel(rank, s.workers, rendezvous)
    try:
        result = _train_loop(rank, s, out_dir, dist, parent)
        if dist is not None:
            # tear gloo down together: a rank that closes its group while a peer is still working (rank 0
            # evaluates and saves after the last step) can abort in gloo's threads (SIGABRT at exit)
            dist.barrier()
        return result
    finally:
        if dist is not None:
            dist.destroy_process_group()
        torch.set_num_threads(threads_before)


def _train_loop(rank: int, s: TrainSettings, out_dir: Path | None, dist, parent: int | None = None) -> dict | None:
    torch.manual_seed(s.seed)
    tokenizer = build_char_tokenizer()
    model = MoeForTraining(s.network(tokenizer.vocab_size))
    params = list(model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=s.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    stream = training_stream(s.seed, dict(s.tasks), s.recall_questions)
    rng = random.Random(f"tiers:{s.seed}")
    ks, kw = list(s.tier_mix), list(s.tier_mix.values())
    lks, lkw = list(s.layer_mix), list(s.layer_mix.values())
    layers = s.num_hidden_layers
    lead = rank == 0
    probe = heldout(s.eval_per_task, seed=s.seed + 99, tasks=tuple(s.tasks)) if lead else []
    history: list[dict] = []
    curve: list[list[float]] = []  # [step, mean answer loss over the last curve_every steps]
    window: list[float] = []
    t0 = time.perf_counter()
    bar = tqdm(range(s.steps), desc="train demo MoE", disable=not (s.progress and lead), dynamic_ncols=True)
    ema = None
    for step in bar:
        if parent is not None and os.getppid() != parent:  # the launching process is gone: stop, do not train on
            raise SystemExit(f"training worker {rank}: the launching process {parent} exited")
        batch = [next(stream) for _ in range(s.batch_size)]
        # experts per token for each sequence and layer: [B, layers]
        k_all = [rng.choices(lks, lkw, k=layers) if rng.random() < s.per_layer else rng.choices(ks, kw) * layers
                 for _ in batch]
        mine = slice(rank, None, s.workers)
        ids, valid, target = encode_batch(batch[mine], tokenizer, s.max_position_embeddings)
        k = torch.tensor(k_all[mine]).T[:, :, None].expand(layers, *ids.shape)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, s)
        logits, aux = model(ids[:, :-1], valid[:, :-1], k[:, :, :-1])
        # each worker's share of the global mean: its rows' loss sum over the global batch size
        local = answer_loss(logits, ids[:, 1:], target[:, 1:], s.loss_weighting)
        share = ids.shape[0] / s.batch_size if s.loss_weighting == "example" else _token_share(target, dist)
        coefs = (s.aux_loss_coef, s.split_loss_coef, s.spill_loss_coef)
        loss = local * share + sum(c * a for c, a in zip(coefs, aux) if c) / s.workers
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if dist is not None:
            _reduce_grads(dist, params)
        torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
        opt.step()
        ce = _global_mean(local.detach() * share, dist)
        window.append(ce)
        ema = ce if ema is None else 0.98 * ema + 0.02 * ce
        if len(window) == s.curve_every or step + 1 == s.steps:
            curve.append([step + 1, round(sum(window) / len(window), 5)])
            window.clear()
        bar.set_postfix(loss=f"{ema:.4f}", aux=f"{aux[0].item():.3f}", split=f"{aux[1].item():.3f}",
                        spill=f"{aux[2].item():.3f}", lr=f"{lr_at(step, s):.1e}", refresh=False)
        last = step + 1 == s.steps
        if lead and ((s.eval_every and (step + 1) % s.eval_every == 0) or last):
            acc = {kk: greedy_accuracy(model, probe, tokenizer, kk)
                   for kk in sorted(set(ks) | set(lks) | {1, s.num_experts_per_tok})}
            history.append({"step": step + 1, "loss": round(ema, 5), "exact_match_by_experts": acc})
            bar.write(f"step {step + 1}: loss {ema:.4f}, held-out exact match by experts per token:")
            for kk, a in acc.items():
                bar.write(f"  k={kk}: " + "  ".join(f"{t} {v:.2f}" for t, v in a.items()))
    elapsed = time.perf_counter() - t0
    if not lead:
        return None
    summary = {
        "settings": s.model_dump(mode="json"),
        "workers": s.workers,
        "torch_threads": torch.get_num_threads(),
        "train_seconds": round(elapsed, 1),
        "parameters": sum(p.numel() for p in params),
        "history": history,
        "loss_curve": curve,
    }
    save_checkpoint(model, tokenizer, out_dir, s.dtype, summary)
    return summary


def _token_share(target: torch.Tensor, dist) -> float:
    """This worker's share of the batch's answer tokens (per-token weighting)."""
    n = target[:, 1:].sum()
    if dist is None:
        return 1.0
    total = n.clone()
    dist.all_reduce(total)
    return float(n) / float(total)


def _global_mean(x: torch.Tensor, dist) -> float:
    if dist is not None:
        x = x.clone()
        dist.all_reduce(x)
    return float(x)


def _spawned_worker(rank: int, s: TrainSettings, out_dir: str, rendezvous: str, parent: int) -> None:
    _worker(rank, s, Path(out_dir) if rank == 0 else None, rendezvous, parent)


def train(s: TrainSettings, out_dir: Path) -> dict:
    """Train with settings ``s`` and write the checkpoint to ``out_dir``; returns the training summary.

    One worker trains in this process. With ``s.workers > 1`` every worker is a spawned process (rank 0 saves
    the checkpoint) and this process watches them: if one dies, the others are stopped at once and the error names
    the rank, instead of the survivors waiting in a collective until its timeout."""
    out_dir = Path(out_dir)
    if s.workers == 1:
        return _worker(0, s, out_dir, "")
    with tempfile.TemporaryDirectory(prefix="train-demo-") as tmp:
        rendezvous = str(Path(tmp) / "rendezvous")
        ctx = torch.multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=_spawned_worker, args=(r, s, str(out_dir), rendezvous, os.getpid()), daemon=True)
                 for r in range(s.workers)]
        for p in procs:
            p.start()
        try:
            while any(p.is_alive() for p in procs):
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"training worker {dead[0][0]} of {s.workers} exited with code {dead[0][1]} "
                                       "(its traceback is above); the other workers were stopped")
                time.sleep(0.2)
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
            if dead:
                raise RuntimeError(f"training worker {dead[0][0]} of {s.workers} exited with code {dead[0][1]}")
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                p.join(timeout=10)
    return json.loads((out_dir / "training.json").read_text())


def save_loss_plot(summary: dict, path: Path) -> Path:
    """loss.png next to training.json: the answer loss per step (log scale) and held-out exact match per expert
    count at each evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    steps, losses = zip(*summary["loss_curve"]) if summary["loss_curve"] else ((), ())
    ax.plot(steps, losses, lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("answer cross-entropy")
    ax.set_title("training loss")
    ax.grid(True, which="both", alpha=0.3)
    hist = summary["history"]
    if hist:
        for k in hist[-1]["exact_match_by_experts"]:
            bx.plot([h["step"] for h in hist], [h["exact_match_by_experts"][k]["all"] for h in hist],
                    marker="o", label=f"{k} expert(s)/token")
        bx.legend()
    bx.set_ylim(0, 1.02)
    bx.set_xlabel("step")
    bx.set_ylabel("exact match (probe set)")
    bx.set_title("held-out accuracy by experts per token")
    bx.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
    return path


def run(cfg) -> dict:
    """The ``train_demo`` task: train with the ``train:`` section, write to ``train.out_dir`` or <run dir>/checkpoint."""
    from litellm_pipeline.config.build import to_plain
    from litellm_pipeline.tasks import output_dir

    s = train_settings(to_plain(cfg).get("train"))
    out = Path(s.out_dir) if s.out_dir else output_dir() / "checkpoint"
    summary = train(s, out)
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    print(f"wrote {out} ({summary['parameters'] / 1e6:.2f} M parameters, {size:.1f} MiB, "
          f"{summary['train_seconds']:.0f} s, {summary['workers']} worker(s) x {summary['torch_threads']} thread(s)); "
          f"loss curve: {out / 'loss.png'}")
    return summary
