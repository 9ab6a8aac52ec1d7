"""``layer_ops`` ``triton``: the decoder's elementwise and row-wise steps as Triton kernels.

Four kernels, each one pass over its tensors (torch runs 3-8 ops and as many temporaries for each):

* ``rms_norm``: a program normalises a tile of ``BLOCK_M`` rows; each row is one ``BLOCK_N = next_pow2(N)`` wide
  slice held whole, so its sum of squares is one in-register reduction. Rows are addressed by two strides (an
  outer and an inner leading dim), so the per-head q/k norm runs on the strided ``[T, H, D]`` views of the fused
  qkv projection without a copy (leading dims that do not collapse to two are copied first).
* ``add_rms_norm``: the same over ``[T, H]`` with the residual add first; writes both the sum and its norm.
* ``silu_mul``: ``silu(gate) * up`` of ``[M, 2I]`` (gate first) -> ``[M, I]``; a program covers
  ``BLOCK_M x BLOCK_I`` outputs.
* ``rotary``: RoPE in rotate-half form (``x * cos + rotate_half(x) * sin``, cos/sin ``[T, D]`` with both halves
  given, as :func:`~litellm_pipeline.model.rope.apply_rotary` takes them), in place, one launch for q and k: every
  ``(token, head)`` pair is a row, addressed by token and head strides (q/k may be views of the fused
  projection); a program rotates ``BLOCK_R`` rows of ``BLOCK_D = next_pow2(D)``, loading each element and its
  rotate-half partner (``d +- D/2``) and the token's cos/sin rows.

Grids are 1-D over row tiles (``rotary``: q's tiles, then k's; ``silu_mul``: 2-D, row tiles x column tiles).
Tiles hold about :data:`TILE_ELEMENTS` elements: ``BLOCK_N``/``BLOCK_D``/``BLOCK_I`` is the row width rounded up
to a power of two (``BLOCK_I`` at most :data:`MAX_BLOCK_I`) and the row count fills the rest, so a head dim gets
many rows per program and a wide hidden size one; 4 warps up to 4096 elements, 8 to 16384, then 16. Offsets are
int64. Block sizes depend on the row width only, never on the number of rows: a row gets the same arithmetic
whatever else is in the batch, so the kernels are batch-invariant as they are (``deterministic=True`` changes only
the inherited ``linear``, which then runs row by row).

Numerics follow :class:`~litellm_pipeline.model.layer_ops.TorchLayerOps` op for op: loads are widened to float32
and wherever the torch reference rounds to the activation dtype (the residual sum, the normalised row before the
weight, SiLU before the product, each RoPE product and their sum, cos/sin themselves) the kernels round too, ties
to even. Where the order of operations is torch's the result is bit-identical in every dtype: ``rotary`` and
``add_rms_norm``'s sum. The norms' row sum runs in another order than torch's (a last-bit difference in float32)
and ``exp`` is another implementation than torch's, so float32 ``rms_norm``/``silu_mul`` differ by a few ulps and
half-precision results match torch except where that bit decides a rounding (rarely, by an ulp or two). Division
and square root are the IEEE ones (``div_rn``, ``sqrt_rn``; torch on a CPU computes rsqrt as ``1 / sqrt``); on a
GPU ``exp`` is the hardware approximation. Launches pass ``enable_fp_fusion=False`` so a GPU does not contract
products and sums into FMAs that torch does not use. (The rounding helper rounds to bfloat16 on the bits, because
Triton's interpreter truncates a float32 -> bfloat16 cast where a GPU rounds to nearest.)

``linear`` and ``route`` are :class:`TorchLayerOps`' (the GEMMs are torch's); ``residual_mlp`` is
``h + down(silu_mul(gate_up(x)))`` through ``self``, so its SiLU is this kernel. Inputs the kernels do not take go
to the torch methods: empty tensors, dtypes other than float32/bfloat16/float16, a weight or residual of another
dtype or shape (torch would promote or broadcast), rows wider than :data:`MAX_NORM_COLS`, an odd gate/up width or
head dim, rotary inputs of other ranks or shapes, a q/k whose own elements overlap (an expanded view). q and k must
not share elements with each other (they are rotated in place).

The kernels need CUDA tensors; on a CPU they run only under Triton's interpreter (``TRITON_INTERPRET=1`` set
before triton is imported), slowly (milliseconds per program instance), which is how the tests check them. Each
method first refuses a CPU tensor without the interpreter with a clear error
(:func:`~litellm_pipeline.model.triton_common.check_device`).
"""

