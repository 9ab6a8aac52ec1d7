"""``triton_paged`` attention: the ``sdpa`` contract in three Triton kernels that read the paged KV cache directly.

Select it with ``pipeline.stages.decode.params.attention=triton_paged`` (with ``layer_ops=torch``, or any layer ops
that call the attention entry). Its module is imported only when a config names it (``registry.LAZY_MARK``).

Layouts (as the engine hands them over, see :mod:`litellm_pipeline.registry.types`): ``q`` ``[T, Hq, D]`` and
``k``/``v`` ``[T, Hk, D]``, possibly strided views of one fused projection (every kernel takes all strides);
``k_cache``/``v_cache`` ``[num_slots, Hk, D]``, flat slot tensors (slot ``s`` of block ``b`` is
``b * block_size + s``). Query head ``h`` reads KV head ``h // (Hq // Hk)`` (GQA; MQA when ``Hk == 1``). The output
is a fresh contiguous ``[T, Hq, D]`` in ``q``'s dtype.

* ``_store_kv_kernel`` -- grid ``(cdiv(T, BLOCK_T),)``: a program copies ``BLOCK_T`` tokens' K and V rows (all
  ``Hk`` heads flattened to ``BLOCK_HD = next_pow2(Hk * D)`` columns, ``BLOCK_T * BLOCK_HD ~ 4096``) to their slots
  ``slot_mapping[t]``. A plain copy: the cache rows equal the inputs bit for bit and no other slot is touched.
  (A kernel rather than ``index_copy_`` so that a step is Triton kernels only; it runs first, so both attention
  kernels read the step's own K/V through the cache like any cached key.)
* ``_decode_kernel`` -- grid ``(B, Hk)``: program ``(b, kv head)`` attends the ``Hq // Hk`` query heads sharing that
  KV head (padded to ``BLOCK_G = max(16, next_pow2(group))`` rows so both products are ``tl.dot``), so each K/V row
  is read once per group. It walks ``decode_kv_slots[b, :ctx_len]`` in blocks of ``BLOCK_N`` keys, gathering the
  K/V rows of those slots, with an online softmax (running max, running sum, rescaled accumulator, all float32;
  ``exp2`` with ``scale * log2(e)`` folded in), flash-decoding style without the split over the context. With a
  sliding window ``W`` the token at ``ctx_len - 1`` sees keys ``ctx_len - W .. ctx_len - 1`` and the walk starts
  at the block holding the first of them.
* ``_prefill_kernel`` -- one launch for every prefill chunk of the step, grid ``(num_work_items, Hk)``: a work item
  is ``BLOCK_M`` consecutive queries of one chunk, ``[q_start, q_len, ctx_len, slot offset, first query]`` int32,
  the slot offset pointing into one flat concatenation of every chunk's ``kv_slots`` (built once per step, kept
  on ``meta``). The tile has ``BLOCK_M * BLOCK_G`` rows: every query of the item times every query head of the
  KV head's group (``BLOCK_G = next_pow2(group)``), so K/V are read once per group here too. Query ``i`` of a chunk
  sits at position ``ctx_len - q_len + i`` (the causal offset of a chunk continuing a cached prefix) and sees keys
  ``max(0, pos - W + 1) .. pos``; the program loops over ``BLOCK_N``-key blocks from the first key any of its
  queries sees to the last, masking per element, with the same float32 online softmax.

Block sizes: ``BLOCK_D`` is the head dim rounded up to a power of two (at least 16, masked). ``BLOCK_N`` (keys per
block, both kernels) and the prefill tile rows ``BLOCK_M * BLOCK_G`` are 64, halved while a 64 x ``BLOCK_D`` tile
would exceed 16 KiB (float32 with head_dim 128: 32; head_dim 256: 32 in 16-bit, 16 in float32; never below 16), so
shared memory stays under ~55 KB. Products accumulate in float32; ``p`` is rounded to the activation dtype for
``p @ V`` as flash attention does; float32 inputs use ``input_precision="ieee"`` (no TF32). Key blocks are aligned
to absolute key positions, and a block fully masked for a row leaves that row's state exactly unchanged, so a
row's result does not depend on the other sequences of the batch (``meta.batch_invariant``).

Triton compiles these for CUDA. On a CPU they run only under Triton's interpreter (``TRITON_INTERPRET=1`` set
before ``triton`` is first imported; numpy, slow: for tests), and each call checks that first
(:func:`~litellm_pipeline.model.triton_common.check_device`), naming the CPU entries to use instead. The
interpreter's ``tl.dot`` multiplies bfloat16 bit patterns as integers (triton-lang/triton#11584, unsupported
there), so under the interpreter only, bfloat16 operands are widened to float32 right before each product
(``DOT_F32``; ``p`` is still rounded to bfloat16 first).
"""

