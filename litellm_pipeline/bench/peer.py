"""The peer: ``transformers.generate`` as it is commonly used, timed on the same workload.

transformers is imported here, lazily; without it the peer is reported as unavailable, never an error.
(a) static batches of ``batch_size`` in workload order, left-padded, each batch generating its longest
    wanted output (``min_new_tokens`` = ``max_new_tokens``, so EOS cannot end it early); only each
    request's own wanted tokens count as useful output, as a server would return them.
(b) one request at a time: per request a 1-token generate (its TTFT) and a full generate; TPOT is the
    difference over the remaining tokens.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from litellm_pipeline.bench.workload import PAD_ID, WorkItem, latency_summary

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_peer(path: Path, dtype: str, device: str = "cpu"):
    """``(model, None)``, or ``(None, reason)`` when transformers is missing or cannot load the checkpoint."""
    try:
        import transformers
    except ImportError:
        return None, "transformers is not installed"
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # ours is the only bar
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype])
    except Exception as exc:  # a peer that cannot load is reported, the engine's numbers still count
        return None, f"transformers could not load {path}: {type(exc).__name__}: {exc}"
    return model.to(device).eval(), None


def _generate(model, ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=PAD_ID,
        )


def _left_padded(items: Sequence[WorkItem]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(it.prompt_ids) for it in items)
    ids = torch.full((len(items), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, it in enumerate(items):
        ids[row, width - len(it.prompt_ids):] = torch.tensor(it.prompt_ids)
        mask[row, width - len(it.prompt_ids):] = 1
    return ids, mask


def warmup(model, n: int) -> None:
    for _ in range(n):
        _generate(model, torch.full((1, 16), 3 + 65), torch.ones((1, 16), dtype=torch.long), 4)


def run_batched(model, items: Sequence[WorkItem], batch_size: int, on_batch: Callable[[int], None] | None = None) -> dict:
    """Output tokens/s of static left-padded batches; useful tokens only."""
    useful = generated = 0
    t0 = time.perf_counter()
    for start in range(0, len(items), batch_size):
        batch = items[start:start + batch_size]
        longest = max(it.output_len for it in batch)
        ids, mask = _left_padded(batch)
        out = _generate(model, ids, mask, longest)
        assert out.shape[1] - ids.shape[1] == longest, "generate stopped early despite min_new_tokens"
        useful += sum(it.output_len for it in batch)
        generated += longest * len(batch)
        if on_batch:
            on_batch(len(batch))
    elapsed = time.perf_counter() - t0
    return {"batch_size": batch_size, "requests": len(items), "output_tokens": useful, "generated_tokens": generated,
            "elapsed_s": elapsed, "output_tok_s": useful / elapsed}


def _timed(model, item: WorkItem, n: int) -> float:
    ids = torch.tensor([item.prompt_ids])
    t = time.perf_counter()
    _generate(model, ids, torch.ones_like(ids), n)
    return time.perf_counter() - t


def run_single(model, items: Sequence[WorkItem], on_request: Callable[[], None] | None = None) -> dict:
    """One request at a time: output tokens/s of the full generates, TTFT from 1-token generates."""
    ttft, tpot = [], []
    tokens = 0
    elapsed = 0.0
    for it in items:
        first = _timed(model, it, 1)
        full = _timed(model, it, it.output_len)
        ttft.append(first)
        if it.output_len > 1:
            tpot.append(max(full - first, 0.0) / (it.output_len - 1))
        tokens += it.output_len
        elapsed += full
        if on_request:
            on_request()
    return {"requests": len(items), "output_tokens": tokens, "elapsed_s": elapsed, "output_tok_s": tokens / elapsed,
            **latency_summary(ttft, tpot)}


def batch1_decode(model, item: WorkItem, repeats: int) -> dict:
    """Decode tokens/s of one request: (full generate - 1-token generate) / (n - 1), best of ``repeats``."""
    best = float("inf")
    for _ in range(repeats):
        first = _timed(model, item, 1)
        full = _timed(model, item, item.output_len)
        best = min(best, max(full - first, 1e-9) / (item.output_len - 1))
    return {"prompt_len": len(item.prompt_ids), "output_len": item.output_len, "tpot_ms": best * 1e3, "tok_s": 1.0 / best}