from __future__ import annotations

import contextlib

import torch

from litellm_pipeline.model.layer_ops import TorchLayerOps
from litellm_pipeline.model.triton_common import (
    check_device,
    interpreting,
    require_triton,
)
from litellm_pipeline.registry import register

triton = require_triton()
import triton.language as tl  # noqa: E402  (after require_triton: a missing triton gives its clear error first)

TILE_ELEMENTS = 4096  # elements per program tile (rows x padded row width)
MAX_BLOCK_I = 1024  # widest column block of silu_mul (wider intermediates take several column programs)
MAX_NORM_COLS = 65536  # widest row the norms hold in one tile; wider rows take the torch path
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_WHAT = "layer_ops triton"


@triton.jit
def _round(v, DTYPE: tl.constexpr):
    """``v`` (float32) rounded to ``DTYPE``'s precision (ties to even, as torch rounds), still float32."""
    out = v
    if DTYPE == tl.bfloat16:
        bits = tl.where(v != v, 0, v.to(tl.uint32, bitcast=True))  # (NaN is put back below; no wrap-around)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000  # add half an ulp (ties to even), truncate
        out = tl.where(v != v, v, bits.to(tl.float32, bitcast=True))
    elif DTYPE == tl.float16:
        out = v.to(tl.float16).to(tl.float32)
    return out


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, n_rows, rows_inner, stride_xo, stride_xi, stride_xn, stride_w, n_cols, n_cols_f, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    dt: tl.constexpr = out_ptr.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64 offsets throughout
    cols = tl.arange(0, BLOCK_N).to(tl.int64)
    col_ok = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    x_off = (rows // rows_inner) * stride_xo + (rows % rows_inner) * stride_xi
    x = tl.load(x_ptr + x_off[:, None] + cols[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
    ms = tl.div_rn(tl.sum(x * x, axis=1), n_cols_f)  # torch on a CPU: sum / N
    rstd = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))  # torch.rsqrt on a CPU: 1 / sqrt
    y = _round(x * rstd[:, None], dt)  # the reference casts to x's dtype before the weight
    w = tl.load(w_ptr + cols * stride_w, mask=col_ok, other=0.0).to(tl.float32)
    out = _round(w[None, :] * y, dt)
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], out.to(dt), mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, s_ptr, out_ptr, n_rows, stride_xm, stride_xn, stride_rm, stride_rn, stride_w, n_cols, n_cols_f,
    eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    dt: tl.constexpr = out_ptr.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64 offsets throughout
    cols = tl.arange(0, BLOCK_N).to(tl.int64)
    col_ok = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn, mask=mask, other=0.0)
    r = tl.load(r_ptr + rows[:, None] * stride_rm + cols[None, :] * stride_rn, mask=mask, other=0.0)
    s = _round(x.to(tl.float32) + r.to(tl.float32), dt)  # the sum in the activation dtype (the next residual)
    out_off = rows[:, None] * n_cols + cols[None, :]
    tl.store(s_ptr + out_off, s.to(dt), mask=mask)
    ms = tl.div_rn(tl.sum(s * s, axis=1), n_cols_f)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
    y = _round(s * rstd[:, None], dt)
    w = tl.load(w_ptr + cols * stride_w, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_off, _round(w[None, :] * y, dt).to(dt), mask=mask)


@triton.jit
def _silu_mul_kernel(
    gu_ptr, out_ptr, n_rows, inter, stride_m, stride_n,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
):
    dt: tl.constexpr = out_ptr.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < n_rows)[:, None] & (cols < inter)[None, :]
    g_ptrs = gu_ptr + rows[:, None] * stride_m + cols[None, :] * stride_n
    g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(g_ptrs + inter * stride_n, mask=mask, other=0.0).to(tl.float32)
    act = _round(tl.div_rn(g, 1.0 + tl.exp(-g)), dt)  # torch's silu: x / (1 + exp(-x)), rounded before the product
    tl.store(out_ptr + rows[:, None] * inter + cols[None, :], _round(act * u, dt).to(dt), mask=mask)


