"""``cpu_paged`` attention: decode reads K/V straight out of the paged cache with a small C++ kernel.

The reference ``sdpa`` gathers every decode sequence's whole context into a dense buffer per layer before
it attends; on a CPU that copy, not the arithmetic, bounds decode. Here a kernel (``csrc/paged_attention.cpp``,
compiled on first use with torch's JIT extension loader) walks each sequence's slots itself: one pass over
the K/V rows it needs, an online softmax in float32, GQA/MQA by sharing each K/V row among the query heads of
its group. Prefill goes through the kernel too, generalised to a chunk of queries with the causal offset,
except where torch SDPA (as ``sdpa`` runs it) measured faster: chunks of more than a few queries, over a
cached prefix or fresh (its causal flash kernel). In the batch-invariant mode (``engine.deterministic``) every
chunk takes the kernel: it computes each query row alone, so a row's result does not depend on how the prompt
was chunked.

If the kernel cannot be built (no compiler, no ninja, a compile error) or the inputs are outside what it
handles (not CPU, another dtype), this falls back to ``sdpa`` and says why in one warning per reason.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from litellm_pipeline.model import cpu_kernels
from litellm_pipeline.model.attention import sdpa_paged_attention, sdpa_prefill_chunk, write_kv, kv_cache_supported
from litellm_pipeline.registry import register
from litellm_pipeline.registry.types import AttentionMetadata

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Prefill chunks up to these lengths go through the kernel, longer ones through torch SDPA. Over a cached prefix
# (12x64 heads, fp32, 1 and 2 threads) the kernel is 1.1-1.6x faster at 12 queries and SDPA's GEMMs win from
# ~16-64 on. On a fresh prompt SDPA runs its causal flash kernel: with torch 2.13 on an AVX-512 CPU, through
# sdpa_prefill_chunk, the kernel takes 0.7-0.9x its time at 16 queries, 0.9-1.2x at 32 and 1.1-1.6x at 48-64
# (heads 4x16 to 12x64), up to 1.7-5x at 512.
PREFILL_KERNEL_MAX_Q = 12  # a chunk that continues a cached prefix (ctx_len > q_len)
PREFILL_KERNEL_MAX_FRESH = 32  # a whole prompt (ctx_len == q_len)

_op: Callable | None = None  # the loaded kernel
_error: str | None = None  # why it could not be loaded (then every call uses sdpa)
_warned: set[str] = set()


def _build_kernel() -> Callable:
    """Compile (or reuse the cached build of) the CPU kernels and return the paged attention op."""
    return cpu_kernels.ops().paged_attention.default


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"cpu_paged attention falls back to sdpa: {reason}", RuntimeWarning, stacklevel=3)


def kernel() -> Callable | None:
    """The compiled op, building it on first use; None (after one warning) if it cannot be built."""
    global _op, _error
    if _op is None and _error is None:  # cpu_kernels serialises the build; a race only looks the op up twice
        try:
            _op = _build_kernel()
        except Exception as exc:  # any build/load failure means "use sdpa", never a crash
            _error = f"C++ kernel unavailable ({cpu_kernels.reason(exc)})"
    if _error is not None:
        _warn_once(_error)
    return _op


def kernel_error() -> str | None:
    """Why the kernel could not be loaded (None: it loaded, or nothing asked for it yet)."""
    return _error


def _unsupported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    if not q.is_cpu:
        return f"inputs on {q.device.type}, the kernel is CPU-only"
    if q.dtype not in _DTYPES or v_cache.dtype != k_cache.dtype or not kv_cache_supported(q.dtype, k_cache.dtype):
        return f"dtypes q={q.dtype} cache={k_cache.dtype} not supported"
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return "non-contiguous KV cache"
    return None


@register("attention", "cpu_paged")
def cpu_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
    """Same contract as ``sdpa``; the kernel reads K/V in place through each sequence's slots."""
    why = _unsupported(q, k_cache, v_cache)
    if why is not None:
        _warn_once(why)
        return sdpa_paged_attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window)
    op = _op if _op is not None else kernel()
    if op is None:
        return sdpa_paged_attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window)
    write_kv(k_cache, v_cache, meta.slot_mapping, k, v)
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    window = sliding_window or 0
    for s in meta.prefills:
        # the kernel computes every query row alone (keys in fixed chunks from position 0), so the
        # batch-invariant mode keeps every chunk on it; SDPA's result depends on the chunk's length
        if meta.batch_invariant or s.q_len <= (PREFILL_KERNEL_MAX_FRESH if s.ctx_len == s.q_len else PREFILL_KERNEL_MAX_Q):
            rows = torch.tensor([s.q_start])
            lens = torch.tensor([s.ctx_len])
            op(out, q, k_cache, v_cache, rows, s.kv_slots.reshape(1, -1), lens, s.q_len, scale, window)
        else:
            sdpa_prefill_chunk(s, q, k, v, k_cache, v_cache, scale, sliding_window, out)
    if meta.decode_rows is not None:
        slots = meta.decode_kv_slots
        if slots.stride(-1) != 1:
            slots = slots.contiguous()
        op(out, q, k_cache, v_cache, meta.decode_rows, slots, meta.decode_ctx_lens, 1, scale, window)
    return out
