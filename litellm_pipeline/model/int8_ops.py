"""Int8 weight-only layer ops (registry kind ``layer_ops``, name ``cpu_int8``).

Select with ``pipeline.stages.decode.params.layer_ops=cpu_int8``. When the decode stage binds these ops,
``prepare_weights`` quantizes every projection weight of the model in place:

* attention ``qkv_proj`` and ``o_proj``, dense MLP ``gate_up_proj`` / ``down_proj``, MoE experts ``w13`` / ``w2``
  (one scale per row of each expert) and shared experts;
* the LM head only with ``lm_head=True`` (``pipeline.stages.decode.params.layer_ops_params={lm_head: true}``;
  with tied embeddings the head gets its own int8 copy and the embedding lookup keeps the float table);
* never the embeddings, the router ``gate``, the shared-expert gate, norms or biases.

Quantization is symmetric per output channel: ``scale = max|w_row| / 127``, ``q = round(w / scale)`` clamped to
[-127, 127] and stored as int8 (a quarter of float32's bytes, half of bfloat16's), so ``|w - q * scale| <=
scale / 2``. The float32 scales live in a table keyed by the weight's storage address and shape (each expert's
slice ``w13[e]`` is registered too: the ``packed`` MoE dispatch passes those slices to ``linear``).

``linear(x, w, bias)`` with an int8 ``w`` runs ``int8_linear`` (``csrc/int8_linear.cpp``): ``(x @ q^T) * scale
(+ bias)`` with float32 accumulation of the exactly widened operands, the sum scaled and rounded once to ``x``'s
dtype. Every output is one whole-K dot product whose order does not depend on the other rows, so the kernel is
batch-invariant: with ``deterministic=True`` (``engine.deterministic``) every ``linear`` runs it whatever the row
count. Otherwise steps with more than ``INT8_KERNEL_MAX_ROWS`` rows (prefill) widen the weights to float32 in
blocks of rows and use torch's GEMM (same sums, another summation order): measured faster there (see below).
Anything else (float weights, another device, no C++ build) goes to ``cpu_fused`` / the torch reference.

The fused whole-layer C++ paths of ``cpu_fused`` (``decode_attention``, ``decode_layers``, ``moe_experts``,
``residual_mlp``) take the int8 weights with their scales (``weight_scale``) and run the same two paths in C++
(the kernel up to ``INT8_KERNEL_MAX_ROWS`` rows, else widened + GEMM), so a decode step is one C++ call as with
float weights. Expert offload (``moe.hot_experts``) copies float expert weights between devices and is refused.

``activations: int8`` (``layer_ops_params={activations: int8}``; default ``float``) makes steps of more than
``INT8_KERNEL_MAX_ROWS`` rows (prefill, large batches) quantize each row of activations to int8 (one scale per
token, ``max|x| / 127``) and multiply through torch's int8 x int8 GEMM (exact int32 sums; VNNI / AMX where the CPU
has them) instead of widening the weights: several times the float32 GEMM's speed, at the cost of rounding the
activations (measured in the tests and docs/quantization.md). Decode-size steps keep exact activations (they are
bound by memory, not arithmetic). Not with ``engine.deterministic`` (a row's arithmetic would depend on its
step's size).

Accuracy: the demo model's greedy tokens and logprobs drift from the float32 run by the quantization error; see
``tests/model/test_int8_ops.py`` for the measured bounds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from litellm_pipeline.model.layer_ops import CpuFusedLayerOps, TorchLayerOps
from litellm_pipeline.registry import register

QMAX = 127
# Most rows for which (deterministic=False) the int8 kernel runs; above, widen-and-GEMM. Measured on a 2-core AMD
# EPYC (AVX2), 1 thread, 768x2304 and 3072x768 weights: the kernel is 1.5-6x faster than the widened GEMM at 1-16
# rows (and faster than torch's float32 GEMM on float32 weights), about even at 64, and the GEMM is even to 1.3x
# faster from 128 rows on (bfloat16 activations: from 64).
INT8_KERNEL_MAX_ROWS = 64
# output rows widened to float32 at a time on the many-row path (bounds its temporary to ~this x K x 4 bytes)
_DEQUANT_BLOCK = 1024


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of ``w [..., O, K]``: ``(q int8 [..., O, K], scale float32 [..., O])`` with
    ``scale = max|row| / 127`` (1 for an all-zero row) and ``q = round(w / scale)`` in [-127, 127]."""
    wf = w.detach().float()
    amax = wf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(wf / scale.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale.contiguous()


def dequant_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``(x @ q^T) * scale (+ bias)`` through torch's float32 GEMM, the weights widened in blocks of rows (exact);
    the sums scaled and rounded once to ``x``'s dtype. Any device."""
    xf = x.float()
    o = q.shape[0]
    y = torch.empty(*x.shape[:-1], o, dtype=torch.float32, device=x.device)
    for o0 in range(0, o, _DEQUANT_BLOCK):
        o1 = min(o, o0 + _DEQUANT_BLOCK)
        y[..., o0:o1] = F.linear(xf, q[o0:o1].float())
    y.mul_(scale)
    if bias is not None:
        y.add_(bias.float())
    return y.to(x.dtype)


def int8_gemm_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ (q * scale)^T (+ bias)`` with x quantized per row (token): ``sx = max|x_row| / 127``, ``xq =
    round(x / sx)``; the int8 x int8 products summed exactly in int32 (torch's integer GEMM: VNNI / AMX where the
    CPU has them), then ``* sx * scale (+ bias)`` in float32, rounded once to x's dtype. A row's result depends on
    that row alone."""
    xf = x.float()
    sx = xf.abs().amax(dim=-1, keepdim=True) / QMAX
    xq = torch.round(xf / torch.where(sx > 0, sx, torch.ones_like(sx))).clamp_(-QMAX, QMAX).to(torch.int8)
    y = torch._int_mm(xq, q.t()).float().mul_(sx).mul_(scale)
    if bias is not None:
        y.add_(bias.float())
    return y.to(x.dtype)


def _key(w: torch.Tensor) -> tuple:
    # the storage address alone is ambiguous: w13 and its slice w13[0] start at the same byte
    return (w.data_ptr(), tuple(w.shape), w.device)


@register("layer_ops", "cpu_int8")
class Int8LayerOps(CpuFusedLayerOps):
    """Int8 weight-only projections (per-output-channel scales) on the C++ kernel; ``cpu_fused`` for the rest.

    ``deterministic=True`` runs every int8 ``linear`` through the kernel (a row's result is the same in any batch;
    the kernel is per-row, so it is batch-invariant at any row count).
    """

    def __init__(self, deterministic: bool = False, lm_head: bool = False, activations: str = "float"):
        if activations not in ("float", "int8"):
            raise ValueError(f"layer_ops {self.NAME}: activations must be int8 or float, got {activations!r}")
        if activations == "int8" and deterministic and self.INT8_GEMM:
            raise ValueError("layer_ops cpu_int8: activations int8 quantizes the activations of steps over "
                             f"{INT8_KERNEL_MAX_ROWS} rows only, so a row's result would depend on its batch; "
                             "engine.deterministic needs activations: float")
        super().__init__(deterministic)
        self.lm_head = bool(lm_head)
        # steps of more rows than the kernel takes: activations quantized per token, int8 x int8 GEMM
        self.int8_gemm = activations == "int8" and self.INT8_GEMM
        self._scales: dict[tuple, torch.Tensor] = {}
        self._int8_linear = None
        if self._ok:
            ns = torch.ops.litellm_pipeline_cpu
            self._int8_linear = ns.int8_linear.default

    # -- weights --------------------------------------------------------------------------------------------

    # the dtype quantized weights have, the module attribute their scales live in, the ops' registry name, and
    # whether `activations: int8` means the int8 x int8 GEMM for steps over the kernel's rows
    QDTYPE = torch.int8
    STATE = "int8_scales"
    NAME = "cpu_int8"
    INT8_GEMM = True

    def prepare_weights(self, model) -> None:
        """Quantize the model's projection weights in place (see the module doc) and register their scales."""
        from litellm_pipeline.model.layers import Attention, GatedMLP, SparseMoE

        offload = getattr(model, "expert_offload", None)
        if offload is not None or any(getattr(m, "offload", None) is not None for m in model.modules()
                                      if isinstance(m, SparseMoE)):
            raise ValueError(
                f"layer_ops {self.NAME} does not support expert offload (moe.hot_experts): the offloaded experts are "
                "copied as float weights; unset moe.hot_experts or use another layer_ops"
            )
        todo = []
        for m in model.modules():
            if isinstance(m, Attention):
                names = ("qkv_proj", "o_proj")
            elif isinstance(m, GatedMLP):  # dense MLPs and MoE shared experts
                names = ("gate_up_proj", "down_proj")
            elif isinstance(m, SparseMoE):  # experts only: the router gate and shared-expert gate stay float
                names = ("w13", "w2")
            else:
                continue
            todo.extend((m, name) for name in names)
        for m, name in todo:  # every weight checked before one is changed
            self._check(getattr(m, name), f"{type(m).__name__}.{name}")
        with torch.no_grad():
            for m, name in todo:
                scales = m.__dict__.setdefault(self.STATE, {})  # kept on the module: a later bind finds them
                w = getattr(m, name)
                if w.dtype != self.QDTYPE:
                    q, scale = self._quantize(w)
                    setattr(m, name, nn.Parameter(q, requires_grad=False))
                    scales[name] = scale
                elif name not in scales:
                    raise ValueError(
                        f"{type(m).__name__}.{name} is {self.QDTYPE} but has no scales (quantized elsewhere?)")
                self._register(getattr(m, name), scales[name])
            head = model.lm_head
            if self.lm_head or (head is not None and head.dtype == self.QDTYPE):  # a later bind reads it so too
                self._prepare_head(model)

    def _check(self, w: torch.Tensor, name: str) -> None:
        """Raise a ValueError naming ``name`` where ``w`` cannot be quantized (every weight can be as int8)."""

    def _prepare_head(self, model) -> None:
        """The LM head quantized (its own copy when tied to the embeddings, which keep the float table)."""
        scales = model.__dict__.setdefault(self.STATE, {})
        head = model.lm_head
        if head is None or head.dtype != self.QDTYPE:
            w = model.embed_tokens if head is None else head
            self._check(w, "lm_head")
            q, scale = self._quantize(w)
            if head is None:
                del model.lm_head  # a plain None attribute for a tied model: becomes a parameter of its own
            model.lm_head = nn.Parameter(q, requires_grad=False)
            scales["lm_head"] = scale
        elif "lm_head" not in scales:
            raise ValueError(f"the LM head is {self.QDTYPE} but has no scales (quantized elsewhere?)")
        self._register(model.lm_head, scales["lm_head"])

    def weights_moved(self, model) -> None:
        """The weights moved (``CausalLM.bind`` packed them into huge pages): register the scales at the new
        addresses (the stale ones could name a later tensor at a reused address)."""
        self._scales.clear()
        self.prepare_weights(model)

    @staticmethod
    def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row by row in blocks (or expert by expert): the float32 temporaries stay small for big weights."""
        q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
        scale = torch.empty(w.shape[:-1], dtype=torch.float32, device=w.device)
        flat_w, flat_q, flat_s = w.reshape(-1, w.shape[-1]), q.view(-1, w.shape[-1]), scale.view(-1)
        for r0 in range(0, flat_w.shape[0], 4096):
            r1 = min(flat_w.shape[0], r0 + 4096)
            flat_q[r0:r1], flat_s[r0:r1] = quantize_rows(flat_w[r0:r1])
        return q, scale

    def _register(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        self._scales[_key(q)] = scale
        if q.dim() == 3:  # [E, O, K] experts: the packed dispatch passes each expert's [O, K] slice
            for e in range(q.shape[0]):
                self._scales[_key(q[e])] = scale[e]

    def weight_scale(self, w: torch.Tensor) -> torch.Tensor | None:
        return self._scales.get(_key(w)) if w.dtype == torch.int8 else None

    def scale_of(self, w: torch.Tensor) -> torch.Tensor:
        """The float32 [O] scales of a quantized weight (or expert slice) this instance prepared."""
        s = self._scales.get(_key(w))
        if s is None:
            raise KeyError(
                f"layer_ops {self.NAME}: {w.dtype} weight {tuple(w.shape)} has no registered scales (not quantized by "
                "prepare_weights of these ops)"
            )
        return s

    # -- ops ------------------------------------------------------------------------------------------------

    def linear(self, x, w, bias=None):
        if w.dtype != torch.int8:
            return super().linear(x, w, bias)
        scale = self.scale_of(w)
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        if (
            self._int8_linear is not None
            and x.dim() == 2
            and x.is_cpu
            and w.is_cpu
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and w.is_contiguous()
            and (self.deterministic or x.shape[0] <= INT8_KERNEL_MAX_ROWS)
        ):
            return self._int8_linear(x, w, scale, bias)
        if self.deterministic and x.dim() == 2 and x.shape[0] > 1:  # one row per GEMM: the same sums in any batch
            return torch.cat([dequant_linear(x[i : i + 1], w, scale, bias) for i in range(x.shape[0])])
        if self.int8_gemm and x.dim() == 2 and x.is_cpu and w.is_cpu:
            return int8_gemm_linear(x, w, scale, bias)
        return dequant_linear(x, w, scale, bias)

    def _many(self, x: torch.Tensor) -> bool:
        """Whether a step of x's rows takes the int8 GEMM (``activations: int8``), which only ``linear`` runs."""
        return self.int8_gemm and x.shape[0] > INT8_KERNEL_MAX_ROWS

    def moe_experts(self, x, expert_idx, expert_w, w13, w2):
        return None if self._many(x) else super().moe_experts(x, expert_idx, expert_w, w13, w2)

    def residual_mlp(self, h, x, mlp):
        if self._many(x):  # through linear
            return TorchLayerOps.residual_mlp(self, h, x, mlp)
        return super().residual_mlp(h, x, mlp)
