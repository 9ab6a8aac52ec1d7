"""The batched token mask of the sample stage: one bitmask row per constrained request, applied in one op.

Unconstrained rows are not touched. A row whose mask allows no token at all (the grammar needs a character the
vocabulary cannot write) is reported, not sampled: its logits would all be -inf.
"""

from __future__ import annotations

from typing import Sequence

import torch

from litellm_pipeline.constraints.grammar import bitmask_words
from litellm_pipeline.model import cpu_kernels

__all__ = ["mask_logits"]


def mask_logits(logits: torch.Tensor, constrained: Sequence[tuple[int, object]]) -> list[int]:
    """Sets to -inf, in place, every logit of row ``i`` that ``matcher`` of ``(i, matcher)`` does not allow.
    Returns the rows whose mask allows no token (left unmasked)."""
    vocab = logits.shape[-1]
    rows = [i for i, _ in constrained]
    bitmask = torch.empty((logits.shape[0], bitmask_words(vocab)), dtype=torch.int32)
    for i, matcher in constrained:
        matcher.fill_bitmask(bitmask, i)
    if logits.device.type == "cpu" and logits.stride(-1) == 1:
        ns = cpu_kernels.loaded()  # the project's kernel when the engine built them: 10-25x xgrammar's CPU one
        if ns is not None and hasattr(ns, "apply_token_bitmask_"):
            return list(ns.apply_token_bitmask_(logits, bitmask, torch.tensor(rows, dtype=torch.long)))
    return _apply_xgrammar(logits, bitmask, rows, vocab)


def _apply_xgrammar(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int) -> list[int]:
    import xgrammar as xgr

    sub = bitmask[rows]
    tail = vocab % 32
    if tail:  # bits past the vocabulary in the last word say nothing
        sub[:, -1] &= (1 << tail) - 1
    dead = [rows[j] for j in (sub == 0).all(dim=1).nonzero().flatten().tolist()]
    if dead:
        rows = [i for i in rows if i not in dead]
        if not rows:
            return dead
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)
    return dead