@triton.jit
def _rotate_rows(
    x_ptr, cos_ptr, sin_ptr, block, n_rows, heads, stride_t, stride_h, stride_d,
    stride_ct, stride_cd, stride_st, stride_sd, head_dim,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    dt: tl.constexpr = x_ptr.dtype.element_ty
    rows = block.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D).to(tl.int64)
    half = head_dim // 2
    first = cols < half
    partner = tl.where(first, cols + half, cols - half)  # rotate_half(x) = cat(-x2, x1): x[partner] * sign
    sign = tl.where(first, -1.0, 1.0)
    mask = (rows < n_rows)[:, None] & (cols < head_dim)[None, :]
    tok = rows // heads
    base = x_ptr + (tok * stride_t + (rows % heads) * stride_h)[:, None]
    x = tl.load(base + cols[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    xr = sign[None, :] * tl.load(base + partner[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + (tok * stride_ct)[:, None] + cols[None, :] * stride_cd, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + (tok * stride_st)[:, None] + cols[None, :] * stride_sd, mask=mask, other=0.0).to(tl.float32)
    # (x * cos) + (rotate_half(x) * sin); each product and the sum round in dt, as in apply_rotary
    out = _round(_round(x * c, dt) + _round(xr * s, dt), dt)
    tl.store(base + cols[None, :] * stride_d, out.to(dt), mask=mask)  # in place: this program loaded its rows


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_blocks, n_tokens, hq, hk,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_ct, stride_cd, stride_st, stride_sd, head_dim,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < q_blocks:  # the first q_blocks programs rotate q's (token, head) rows, the rest k's
        _rotate_rows(q_ptr, cos_ptr, sin_ptr, pid, n_tokens * hq, hq, stride_qt, stride_qh, stride_qd,
                     stride_ct, stride_cd, stride_st, stride_sd, head_dim, BLOCK_R, BLOCK_D)
    else:
        _rotate_rows(k_ptr, cos_ptr, sin_ptr, pid - q_blocks, n_tokens * hk, hk, stride_kt, stride_kh, stride_kd,
                     stride_ct, stride_cd, stride_st, stride_sd, head_dim, BLOCK_R, BLOCK_D)


def _tile_rows(width: int) -> tuple[int, int]:
    """(rows per program, padded width) for rows of ``width`` elements: about TILE_ELEMENTS per tile."""
    block = triton.next_power_of_2(max(width, 1))
    return max(1, TILE_ELEMENTS // block), block


def _num_warps(elements: int) -> int:
    return 4 if elements <= 4096 else 8 if elements <= 16384 else 16


def _two_level_rows(x: torch.Tensor) -> tuple[int, int, int] | None:
    """``(rows_inner, stride_outer, stride_inner)`` that address every row of ``x [..., N]`` as
    ``(r // rows_inner) * stride_outer + (r % rows_inner) * stride_inner``, or None when the leading dims do not
    collapse to two (then the caller copies). Size-1 dims are dropped, adjacent dims that tile merged."""
    dims = [(n, s) for n, s in zip(x.shape[:-1], x.stride()[:-1]) if n != 1]
    merged: list[tuple[int, int]] = []
    for n, s in dims:
        if merged and merged[-1][1] == s * n:
            merged[-1] = (merged[-1][0] * n, s)
        else:
            merged.append((n, s))
    if not merged:
        return 1, 0, 0
    if len(merged) == 1:  # rows_inner == 1: triton folds the // and % away
        return 1, merged[0][1], 0
    if len(merged) == 2:
        return merged[1][0], merged[0][1], merged[1][1]
    return None


def _no_overlap(t: torch.Tensor) -> bool:
    """No two indices of ``t`` share an element (so writing it in place is safe)."""
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1)
    span = 1
    for s, n in dims:
        if s < span:
            return False
        span = s * n
    return True


def _quiet_overflow():
    """The interpreter runs the kernels in numpy, which warns where exp overflows to inf (a GPU does so silently;
    SiLU is exact there: x / inf = -0)."""
    if not interpreting():
        return contextlib.nullcontext()
    import numpy as np

    return np.errstate(over="ignore")


# registry: imported on first use (triton takes seconds to import and is absent from CPU-only installs)
@register("layer_ops", "triton")
class TritonLayerOps(TorchLayerOps):
    """Triton kernels for rms_norm, add_rms_norm, silu_mul and rotary; torch's linear and route."""

    def __init__(self, deterministic: bool = False):
        # the kernels' tiles depend on the row width only, so they are batch-invariant in either mode
        super().__init__(deterministic)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        check_device(x, _WHAT)
        n = x.shape[-1] if x.dim() else 0
        if x.numel() == 0 or x.dtype not in _DTYPES or w.dtype != x.dtype or w.shape != (n,) or n > MAX_NORM_COLS:
            return super().rms_norm(x, w, eps)
        rows = _two_level_rows(x)
        if rows is None:
            x = x.contiguous()
            rows = _two_level_rows(x)
        rows_inner, stride_o, stride_i = rows
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        m = x.numel() // n
        block_m, block_n = _tile_rows(n)
        _rms_norm_kernel[(triton.cdiv(m, block_m),)](
            x, w, out, m, rows_inner, stride_o, stride_i, x.stride(-1), w.stride(0), n, float(n), eps,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=_num_warps(block_m * block_n), enable_fp_fusion=False,
        )
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float):
        check_device(x, _WHAT)
        n = x.shape[-1] if x.dim() else 0
        if (
            x.numel() == 0 or x.dtype not in _DTYPES or residual.dtype != x.dtype or w.dtype != x.dtype
            or residual.shape != x.shape or w.shape != (n,) or n > MAX_NORM_COLS
        ):
            return super().add_rms_norm(x, residual, w, eps)
        x2, r2 = x.reshape(-1, n), residual.reshape(-1, n)  # views for the [T, H] the layers pass
        m = x2.shape[0]
        s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        block_m, block_n = _tile_rows(n)
        _add_rms_norm_kernel[(triton.cdiv(m, block_m),)](
            x2, r2, w, s, out, m, x2.stride(0), x2.stride(1), r2.stride(0), r2.stride(1), w.stride(0), n, float(n), eps,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=_num_warps(block_m * block_n), enable_fp_fusion=False,
        )
        return s, out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        check_device(gate_up, _WHAT)
        if gate_up.numel() == 0 or gate_up.dtype not in _DTYPES or gate_up.dim() == 0 or gate_up.shape[-1] % 2:
            return super().silu_mul(gate_up)
        inter = gate_up.shape[-1] // 2
        gu = gate_up.reshape(-1, 2 * inter)
        m = gu.shape[0]
        out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
        block_i = min(triton.next_power_of_2(inter), MAX_BLOCK_I)
        block_m = max(1, TILE_ELEMENTS // block_i)
        with _quiet_overflow():
            _silu_mul_kernel[(triton.cdiv(m, block_m), triton.cdiv(inter, block_i))](
                gu, out, m, inter, gu.stride(0), gu.stride(1),
                BLOCK_M=block_m, BLOCK_I=block_i, num_warps=_num_warps(block_m * block_i), enable_fp_fusion=False,
            )
        return out

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotates ``q`` and ``k`` in place (one launch for both) and returns them."""
        check_device(q, _WHAT)
        if (
            q.dim() != 3 or k.dim() != 3 or cos.dim() != 2 or sin.dim() != 2
            or q.numel() == 0 or k.numel() == 0 or q.dtype not in _DTYPES or k.dtype != q.dtype
            or q.shape[-1] % 2 or k.shape[-1] != q.shape[-1] or k.shape[0] != q.shape[0]
            or cos.shape != (q.shape[0], q.shape[-1]) or sin.shape != cos.shape
            or not (_no_overlap(q) and _no_overlap(k))
        ):
            return super().rotary(q, k, cos, sin)
        t, hq, d = q.shape
        hk = k.shape[1]
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # as apply_rotary does (a no-op where they already are)
        block_r, block_d = _tile_rows(d)
        q_blocks = triton.cdiv(t * hq, block_r)
        _rotary_kernel[(q_blocks + triton.cdiv(t * hk, block_r),)](
            q, k, cos, sin, q_blocks, t, hq, hk, *q.stride(), *k.stride(), *cos.stride(), *sin.stride(), d,
            BLOCK_R=block_r, BLOCK_D=block_d, num_warps=_num_warps(block_r * block_d), enable_fp_fusion=False,
        )
        return q, k

    def residual_mlp(self, h: torch.Tensor, x: torch.Tensor, mlp) -> torch.Tensor:
        """``h + down(silu_mul(gate_up(x)))`` through ``self``: torch's GEMMs around the silu_mul kernel."""
        return h + self.linear(self.silu_mul(self.linear(x, mlp.gate_up_proj)), mlp.down_proj)