from __future__ import annotations

import math

import torch

from litellm_pipeline.model.triton_common import (
    check_device,
    interpreting,
    require_triton,
)
from litellm_pipeline.registry import register
from litellm_pipeline.registry.types import AttentionMetadata

triton = require_triton()
import triton.language as tl  # noqa: E402  (after require_triton: a missing package gets the install hint)

# Keys per block (both kernels) and prefill tile rows (BLOCK_M queries x BLOCK_G query heads of one KV head):
# 64 while a 64-row tile of head_dim stays within 16 KiB (16-bit up to head_dim 128, float32 up to 64), halved per
# doubling beyond, so the K, V and Q tiles of a float32 or head_dim-256 model still fit in shared memory.
TILE_BYTES = 16384
MAX_TILE = 64
STORE_BLOCK_ELEMS = 4096  # store kernel tile: BLOCK_T tokens x BLOCK_HD (= Hk * D rounded up) elements
_LOG2E = math.log2(math.e)
# finite start of the running max: a row that has seen only masked keys stays exactly at rest (no inf - inf)
_M_INIT = tl.constexpr(-1.0e30)


# Index arithmetic is int64 throughout: slot * stride overflows int32 on large caches, and the interpreter checks
# every int32 multiply and add for overflow (several numpy ops each), which dominated its run time.


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc, DOT_F32: tl.constexpr):
    """One key block of the online softmax (scores ``s`` in log2 units, masked with -inf): the new running max,
    normaliser and output accumulator. The weights are rounded to V's dtype before the product, as flash
    attention does."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = p.to(v.dtype)
    if DOT_F32:
        v = v.to(tl.float32)
        pv = pv.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    s_kt, s_kh, s_kd, s_vt, s_vh, s_vd,
    s_kcs, s_kch, s_kcd, s_vcs, s_vch, s_vcd,
    T, H, D,
    BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    t_ok = t < T
    slot = tl.load(slot_ptr + t, mask=t_ok, other=0).to(tl.int64)
    hd = tl.arange(0, BLOCK_HD).to(tl.int64)  # one token's K (or V) row, all heads, flattened
    h = hd // D
    d = hd % D
    mask = t_ok[:, None] & (hd < H * D)[None, :]
    k = tl.load(k_ptr + t[:, None] * s_kt + (h * s_kh + d * s_kd)[None, :], mask=mask)
    tl.store(kc_ptr + slot[:, None] * s_kcs + (h * s_kch + d * s_kcd)[None, :], k, mask=mask)
    v = tl.load(v_ptr + t[:, None] * s_vt + (h * s_vh + d * s_vd)[None, :], mask=mask)
    tl.store(vc_ptr + slot[:, None] * s_vcs + (h * s_vch + d * s_vcd)[None, :], v, mask=mask)


@triton.jit
def _decode_kernel(
    q_ptr, kc_ptr, vc_ptr, o_ptr, rows_ptr, table_ptr, lens_ptr,
    s_qt, s_qh, s_qd, s_ot, s_oh, s_od,
    s_kcs, s_kch, s_kcd, s_vcs, s_vch, s_vcd,
    s_tb, s_tl,
    qk_scale, window, D,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_WINDOW: tl.constexpr, DOT_F32: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1).to(tl.int64)
    row = tl.load(rows_ptr + b).to(tl.int64)
    ctx = tl.load(lens_ptr + b).to(tl.int64)
    g = tl.arange(0, BLOCK_G).to(tl.int64)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    n = tl.arange(0, BLOCK_N).to(tl.int64)
    d_ok = (d < D)[None, :]
    heads = (hk * GROUP + g)[:, None]
    q_mask = (g < GROUP)[:, None] & d_ok
    q = tl.load(q_ptr + row * s_qt + heads * s_qh + d[None, :] * s_qd, mask=q_mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    tab = table_ptr + b * s_tb
    k_col = (hk * s_kch + d * s_kcd)[None, :]
    v_col = (hk * s_vch + d * s_vcd)[None, :]

    m_i = tl.full([BLOCK_G], _M_INIT, tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    lo = 0
    if USE_WINDOW:  # the decode token sits at ctx - 1 and sees keys ctx - window .. ctx - 1
        first = tl.maximum(ctx - window, 0)
        lo = (first // BLOCK_N) * BLOCK_N
    for start in range(lo, ctx, BLOCK_N):
        kpos = start + n
        in_ctx = kpos < ctx
        slots = tl.load(tab + kpos * s_tl, mask=in_ctx, other=0).to(tl.int64)[:, None]
        kv_mask = in_ctx[:, None] & d_ok
        k = tl.load(kc_ptr + slots * s_kcs + k_col, mask=kv_mask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        visible = in_ctx
        if USE_WINDOW:
            visible = visible & (kpos >= first)
        s = tl.where(visible[None, :], s, float("-inf"))
        v = tl.load(vc_ptr + slots * s_vcs + v_col, mask=kv_mask, other=0.0)
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, DOT_F32)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + row * s_ot + heads * s_oh + d[None, :] * s_od, out.to(o_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, o_ptr, work_ptr, slots_ptr,
    s_qt, s_qh, s_qd, s_ot, s_oh, s_od,
    s_kcs, s_kch, s_kcd, s_vcs, s_vch, s_vcd,
    qk_scale, window, D,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_F32: tl.constexpr,
):
    w = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1).to(tl.int64)
    item = work_ptr + w * 5  # q_start, q_len, ctx_len, offset of the chunk's slots, first query of this block
    q_start = tl.load(item).to(tl.int64)
    q_len = tl.load(item + 1).to(tl.int64)
    ctx = tl.load(item + 2).to(tl.int64)
    slot_off = tl.load(item + 3).to(tl.int64)
    m0 = tl.load(item + 4).to(tl.int64)

    r = tl.arange(0, BLOCK_M * BLOCK_G).to(tl.int64)  # tile row r: query m0 + r // BLOCK_G, head r % BLOCK_G
    m = m0 + r // BLOCK_G
    g = r % BLOCK_G
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    n = tl.arange(0, BLOCK_N).to(tl.int64)
    d_ok = (d < D)[None, :]
    q_mask = ((m < q_len) & (g < GROUP))[:, None] & d_ok
    rows = (q_start + m)[:, None]
    heads = (hk * GROUP + g)[:, None]
    q = tl.load(q_ptr + rows * s_qt + heads * s_qh + d[None, :] * s_qd, mask=q_mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    base = ctx - q_len  # position of the chunk's first query
    qpos = (base + m)[:, None]
    seq_slots = slots_ptr + slot_off
    k_col = (hk * s_kch + d * s_kcd)[None, :]
    v_col = (hk * s_vch + d * s_vcd)[None, :]

    m_i = tl.full([BLOCK_M * BLOCK_G], _M_INIT, tl.float32)
    l_i = tl.full([BLOCK_M * BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_M * BLOCK_G, BLOCK_D], 0.0, tl.float32)
    hi = tl.minimum(base + m0 + BLOCK_M, ctx)  # one past the last key any query of this block sees
    lo = 0
    if USE_WINDOW:
        lo = (tl.maximum(base + m0 - window + 1, 0) // BLOCK_N) * BLOCK_N
    for start in range(lo, hi, BLOCK_N):
        kpos = start + n
        in_ctx = kpos < ctx
        slots = tl.load(seq_slots + kpos, mask=in_ctx, other=0).to(tl.int64)[:, None]
        kv_mask = in_ctx[:, None] & d_ok
        k = tl.load(kc_ptr + slots * s_kcs + k_col, mask=kv_mask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        kpos = kpos[None, :]
        visible = kpos <= qpos  # implies kpos < ctx for every real query row
        if USE_WINDOW:
            visible = visible & (kpos > qpos - window)
        s = tl.where(visible, s, float("-inf"))
        v = tl.load(vc_ptr + slots * s_vcs + v_col, mask=kv_mask, other=0.0)
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, DOT_F32)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + rows * s_ot + heads * s_oh + d[None, :] * s_od, out.to(o_ptr.dtype.element_ty), mask=q_mask)


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _tile(elem_bytes: int, block_d: int) -> int:
    """Keys per block and prefill tile rows for this dtype and head dim (fixed per model: batch invariant)."""
    return max(16, min(MAX_TILE, TILE_BYTES // (elem_bytes * block_d)))


def _prefill_plan(meta: AttentionMetadata, block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill work list ``[W, 5]`` int32 (one item per ``block_m`` queries of a chunk) and every chunk's slots
    concatenated. Every layer of a step shares ``meta``, so this is built once per step and kept on it (from the
    chunks' plain ints: no host sync)."""
    plans = meta.__dict__.setdefault("_triton_prefill_plans", {})
    key = (block_m, device)
    plan = plans.get(key)
    if plan is None:
        items, off = [], 0
        for s in meta.prefills:
            items.extend((s.q_start, s.q_len, s.ctx_len, off, m0) for m0 in range(0, s.q_len, block_m))
            off += s.ctx_len
        work = torch.tensor(items, dtype=torch.int32).to(device, non_blocking=True)
        slots = torch.cat([s.kv_slots[: s.ctx_len].to(device=device, dtype=torch.long) for s in meta.prefills])
        plan = plans[key] = (work, slots)
    return plan


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """``k_cache[slot_mapping] = k`` and the same for ``v``, by ``_store_kv_kernel`` (a tile of tokens per program)."""
    t, hk, d = k.shape
    if t == 0:
        return
    block_hd = triton.next_power_of_2(hk * d)
    block_t = max(1, STORE_BLOCK_ELEMS // block_hd)
    _store_kv_kernel[(triton.cdiv(t, block_t),)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        t, hk, d, BLOCK_T=block_t, BLOCK_HD=block_hd,
    )


# registry: imported on first use (triton takes seconds to import and is absent from CPU-only installs)
@register("attention", "triton_paged")
def triton_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
    """Triton paged attention: store kernel, one chunked-prefill launch, one paged-decode launch (see module doc)."""
    check_device(q, "attention triton_paged")
    hq, hk, d = q.shape[1], k.shape[1], q.shape[2]
    if hq % hk:
        raise ValueError(f"attention triton_paged: {hq} query heads are not a multiple of {hk} KV heads")
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    group = hq // hk
    use_window = sliding_window is not None
    block_d = _block_d(d)
    tile = _tile(q.element_size(), block_d)
    common = dict(
        qk_scale=float(scale) * _LOG2E, window=int(sliding_window) if use_window else 0, D=d, GROUP=group,
        BLOCK_D=block_d, USE_WINDOW=use_window,
        # the interpreter's tl.dot multiplies bfloat16 bit patterns as integers (triton-lang/triton#11584): there
        # the operands are widened to float32 after the same rounding of p the GPU path does
        DOT_F32=interpreting() and q.dtype == torch.bfloat16,
    )
    strides = (*q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride())
    block_g = triton.next_power_of_2(group)
    if meta.prefills:
        block_m = max(1, tile // block_g)
        work, slots = _prefill_plan(meta, block_m, q.device)
        _prefill_kernel[(work.shape[0], hk)](
            q, k_cache, v_cache, out, work, slots, *strides,
            BLOCK_G=block_g, BLOCK_M=block_m, BLOCK_N=tile, **common,
        )
    rows = meta.decode_rows
    if rows is not None and rows.numel():
        table = meta.decode_kv_slots
        _decode_kernel[(rows.shape[0], hk)](
            q, k_cache, v_cache, out, rows, table, meta.decode_ctx_lens, *strides, *table.stride(),
            BLOCK_G=max(16, block_g), BLOCK_N=tile, **common,
        )
    return out
