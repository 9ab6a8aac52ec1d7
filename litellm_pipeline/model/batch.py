"""What one engine step hands to the model: flat tokens plus plain tensors describing where their KV lives.

The engine packs every scheduled token of every request (prefill chunks and decode tokens) into one flat
batch of ``T`` tokens. The KV cache of each layer is a flat tensor of ``num_blocks * block_size`` slots;
``slot_mapping[t]`` is where token ``t`` writes its K/V, and each sequence reads its whole context back
through the slots of its block table. Everything here is built once per step and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SeqAttention:
    """One sequence whose new tokens are attended on their own (prefill chunks, or any q_len > 1)."""

    q_start: int  # first row of this sequence in the flat batch
    q_len: int  # number of new tokens this step
    ctx_len: int  # tokens in its KV after this step (cached + new)
    kv_slots: torch.Tensor  # [ctx_len] long: flat KV slot of every context position


@dataclass
class AttentionMetadata:
    """Attention inputs of one step. Sequences with one new token form the batched decode group."""

    slot_mapping: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    prefills: list[SeqAttention]
    decode_rows: torch.Tensor | None = None  # [B] long: rows of the flat batch that are decode tokens
    decode_kv_slots: torch.Tensor | None = None  # [B, Lmax] long, padded with 0
    decode_ctx_lens: torch.Tensor | None = None  # [B] long
    batch_invariant: bool = False  # engine.deterministic: every row's arithmetic independent of the others
    _decode_masks: dict = field(default_factory=dict, repr=False)

    @property
    def decode_only(self) -> bool:
        """Every token of the step is a sequence's next token (no prompt chunk)."""
        return not self.prefills and self.decode_rows is not None

    def decode_mask(self, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask [B, 1, 1, Lmax]: 0 where a decode token may attend, -inf elsewhere (cached per window)."""
        key = (sliding_window, dtype)
        m = self._decode_masks.get(key)
        if m is None:
            assert self.decode_kv_slots is not None and self.decode_ctx_lens is not None
            lmax = self.decode_kv_slots.shape[1]
            kpos = torch.arange(lmax, device=self.decode_kv_slots.device)[None, :]
            lens = self.decode_ctx_lens[:, None]
            ok = kpos < lens
            if sliding_window is not None:
                ok &= kpos > (lens - 1 - sliding_window)
            m = torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, float("-inf"))[:, None, None, :]
            self._decode_masks[key] = m
        return m


@dataclass
class RoutePlan:
    """Per-token MoE routing limits for one step, derived from each request's TierSet.

    ``top_k[t]`` is how many experts token ``t`` may use (``None``: the checkpoint's own top-k for every
    token); ``allowed[t, e]`` is False for experts outside the token's TierSet (``None``: all allowed).
    ``max_k`` is the largest entry of ``top_k`` (a plain int, so no host sync is needed per layer).
    """

    top_k: torch.Tensor | None = None  # [T] long
    max_k: int | None = None
    allowed: torch.Tensor | None = None  # [T, E] bool
