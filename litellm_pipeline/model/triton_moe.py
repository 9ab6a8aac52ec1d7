"""``moe_dispatch`` ``triton_fused``: the experts of a MoE layer as two grouped GEMMs in Triton.

Grouping (vLLM's ``moe_align_block_size`` idea, done with torch ops on the device): the ``T*K`` (token, slot)
pairs are stably sorted by expert (slots marked ``-1`` sort last and are dropped), and each expert's group is
padded to a multiple of ``BLOCK_M`` rows. ``sorted_ids`` holds, per padded row, the flat pair index ``t*K + k``
(``T*K`` on padding rows) and ``block_expert`` the expert of each block of ``BLOCK_M`` rows (``-1`` past the last
used block: the grid is sized from an upper bound, so such programs return at once).

Two launches, grid ``(blocks of BLOCK_M rows, column blocks of BLOCK_N)``, each program one expert's block of rows
times one block of output columns, fp32 accumulation over ``BLOCK_K`` slices of the reduction dimension:

1. gate/up: the program loads its rows of ``x`` once per ``BLOCK_K`` slice and multiplies them by both the gate
   rows ``w13[e, n]`` and the up rows ``w13[e, I + n]``, so the epilogue has both tiles and writes
   ``silu(gate) * up`` (fp32 math, stored in x's dtype, ``[padded rows, I]``: the ``[rows, 2I]`` projection never
   reaches memory).
2. down: ``h @ w2[e]^T`` times the routing weight, written to that pair's own row of a ``[T*K, H]`` buffer (x's
   dtype, unused slots stay zero). Each row is written by exactly one program: no atomics.

The ``K`` slot rows of a token are then summed with torch in float32 in slot order 0..K-1 and cast to x's dtype,
so the result is deterministic and batch invariant (block sizes are fixed, not tuned to the batch: a row's
reduction order never depends on the other rows; bit for bit on a GPU, the interpreter's numpy matmul rounds a
row by its place in the tile). Block sizes: ``BLOCK_M = 16`` (decode steps give an expert a
few rows; the smallest ``tl.dot`` tile), ``BLOCK_N = 64``, ``BLOCK_K = 64``; fp32 inputs use IEEE products, not TF32.

One host sync per call (the number of used slots: it sizes the grid, and a batch with no used slot returns zeros
without launching), as ``packed`` has. The kernels need CUDA tensors; on a CPU they run only under Triton's
interpreter (``TRITON_INTERPRET=1`` set before triton is imported), slowly, which is how the tests check them.
The interpreter has no bfloat16 math, so there (only) bfloat16 dot operands are widened to float32 and results
rounded to nearest-even in the kernel before the store: the same numbers a GPU gives, up to summation order.
"""

from __future__ import annotations

import torch

from litellm_pipeline.model.triton_common import (
    check_device,
    interpreting,
    require_triton,
)
from litellm_pipeline.registry import register

triton = require_triton()
import triton.language as tl  # noqa: E402  (after require_triton: a missing triton gives its clear error first)

BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _round_bf16(v):
    # float32 -> nearest-even bfloat16 value (still float32): the interpreter's own cast truncates
    b = v.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _gate_up_kernel(
    x_ptr, w13_ptr, h_ptr, sorted_ids_ptr, block_expert_ptr,
    num_pairs, top_k, hidden, inter,
    stride_xt, stride_xh, stride_we, stride_wo, stride_wh, stride_hm, stride_hn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERP_BF16: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:  # past the last used block
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + rows)
    rows = rows.to(tl.int64)  # h can pass 2**31 elements in a long prefill
    row_ok = ids < num_pairs  # padding rows hold num_pairs
    tok = tl.where(row_ok, ids // top_k, 0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w_base = w13_ptr + e.to(tl.int64) * stride_we
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + tok[:, None] * stride_xt + ks[None, :] * stride_xh,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & col_ok[None, :]
        bg = tl.load(w_base + cols[None, :] * stride_wo + ks[:, None] * stride_wh, mask=b_mask, other=0.0)
        bu = tl.load(w_base + (inter + cols)[None, :] * stride_wo + ks[:, None] * stride_wh, mask=b_mask, other=0.0)
        if INTERP_BF16:
            a, bg, bu = a.to(tl.float32), bg.to(tl.float32), bu.to(tl.float32)
        acc_g = tl.dot(a, bg, acc_g, input_precision="ieee")
        acc_u = tl.dot(a, bu, acc_u, input_precision="ieee")
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    if INTERP_BF16:
        h = _round_bf16(h)
    tl.store(h_ptr + rows[:, None] * stride_hm + cols[None, :] * stride_hn, h.to(h_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w2_ptr, weight_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr,
    num_pairs, hidden, inter,
    stride_hm, stride_hn, stride_we, stride_wh, stride_wi, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERP_BF16: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + rows)
    rows = rows.to(tl.int64)  # h can pass 2**31 elements in a long prefill
    row_ok = ids < num_pairs
    pair = tl.where(row_ok, ids, 0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_base = w2_ptr + e.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(h_ptr + rows[:, None] * stride_hm + ks[None, :] * stride_hn,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_base + cols[None, :] * stride_wh + ks[:, None] * stride_wi,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if INTERP_BF16:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    wt = tl.load(weight_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * wt[:, None]
    if INTERP_BF16:
        acc = _round_bf16(acc)
    tl.store(out_ptr + pair[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def align_block_size(flat_idx: torch.Tensor, num_experts: int, num_used: int, block_m: int):
    """``(sorted_ids, block_expert)``: the pair indices grouped by expert, each group padded to ``block_m`` rows.

    ``flat_idx`` ``[N]`` holds each pair's expert (``-1``: unused); ``num_used`` its count of used pairs. Padding
    rows hold ``N``; blocks past the last used one have expert ``-1``. No host sync: sizes come from ``num_used``.
    """
    n = flat_idx.numel()
    dev = flat_idx.device
    key = torch.where(flat_idx >= 0, flat_idx, num_experts)  # unused pairs sort after every expert
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    start = torch.cumsum(counts, 0) - counts
    # each nonempty expert pads fewer than block_m rows (vLLM's bound): sum ceil(c/bm) <= (used + nE*(bm-1)) // bm
    num_blocks = (num_used + min(num_experts, num_used) * (block_m - 1)) // block_m
    cap = num_blocks * block_m
    sorted_e = key[order]
    used = sorted_e < num_experts
    e_safe = torch.where(used, sorted_e, 0)
    dest = pad_start[e_safe] + torch.arange(n, device=dev) - start[e_safe]
    dest = torch.where(used, dest, cap)  # unused pairs land in a dump row, sliced off
    sorted_ids = torch.full((cap + 1,), n, dtype=torch.long, device=dev)
    sorted_ids[dest] = order
    block_start = torch.arange(num_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(pad_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_ids[:cap], block_expert


# registry: imported on first use (triton takes seconds to import and is absent from CPU-only installs)
@register("moe_dispatch", "triton_fused")
def triton_fused_dispatch(
    x: torch.Tensor, expert_idx: torch.Tensor, expert_w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ops
) -> torch.Tensor:
    """``packed``'s result from two grouped-GEMM Triton launches (see the module docstring); ``ops`` is unused."""
    check_device(x, "moe_dispatch triton_fused")
    t, k = expert_idx.shape
    hidden = x.shape[1]
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    if not (w13.dtype == w2.dtype == x.dtype):
        raise TypeError(f"moe_dispatch triton_fused: x, w13 and w2 must share a dtype, got {x.dtype}, {w13.dtype}, "
                        f"{w2.dtype}")
    if t == 0 or k == 0:
        return torch.zeros_like(x)
    flat = expert_idx.reshape(-1)
    num_used = int((flat >= 0).sum())  # the one host sync: sizes the grid
    if num_used == 0:
        return torch.zeros_like(x)
    sorted_ids, block_expert = align_block_size(flat, num_experts, num_used, BLOCK_M)
    num_blocks = block_expert.numel()
    n = flat.numel()

    # Triton's interpreter does not support bfloat16 math: its tl.dot multiplies the raw bits (triton-lang/triton
    # #11584) and its float32 -> bfloat16 cast truncates. Under it, widen the dot operands to float32 (bf16
    # products are exact in float32, as in the MMA) and round to nearest-even before storing, as a GPU does.
    interp_bf16 = interpreting() and x.dtype == torch.bfloat16
    h = torch.empty((sorted_ids.numel(), inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, BLOCK_N))](
        x, w13, h, sorted_ids, block_expert,
        n, k, hidden, inter,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), h.stride(0), h.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, INTERP_BF16=interp_bf16,
    )
    slots = torch.zeros((n, hidden), dtype=x.dtype, device=x.device)  # unused slots stay zero
    weights = expert_w.reshape(-1).to(torch.float32).contiguous()
    _down_kernel[(num_blocks, triton.cdiv(hidden, BLOCK_N))](
        h, w2, weights, slots, sorted_ids, block_expert,
        n, hidden, inter,
        h.stride(0), h.stride(1), w2.stride(0), w2.stride(1), w2.stride(2), slots.stride(0), slots.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, INTERP_BF16=interp_bf16,
    )
    slots = slots.view(t, k, hidden)
    out = slots[:, 0].float()
    for j in range(1, k):  # fixed slot order: deterministic, and a token's sum never depends on other tokens
        out = out + slots[:, j]
    return out.to(x.dtype)
