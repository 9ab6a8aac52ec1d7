"""Attention over the paged KV cache (registry kind ``attention``).

An implementation is a callable ``(q, k, v, k_cache, v_cache, meta, scale, sliding_window) -> out`` with
q ``[T, Hq, D]``, k/v ``[T, Hk, D]`` for the step's new tokens and caches ``[num_slots, Hk, D]``. It
writes the new K/V into their slots, then attends every token over its own sequence's context only, so
a request's result never depends on what else is in the batch.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from litellm_pipeline.registry import register
from litellm_pipeline.registry.types import AttentionMetadata, SeqAttention


class _Workspace:
    """Reused gather buffers: a fresh multi-MB tensor per layer costs page faults on every step."""

    def __init__(self) -> None:
        self._bufs: dict[tuple, torch.Tensor] = {}

    def take(self, name: str, rows: int, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        # a buffer made under inference mode cannot be written outside it: one per mode
        dtype = dtype or like.dtype
        key = (name, dtype, like.device, like.shape[1:], torch.is_inference_mode_enabled())
        buf = self._bufs.get(key)
        if buf is None or buf.shape[0] < rows:
            buf = torch.empty((max(rows, 2 * (buf.shape[0] if buf is not None else 0)), *like.shape[1:]),
                              dtype=dtype, device=like.device)
            self._bufs[key] = buf
        return buf[:rows]


_local = threading.local()  # one workspace per thread: engines stepping in parallel threads never share it


def _workspace() -> _Workspace:
    ws = getattr(_local, "ws", None)
    if ws is None:
        ws = _local.ws = _Workspace()
    return ws


def gather_slots(cache: torch.Tensor, slots: torch.Tensor, name: str) -> torch.Tensor:
    """``cache[slots]`` (any index shape) into a reused buffer; the result is valid until the next call."""
    flat = slots.reshape(-1)
    out = _workspace().take(name, flat.shape[0], cache)
    torch.index_select(cache, 0, flat, out=out)
    return out.view(*slots.shape, *cache.shape[1:])


def kv_cache_supported(act: torch.dtype, cache: torch.dtype) -> bool:
    """The KV cache dtypes the kernels read (as csrc/cpu_math.h's ``kv_cache_supported``): the activations' own, or
    float16 / bfloat16 under float32 activations."""
    return cache == act or (act == torch.float32 and cache in (torch.float16, torch.bfloat16))


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """The step's new K/V rows into their slots, rounded to the caches' dtype where it is narrower
    (``cache.dtype``)."""
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_context(cache: torch.Tensor, slots: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
    """``gather_slots`` widened to the queries' ``dtype`` when the cache holds a narrower one."""
    out = gather_slots(cache, slots, name)
    if out.dtype == dtype:
        return out
    wide = _workspace().take(name + "/wide", slots.numel(), cache, dtype)
    return wide.view(out.shape).copy_(out)


def _as_cached(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """``x`` as attention reads it back from ``cache``: rounded to a narrower cache's dtype, so every path (this
    one, the gathers, the kernels) attends over the same values."""
    return x if cache.dtype == x.dtype else x.to(cache.dtype).to(x.dtype)


def _prefill_mask(q_len: int, ctx_len: int, window: int | None, dtype, device) -> torch.Tensor | None:
    """Causal mask of a chunk whose first query sits at position ctx_len - q_len; None when plain causal works."""
    if q_len == ctx_len and window is None:
        return None
    qpos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    kpos = torch.arange(ctx_len, device=device)[None, :]
    ok = kpos <= qpos
    if window is not None:
        ok &= kpos > qpos - window
    return torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill_(~ok, float("-inf"))


def sdpa_prefill_chunk(
    s: SeqAttention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    window: int | None,
    out: torch.Tensor,
) -> None:
    """One prefill chunk of sequence ``s`` through torch SDPA into ``out`` (its rows of the step's queries).

    The chunk's K/V must already be in the cache. A whole fresh prompt attends over its own new K/V directly;
    a chunk that continues a cached prefix gathers the sequence's context from the cache.
    """
    # [1, H, L, D]: with a batch dimension torch's CPU SDPA takes its flash kernel; 3-D inputs took the math path
    # (1.5-3x slower at 128-512 queries)
    def heads_first(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(0, 1).unsqueeze(0)

    rows = slice(s.q_start, s.q_start + s.q_len)
    qs = heads_first(q[rows])
    if s.ctx_len == s.q_len:  # nothing cached before this chunk: use the fresh K/V directly
        ks, vs = heads_first(_as_cached(k[rows], k_cache)), heads_first(_as_cached(v[rows], v_cache))
    else:
        ks = heads_first(gather_context(k_cache, s.kv_slots, "k", q.dtype))
        vs = heads_first(gather_context(v_cache, s.kv_slots, "v", q.dtype))
    mask = _prefill_mask(s.q_len, s.ctx_len, window, q.dtype, q.device)
    o = F.scaled_dot_product_attention(
        qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    out[rows] = o[0].transpose(0, 1)


@register("attention", "sdpa")
def sdpa_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
    """Reference implementation: torch SDPA per prefill sequence, one padded SDPA for all decode tokens."""
    write_kv(k_cache, v_cache, meta.slot_mapping, k, v)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    for s in meta.prefills:
        sdpa_prefill_chunk(s, q, k, v, k_cache, v_cache, scale, sliding_window, out)
    if meta.decode_rows is not None:
        rows = meta.decode_rows
        qd = q[rows].unsqueeze(2)  # [B, Hq, 1, D]
        kd = gather_context(k_cache, meta.decode_kv_slots, "k", q.dtype).transpose(1, 2)  # [B, Hk, L, D]
        vd = gather_context(v_cache, meta.decode_kv_slots, "v", q.dtype).transpose(1, 2)
        mask = meta.decode_mask(sliding_window, q.dtype)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[rows] = o.squeeze(2)
    return out
