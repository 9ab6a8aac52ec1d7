"""4-bit weight-only layer ops (registry kind ``layer_ops``, name ``cpu_int4``).

Select with ``pipeline.stages.decode.params.layer_ops=cpu_int4``; its parameters
(``pipeline.stages.decode.params.layer_ops_params={group_size: 32, symmetric: true, scale_dtype: float16,
lm_head: false, activations: int8}``):

* ``group_size`` (32): weights of a row share a scale in runs of this many (a multiple of 32; 32 and 128 are the
  usual choices: 128 stores a quarter of the scales, 32 is closer to the float weights);
* ``symmetric`` (true): codes centred on 8 with one scale per group, as llama.cpp's Q4_0 (the scale is the group's
  largest-magnitude weight over -8, so that weight comes back up to the scale's rounding); false adds an offset
  per group (the group's minimum, scale = range / 15), as Q4_1;
* ``scale_dtype`` (float16): float16 or bfloat16 scales and offsets;
* ``lm_head`` (false): the LM head quantized too (with tied embeddings it gets its own copy);
* ``activations`` (int8): decode-size steps quantize each activation row to int8 in blocks of 32 and sum the
  products of codes and activations exactly in integers (VNNI where the CPU has it), llama.cpp's Q4_0 x Q8_0
  arithmetic; ``float`` keeps the activations exact and widens every weight to float32 instead (slower on CPUs
  where the integer products are faster, and the weights' error is then the only one).

When the decode stage binds these ops, ``prepare_weights`` quantizes the same projections ``cpu_int8`` does
(attention ``qkv_proj`` / ``o_proj``, dense MLPs, MoE experts ``w13`` / ``w2``, shared experts; never embeddings,
routers, norms or biases) from whatever float checkpoint was loaded. A weight ``[..., O, K]`` becomes ``uint8
[..., O, K / 2]`` (two codes a byte, llama.cpp's nibble order within each run of 32) with ``scale`` (and
``zero``) ``[..., O, K / group_size]`` kept on the module (``int4_groups``): 4.5 bits a weight at group 32 with
16-bit scales, 4.125 at 128. Every K must be a multiple of ``group_size``: a weight that is not is named in the
error before anything is changed.

``linear(x, w)`` with a packed ``w`` runs ``int4_linear`` (``csrc/int4_linear.cpp``) in the arithmetic
``activations`` names, per row in a fixed order, biased and rounded once to ``x``'s dtype, so a row's result does
not depend on its batch (``engine.deterministic`` runs it at every row count). With int8 activations on the
AVX-512 and AVX2 builds, steps of ``gemm_min_rows`` (16) rows or more (prefill) run the kernel's GEMM, the same
integer arithmetic with the float32 terms added in another order (the last bits can differ from the same row in a
small step; never under ``deterministic``). Otherwise steps with more than ``kernel_max_rows`` rows (64 with the
AVX-512 build's 512-bit tile, else ``INT4_KERNEL_MAX_ROWS``, 16) widen the weights to float32 in blocks of rows
and use torch's GEMM with the exact activations. The whole-model decode step of ``cpu_fused`` (its C++
``DecodePlan``) runs the kernel (tiles, or the GEMM from ``gemm_min_rows``) on its threads for steps of up to
``kernel_max_rows`` rows; the per-layer fused paths do not take 4-bit weights (those steps run layer by layer
through ``linear``). Expert offload (``moe.hot_experts``) is refused.

Accuracy against float32 is measured in ``tests/model/test_int4_ops.py`` and the docs (``docs/quantization.md``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from litellm_pipeline.model.int8_ops import Int8LayerOps, _key
from litellm_pipeline.registry import register

# Most rows for which (deterministic=False) the 4-bit kernel runs; above, widen-and-GEMM (see the docs' measurements)
# (the build's own limit, ``Int4LayerOps.kernel_max_rows``, is 64 with the 512-bit AVX-512 tile)
INT4_KERNEL_MAX_ROWS = 16
# output rows widened to float32 at a time on the many-row path (bounds its temporary to ~this x K x 4 bytes)
_DEQUANT_BLOCK = 1024
_SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class Int4Groups(NamedTuple):
    """A 4-bit weight's group parameters: ``scale`` (and ``zero``, None when symmetric) ``[..., O, K / group]``."""

    scale: torch.Tensor
    zero: torch.Tensor | None
    group: int

    def rows(self, index) -> Int4Groups:
        """The parameters of ``w[index]``: an expert of a ``[E, O, K]`` stack, or a slice of output rows."""
        return Int4Groups(self.scale[index], None if self.zero is None else self.zero[index], self.group)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., K]`` (each < 16, K a multiple of 32) into ``[..., K / 2]``: in each run of 32, byte j
    holds code j (low nibble) and code j + 16 (high nibble)."""
    runs = codes.reshape(*codes.shape[:-1], -1, 2, 16)
    return (runs[..., 0, :] | (runs[..., 1, :] << 4)).reshape(*codes.shape[:-1], codes.shape[-1] // 2)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The codes ``[..., K]`` (uint8, 0-15) of a packed ``[..., K / 2]`` tensor (see ``_pack``)."""
    runs = packed.reshape(*packed.shape[:-1], -1, 16)
    return torch.stack((runs & 0x0F, runs >> 4), dim=-2).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def quantize_groups(w: torch.Tensor, group: int = 32, symmetric: bool = True,
                    scale_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, Int4Groups]:
    """Group-wise 4-bit quantization of ``w [..., O, K]``: ``(packed uint8 [..., O, K / 2], Int4Groups)``.

    Symmetric: ``scale = m / -8`` with ``m`` the group's largest-magnitude weight (rounded to ``scale_dtype``),
    ``code = clamp(round(w / scale) + 8, 0, 15)``, weight ``(code - 8) * scale``. Asymmetric: ``zero = min``,
    ``scale = (max - min) / 15`` (both rounded), ``code = clamp(round((w - zero) / scale), 0, 15)``, weight
    ``code * scale + zero``. An all-zero group gets scale 0 (its weights dequantize to 0)."""
    k = w.shape[-1]
    if group <= 0 or group % 32 or k % group:
        raise ValueError(f"K = {k} is not a multiple of the group size {group} (a multiple of 32)")
    wf = w.detach().float().reshape(*w.shape[:-1], k // group, group)
    if symmetric:
        m = wf.gather(-1, wf.abs().argmax(-1, keepdim=True)).squeeze(-1)
        scale = (m / -8).to(scale_dtype)
        sf = scale.float().unsqueeze(-1)
        codes = torch.round(wf / torch.where(sf != 0, sf, torch.ones_like(sf))) + 8
        zero = None
    else:
        lo, hi = wf.amin(-1), wf.amax(-1)
        scale, zero = ((hi - lo) / 15).to(scale_dtype), lo.to(scale_dtype)
        sf = scale.float().unsqueeze(-1)
        codes = torch.round((wf - zero.float().unsqueeze(-1)) / torch.where(sf != 0, sf, torch.ones_like(sf)))
    codes = codes.clamp_(0, 15).to(torch.uint8).reshape(w.shape)
    return _pack(codes), Int4Groups(scale.contiguous(), None if zero is None else zero.contiguous(), group)


def dequantize(packed: torch.Tensor, groups: Int4Groups) -> torch.Tensor:
    """The float32 weights ``[..., O, K]`` of a packed tensor (``code * scale + zero`` with ``zero = -8 scale``
    when symmetric: the product is exact in float32, so this is what the kernels compute)."""
    codes = unpack(packed).float()
    shape = codes.shape
    codes = codes.reshape(*shape[:-1], -1, groups.group)
    scale = groups.scale.float().unsqueeze(-1)
    zero = -8 * scale if groups.zero is None else groups.zero.float().unsqueeze(-1)
    return (codes * scale + zero).reshape(shape)


@register("layer_ops", "cpu_int4")
class Int4LayerOps(Int8LayerOps):
    """4-bit weight-only projections (group-wise scales) on the C++ kernel; ``cpu_fused`` for the rest.

    ``deterministic=True`` runs every 4-bit ``linear`` through the kernel (per-row arithmetic: batch-invariant).
    """

    QDTYPE = torch.uint8
    STATE = "int4_groups"
    NAME = "cpu_int4"
    INT8_GEMM = False  # its int8 activations are the kernel's (its tiles, or its GEMM for prefill)

    def __init__(self, deterministic: bool = False, group_size: int = 32, symmetric: bool = True,
                 scale_dtype: str = "float16", lm_head: bool = False, activations: str = "int8"):
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or group_size % 32:
            raise ValueError(f"layer_ops cpu_int4: group_size must be a positive multiple of 32 (e.g. 32 or 128), "
                             f"got {group_size!r}")
        if scale_dtype not in _SCALE_DTYPES:
            raise ValueError(f"layer_ops cpu_int4: scale_dtype must be one of {', '.join(_SCALE_DTYPES)}, "
                             f"got {scale_dtype!r}")
        if not isinstance(symmetric, bool):
            raise ValueError(f"layer_ops cpu_int4: symmetric must be true or false, got {symmetric!r}")
        super().__init__(deterministic, lm_head, activations)
        self.group_size = group_size
        self.symmetric = symmetric
        self.scale_dtype = _SCALE_DTYPES[scale_dtype]
        self.activations = activations
        self.int4_q8 = activations == "int8"
        self._stacked: dict[tuple, torch.Tensor] = {}  # plan_scale's stacked scales and offsets
        self._int4_linear = self._int4_dequant = None
        self.kernel_max_rows = INT4_KERNEL_MAX_ROWS  # steps of more rows widen the weights for torch's GEMM
        self.gemm_min_rows = 0  # ... unless the build has the int8-activation GEMM (from this many rows on)
        if self._ok:
            ns = torch.ops.litellm_pipeline_cpu
            self._int4_linear = ns.int4_linear.default
            self._int4_dequant = ns.int4_dequant.default
            self.kernel_max_rows = int(ns.int4_kernel_max_rows())
            # int8 activations from this many rows on: the kernel's GEMM (0: this build has none), faster than
            # widening at every row count measured (docs/results/2026-12-07-int4-gemm.md)
            self.gemm_min_rows = int(ns.int4_gemm_min_rows()) if self.int4_q8 else 0

    # -- weights --------------------------------------------------------------------------------------------

    def _check(self, w: torch.Tensor, name: str) -> None:
        if w.dtype != self.QDTYPE and w.shape[-1] % self.group_size:
            raise ValueError(
                f"layer_ops cpu_int4: {name} {tuple(w.shape)} has K = {w.shape[-1]}, not a multiple of group_size "
                f"{self.group_size}" + ("; try group_size 32" if w.shape[-1] % 32 == 0 else "; use cpu_int8")
            )

    def _quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, Int4Groups]:
        """Row by row in blocks (experts flattened): the float32 temporaries stay small for big weights."""
        flat = w.reshape(-1, w.shape[-1])
        parts = [quantize_groups(flat[r0 : r0 + 4096], self.group_size, self.symmetric, self.scale_dtype)
                 for r0 in range(0, flat.shape[0], 4096)]
        lead = w.shape[:-1]
        q = torch.cat([p for p, _ in parts]).reshape(*lead, -1)
        scale = torch.cat([g.scale for _, g in parts]).reshape(*lead, -1)
        zero = None if self.symmetric else torch.cat([g.zero for _, g in parts]).reshape(*lead, -1)
        return q, Int4Groups(scale, zero, self.group_size)

    def _register(self, q: torch.Tensor, groups: Int4Groups) -> None:
        self._scales[_key(q)] = groups
        if q.dim() == 3:  # [E, O, K / 2] experts: the packed dispatch passes each expert's slice
            for e in range(q.shape[0]):
                self._scales[_key(q[e])] = groups.rows(e)

    def groups_of(self, w: torch.Tensor) -> Int4Groups:
        """The group parameters of a packed weight (or expert slice) this instance prepared."""
        return self.scale_of(w)

    def plan_scale(self, w: torch.Tensor) -> torch.Tensor | None:
        """The decode plan's form of a packed weight's groups: the scales, or scales and offsets stacked
        ``[2, ..., O, K / group]`` (made once per weight and kept)."""
        if w.dtype != torch.uint8:
            return super().plan_scale(w)
        g = self._scales.get(_key(w))
        if g is None:
            return None
        if g.zero is None:
            return g.scale
        stacked = self._stacked.get(_key(w))
        if stacked is None:
            stacked = self._stacked[_key(w)] = torch.stack((g.scale, g.zero))
        return stacked

    def plan_only(self, w: torch.Tensor) -> bool:
        return w.dtype == torch.uint8

    def weights_moved(self, model) -> None:
        self._stacked.clear()
        super().weights_moved(model)

    # -- ops ------------------------------------------------------------------------------------------------

    def linear(self, x, w, bias=None):
        if w.dtype != torch.uint8:
            return super().linear(x, w, bias)
        g = self.groups_of(w)
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        if (
            self._int4_linear is not None
            and x.dim() == 2
            and x.is_cpu
            and w.is_cpu
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and w.is_contiguous()
            and (self.deterministic or x.shape[0] <= self.kernel_max_rows or self.gemm_min_rows > 0)
        ):
            return self._int4_linear(x, w, g.scale, g.zero, g.group, bias, self.int4_q8, self.deterministic)
        return self._widened_linear(x, w, g, bias)

    def _widened_linear(self, x: torch.Tensor, w: torch.Tensor, g: Int4Groups, bias) -> torch.Tensor:
        """``x @ W^T (+ bias)`` through torch's float32 GEMM, ``W`` widened in blocks of rows; the sums rounded
        once to ``x``'s dtype. With the C++ build the rows are widened there, else in torch (any device)."""
        xf = x.float()
        o = w.shape[0]
        y = torch.empty(*x.shape[:-1], o, dtype=torch.float32, device=x.device)
        for o0 in range(0, o, _DEQUANT_BLOCK):
            o1 = min(o, o0 + _DEQUANT_BLOCK)
            if self._int4_dequant is not None and w.is_cpu and w.is_contiguous():
                wf = self._int4_dequant(w, g.scale, g.zero, g.group, o0, o1)
            else:
                wf = dequantize(w[o0:o1], g.rows(slice(o0, o1)))
            if self.deterministic and x.dim() == 2:  # one row per GEMM: the same sums in any batch
                y[:, o0:o1] = torch.cat([F.linear(xf[i : i + 1], wf) for i in range(x.shape[0])])
            else:
                y[..., o0:o1] = F.linear(xf, wf)
        if bias is not None:
            y.add_(bias.float())
        return y.to(x.dtype)
