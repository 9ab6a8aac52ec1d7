"""Layer ops (registry kind ``layer_ops``): the dense projections and small per-layer steps of the decoder.

A ``layer_ops`` entry is a class; the ``decode`` stage instantiates the configured one and binds it to every
layer of the model. Its methods:

* ``linear(x, w, bias=None)`` — ``x [M, K] @ w[O, K]^T (+ bias)``
* ``rms_norm(x, w, eps)`` — RMSNorm over the last dim (float32 statistics)
* ``add_rms_norm(x, residual, w, eps)`` — ``(s, rms_norm(s))`` with ``s = x + residual``
* ``silu_mul(gate_up)`` — ``silu(gate) * up`` of a stacked ``[..., 2I]`` projection
* ``rotary(q, k, cos, sin)`` — RoPE of ``q [T, Hq, D]`` and ``k [T, Hk, D]``; may rotate them in place
* ``residual_mlp(h, x, mlp)`` — ``h + mlp(x)`` for a dense ``GatedMLP``
* ``route(x, gate, native_k, normalize, plan)`` — a MoE router: ``(expert_idx, expert_w)``
* optionally ``decode_attention(layer, h, cos, sin, meta, k_cache, v_cache)`` — a layer's whole attention half
  for a decode-only step, or None (then it runs op by op); used only with ``cpu_paged`` attention
* optionally ``decode_layers(model, h, cos, sin, meta, kv_caches, plan, logits=False)`` — all layers of a
  decode-only step in one call, or None (then layer by layer); with ``logits=True`` the final norm and LM head too,
  returning float32 logits ``[T, V]`` as ``model.compute_logits`` would
* optionally ``moe_experts(x, expert_idx, expert_w, w13, w2)`` — a whole MoE expert block, or None (then the
  ``fused`` MoE dispatch runs ``packed`` with these ops)

Both built-ins take ``deterministic=True`` (``engine.deterministic``, the batch-invariant mode): every row of a
``linear`` then gets exactly the arithmetic it gets alone, whatever else shares the step, so a request's tokens
and logprobs never depend on its batch. The rest of the per-layer math is row-wise already.

``torch`` is the reference (plain torch ops, transformers' order of operations). ``cpu_fused`` runs the same
math through the C++ kernels of ``csrc/layer_ops.cpp``: each elementwise step is one pass instead of 5-20 torch
ops, and ``linear`` with few rows (decode) uses a kernel that streams the weights once at memory speed where
the BLAS GEMM is tuned for many rows. Anything the kernels do not cover (another device or dtype, more rows)
goes to the torch version, so results never depend on which path ran beyond float rounding order.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from litellm_pipeline.errors import ConfigError
from litellm_pipeline.model import cpu_kernels
from litellm_pipeline.model.attention import kv_cache_supported
from litellm_pipeline.model.moe import route_tokens
from litellm_pipeline.model.rope import apply_rotary
from litellm_pipeline.registry import register
from litellm_pipeline.registry.types import RoutePlan


def row_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` one row at a time: each row's GEMM has the same shape whatever the batch (batch-invariant)."""
    if x.dim() != 2 or x.shape[0] <= 1:
        return F.linear(x, w, bias)
    return torch.cat([F.linear(x[i : i + 1], w, bias) for i in range(x.shape[0])])


@register("layer_ops", "torch")
class TorchLayerOps:
    """Reference implementation: plain torch ops."""

    def __init__(self, deterministic: bool = False):
        self.deterministic = deterministic

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return row_linear(x, w, bias) if self.deterministic else F.linear(x, w, bias)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        # float32 statistics, then back to the input dtype before the weight (as the reference models do)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return w * xf.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float):
        s = x + residual
        return s, self.rms_norm(s, w, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return apply_rotary(q, k, cos, sin)

    def residual_mlp(self, h: torch.Tensor, x: torch.Tensor, mlp) -> torch.Tensor:
        """``h + mlp(x)`` for a dense ``GatedMLP``."""
        return h + mlp(x)

    def route(self, x: torch.Tensor, gate: torch.Tensor, native_k: int, normalize: bool, plan: RoutePlan | None):
        """A MoE block's router: ``(expert_idx, expert_w)`` [T, K] (see ``moe.route_tokens``)."""
        return route_tokens(self.linear(x, gate), native_k, normalize, plan)


# Most rows for which the small-M linear kernel runs, per dtype, on a CPU with native 16-bit products. Measured
# against torch's GEMM (MKL / oneDNN) on 768x2304, 768x4096 and 2048x768 weights with 2 threads: float32 is
# 1.05-1.25x faster at 1-3 rows, 1.5-2.2x at 4-8, 1.1-1.5x at 16, about even at 32-64 and slower beyond.
# bfloat16 (vdpbf16ps products, against torch on AMX tiles; 2304x768, 4096x768, 768x2048 and 32000x768 weights on
# a 2-core Xeon, Sapphire Rapids) 1.5-3.7x faster at 1-2 rows, 1.3-1.6x at 3, 1.1-1.3x at 4, 0.6-0.7x at 8;
# float16 (widened in registers, against torch on AVX-512 FP16; same shapes and CPU) 1.5-2.3x faster at 1 row,
# 1.3-2.1x at 4, 1.0-1.4x at 8, 0.5-0.8x at 16.
SMALL_LINEAR_MAX_ROWS = {torch.float32: 32, torch.bfloat16: 4, torch.float16: 8}
# Without native 16-bit products (AVX2 CPUs, AVX-512 without BF16/FP16) torch's 16-bit GEMM is slow at every row
# count (on a 2-core AMD EPYC with AVX2: 1x at 1 row, 3-5x slower than float32 from 8 rows on). The kernel (16-bit
# weights widened in registers, half the bytes of float32) beats it everywhere and beats torch's float32 GEMM up to
# 32-64 rows (768x2304, 768x6144, 3072x768 weights); past this many rows the widened float32 GEMM
# (``upconvert_linear``: the weights widened per call) is as fast or faster on most shapes.
UPCONVERT_SMALL_ROWS = 64


def small_linear_limits(native_bf16: bool, native_fp16: bool) -> dict[torch.dtype, int]:
    """The kernel's row limits on this CPU: 16-bit dtypes without native products take it up to
    UPCONVERT_SMALL_ROWS rows (then the up-converted GEMM), with them the measured limits above."""
    limits = dict(SMALL_LINEAR_MAX_ROWS)
    if not native_bf16:
        limits[torch.bfloat16] = UPCONVERT_SMALL_ROWS
    if not native_fp16:
        limits[torch.float16] = UPCONVERT_SMALL_ROWS
    return limits


def upconvert_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A 16-bit linear as float32 on widened operands (exact), the sums rounded once to x's dtype: what a
    float32-accumulating 16-bit GEMM computes, at float32 GEMM speed where the CPU has no 16-bit products."""
    return F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(x.dtype)


_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@register("layer_ops", "cpu_fused")
class CpuFusedLayerOps(TorchLayerOps):
    """C++ kernels on CPU tensors; the torch reference for anything else (or when the kernels cannot build)."""

    def __init__(self, deterministic: bool = False):
        super().__init__(deterministic)
        # -1: every row through the row kernel (or one row per GEMM), the C++ ops' batch-invariant mode
        self.max_rows = dict.fromkeys(_FUSED_DTYPES, -1) if deterministic else dict(SMALL_LINEAR_MAX_ROWS)
        self._upconvert: tuple[torch.dtype, ...] = ()
        try:
            ns = cpu_kernels.ops()
        except ConfigError:  # a kernel build asked for that this CPU cannot run: said, not worked around
            raise
        except Exception as exc:  # no compiler, a failed build: run as the torch reference
            warnings.warn(
                f"layer_ops cpu_fused runs the torch ops: C++ kernels unavailable ({cpu_kernels.reason(exc)})",
                RuntimeWarning,
                stacklevel=2,
            )
            self._ok = False
            return
        self._ok = True
        native = {torch.bfloat16: ns.native_bf16_gemm(), torch.float16: ns.native_fp16_gemm()}
        self._upconvert = tuple(d for d, has in native.items() if not has)
        if not deterministic:
            self.max_rows = small_linear_limits(native[torch.bfloat16], native[torch.float16])
        self._small_linear = ns.small_linear.default if ns.small_linear_supported() else None
        if self._small_linear is not None and deterministic:
            self._small_linear = ns.row_linear.default  # the same per-row contract for any number of rows
        self._rms_norm = ns.rms_norm.default
        self._add_rms_norm = ns.add_rms_norm.default
        self._silu_mul = ns.silu_mul.default
        self._rotary = ns.rotary_.default
        self._moe_experts = ns.moe_experts.default
        self._decode_attention_block = ns.decode_attention_block.default
        self._residual_mlp = ns.residual_mlp.default
        self._moe_route = ns.moe_route.default
        self._decode_layers = ns.decode_layers.default
        self._decode_plan = torch.classes.litellm_pipeline_cpu.DecodePlan

    def _fits(self, x: torch.Tensor) -> bool:
        return self._ok and x.is_cpu and x.dtype in _FUSED_DTYPES

    def weight_scale(self, w: torch.Tensor) -> torch.Tensor | None:
        """The float32 per-row scales of a quantized weight these ops hold (``cpu_int8``); None for float weights."""
        return None

    def _takes(self, w: torch.Tensor, x: torch.Tensor) -> bool:
        """Whether the C++ kernels take weight ``w`` with activations ``x``: the same dtype, or int8 with scales."""
        return w.dtype == x.dtype or (w.dtype == torch.int8 and self.weight_scale(w) is not None)

    def linear(self, x, w, bias=None):
        limit = self.max_rows.get(x.dtype, 0)
        if (
            self._ok
            and self._small_linear is not None
            and x.dim() == 2
            and (x.shape[0] <= limit or limit < 0)
            and x.dtype in self.max_rows
            and x.is_cpu
            and x.dtype == w.dtype
            and (x.is_contiguous() or limit < 0)  # batch-invariant: a strided view still takes the row kernel
            and w.is_contiguous()
        ):
            return self._small_linear(x.contiguous(), w, bias)
        if x.dtype in self._upconvert and limit >= 0 and x.is_cpu and w.dtype == x.dtype:
            return upconvert_linear(x, w, bias)
        return super().linear(x, w, bias)

    def rms_norm(self, x, w, eps):
        if self._fits(x) and w.dtype == x.dtype:
            return self._rms_norm(x, w, eps)
        return super().rms_norm(x, w, eps)

    def add_rms_norm(self, x, residual, w, eps):
        if self._fits(x) and w.dtype == x.dtype and residual.dtype == x.dtype:
            return self._add_rms_norm(x, residual, w, eps)
        return super().add_rms_norm(x, residual, w, eps)

    def silu_mul(self, gate_up):
        if self._fits(gate_up):
            return self._silu_mul(gate_up)
        return super().silu_mul(gate_up)

    def rotary(self, q, k, cos, sin):
        if self._fits(q) and cos.dtype == q.dtype and sin.dtype == q.dtype and q.stride(-1) == 1 and k.stride(-1) == 1:
            self._rotary(q, k, cos, sin)
            return q, k
        return super().rotary(q, k, cos, sin)

    def moe_experts(self, x, expert_idx, expert_w, w13, w2):
        """All experts of a MoE block in one C++ call (see ``moe_dispatch: fused``); None where it does not apply."""
        if self._fits(x) and self._takes(w13, x) and w13.is_contiguous() and w2.is_contiguous():
            return self._moe_experts(x, expert_idx, expert_w, w13, w2, self.max_rows.get(x.dtype, 0),
                                     self.weight_scale(w13), self.weight_scale(w2))
        return None

    def residual_mlp(self, h, x, mlp):
        if self._fits(x) and h.dtype == x.dtype and self._takes(mlp.gate_up_proj, x):
            return self._residual_mlp(h, x, mlp.gate_up_proj, mlp.down_proj, self.max_rows.get(x.dtype, 0),
                                      self.weight_scale(mlp.gate_up_proj), self.weight_scale(mlp.down_proj))
        return super().residual_mlp(h, x, mlp)

    def decode_attention(self, layer, h, cos, sin, meta, k_cache, v_cache):
        """The attention half of ``layer`` in one C++ call for a decode-only step: ``(h + attn, post-norm)``.

        Only bound when the layer's attention is ``cpu_paged`` (the kernel it runs inside); None where the
        inputs are outside what the kernels take, and the layer then runs op by op.
        """
        attn = layer.self_attn
        if not (self._fits(h) and cos.dtype == h.dtype and kv_cache_supported(h.dtype, k_cache.dtype)
                and v_cache.dtype == k_cache.dtype and k_cache.is_contiguous()
                and self._takes(attn.qkv_proj, h) and self._takes(attn.o_proj, h)):
            return None
        qn, kn = attn.q_norm, attn.k_norm
        return self._decode_attention_block(
            h, layer.input_layernorm.weight, layer.input_layernorm.eps, attn.qkv_proj, attn.qkv_bias,
            None if qn is None else qn.weight, None if kn is None else kn.weight, 0.0 if qn is None else qn.eps,
            cos, sin, k_cache, v_cache, meta.slot_mapping, meta.decode_rows, meta.decode_kv_slots.contiguous(),
            meta.decode_ctx_lens, attn.scale, attn.sliding_window or 0, attn.o_proj, attn.o_bias,
            layer.post_attention_layernorm.weight, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            self.max_rows.get(h.dtype, 0), self.weight_scale(attn.qkv_proj), self.weight_scale(attn.o_proj),
        )

    def route(self, x, gate, native_k, normalize, plan):
        if self._fits(x) and gate.dtype == x.dtype:
            k = native_k if plan is None or plan.max_k is None else plan.max_k
            top_k = None if plan is None else plan.top_k
            allowed = None if plan is None else plan.allowed
            return self._moe_route(x, gate, k, normalize, self.max_rows.get(x.dtype, 0), top_k, allowed)
        return super().route(x, gate, native_k, normalize, plan)

    def decode_layers(self, model, h, cos, sin, meta, kv_caches, plan, logits=False):
        """Every layer of ``model`` for a decode-only step in one call, or None (then layer by layer); with
        ``logits`` the final norm and LM head too: float32 logits ``[T, V]``, what ``model.compute_logits`` gives.

        Bound by ``CausalLM.bind`` only where it computes what the per-layer path computes: ``cpu_paged``
        attention, and dense MLPs or MoE blocks under the ``fused`` dispatch without shared experts. ``plan`` is
        one ``RoutePlan`` for every layer or a tuple with one per layer (per-layer TierSets); its per-token
        limits go into the call, so steps that mix tiers stay on it.

        The weights, caches and shapes are checked once into a C++ ``DecodePlan`` (kept in
        ``model.decode_weights`` until the caches change); a step runs all its layers, and the LM head, in one
        parallel region there. Steps it does not take (more rows than its kernels take) run op by op in C++.
        """
        if not (self._fits(h) and cos.dtype == h.dtype):
            return None
        w = self._plan_weights(model, kv_caches, h)
        if w is None:
            return None
        moe_ks, top_ks, allowed = _layer_limits(w, plan)
        rows, kv_slots = meta.decode_rows, meta.decode_kv_slots.contiguous()
        out = w["plan"].run(h, cos, sin, meta.slot_mapping, rows, kv_slots, meta.decode_ctx_lens, moe_ks, top_ks,
                            allowed, logits)
        if out is not None:
            return out if not logits or w["plan_has_head"] else model.compute_logits(out)
        if w["plan_only"]:  # weights only the plan's kernels take (4-bit): layer by layer instead
            return None
        out = self._decode_layers(
            h, w["in_norm"], w["qkv_w"], w["qkv_b"], w["q_norm"], w["k_norm"], cos, sin, w["k_caches"], w["v_caches"],
            meta.slot_mapping, rows, kv_slots, meta.decode_ctx_lens, w["o_w"], w["o_b"], w["post_norm"], w["mlp_a"],
            w["mlp_b"], w["router"], w["windows"], w["eps"], w["qk_eps"], w["scale"], w["num_heads"],
            w["num_kv_heads"], w["head_dim"], moe_ks, top_ks, allowed, w["moe_normalize"],
            self.max_rows.get(h.dtype, 0), *w["scales"], False,
        )
        return model.compute_logits(out) if logits else out

    def decode_tokens(self, model, input_ids, embed, tables, kv_slots, ctx_lens, kv_caches, plan, logits=False,
                      argmax=False):
        """``decode_layers`` of a decode-only step from its tokens (see ``CausalLM.decode_tokens``): the C++ plan
        embeds them, takes their rows of the rotary ``tables`` (cos, sin) at ``ctx_lens - 1`` and their new K/V
        slots itself, so the step costs no framework call between the region and the tensors it is given.
        Returns ``(out, argmax or None)``, or None where the plan does not take the step."""
        if not (self._fits(embed) and input_ids.is_cpu):
            return None
        w = self._plan_weights(model, kv_caches, embed)
        if w is None:
            return None
        moe_ks, top_ks, allowed = _layer_limits(w, plan)
        head = logits and w["plan_has_head"]
        got = w["plan"].run_tokens(input_ids, embed, tables[0], tables[1], kv_slots, ctx_lens, moe_ks, top_ks,
                                   allowed, head, head and argmax)
        if not got:
            return None
        if logits and not head:
            return model.compute_logits(got[0]), None
        return got[0], (got[1] if len(got) > 1 else None)

    def _plan_weights(self, model, kv_caches, h: torch.Tensor) -> dict | None:
        """``model.decode_weights`` with its C++ DecodePlan for activations like ``h``, built on first use and
        kept until the caches change; None where the plan cannot take them (cache dtype, mixed weights)."""
        w = model.decode_weights
        if w.get("k_caches") is None or w["k_caches"][0] is not kv_caches[0][0]:  # checked once per cache set
            w["k_caches"] = [k for k, _ in kv_caches]
            w["v_caches"] = [v for _, v in kv_caches]
            dtypes = {k.dtype for k in w["k_caches"]}
            contiguous = all(k.is_contiguous() for k in w["k_caches"])
            w["cache_dtype"] = dtypes.pop() if len(dtypes) == 1 and contiguous else None
            w.pop("plan", None)
        if w["cache_dtype"] is None or not kv_cache_supported(h.dtype, w["cache_dtype"]):
            return None
        if "scales" not in w:  # quantized weights: their scales per list (empty lists for float weights)
            w["scales"] = self._scale_lists(w, h)
            w["plan_only"] = w["scales"] is not None and any(
                self.plan_only(t) for key in ("qkv_w", "o_w", "mlp_a", "mlp_b") for t in w[key])
        if w["scales"] is None:
            return None
        if "plan" not in w:
            w["plan"] = self._build_plan(model, w, h.dtype)
            w["plan_has_head"] = w["plan"].has_head()  # asked once, not every step
        return w

    def _build_plan(self, model, w: dict, dtype: torch.dtype):
        """The C++ DecodePlan of ``model``'s decode weights; with the final norm and LM head where the region
        can run the head as ``compute_logits`` would (the head in this dtype, or int8 with its scales)."""
        head = model.embed_tokens if model.lm_head is None else model.lm_head
        takes_head = head.dtype == dtype or (head.dtype != dtype and self.plan_scale(head) is not None)
        return self._decode_plan(
            w["in_norm"], w["qkv_w"], w["qkv_b"], w["q_norm"], w["k_norm"], w["k_caches"], w["v_caches"], w["o_w"],
            w["o_b"], w["post_norm"], w["mlp_a"], w["mlp_b"], w["router"], w["windows"], w["eps"], w["qk_eps"],
            w["scale"], w["num_heads"], w["num_kv_heads"], w["head_dim"], w["moe_k"], w["moe_normalize"],
            self.max_rows.get(dtype, 0), *w["scales"], model.norm.weight if takes_head else None, model.norm.eps,
            head if takes_head else None, self.plan_scale(head) if takes_head else None, self.int4_q8,
        )

    def plan_scale(self, w: torch.Tensor) -> torch.Tensor | None:
        """What the C++ decode plan takes with a quantized weight (``weight_scale`` unless the ops say more);
        None for float weights."""
        return self.weight_scale(w)

    def plan_only(self, w: torch.Tensor) -> bool:
        """Whether only the decode plan's kernels (not the other whole-layer C++ paths) take weight ``w``."""
        return False

    # whether the decode plan's 4-bit weights meet int8 activations (``cpu_int4``'s ``activations: int8``)
    int4_q8 = False

    def _scale_lists(self, w: dict, h: torch.Tensor) -> list[list[torch.Tensor]] | None:
        """``[qkv, o, mlp_a, mlp_b]`` scale lists for ``decode_layers``: empty for float weights, one per layer
        for int8 ones; None when a list mixes them or holds a weight the kernels do not take."""
        out = []
        for key in ("qkv_w", "o_w", "mlp_a", "mlp_b"):
            if not all(t.dtype == h.dtype or self.plan_scale(t) is not None for t in w[key]):
                return None
            scales = [self.plan_scale(t) for t in w[key]]
            if all(sc is None for sc in scales):
                out.append([])
            elif all(sc is not None for sc in scales):
                out.append(scales)
            else:
                return None
        return out


_NO_LIMIT = torch.empty(0, dtype=torch.long)


def _layer_limits(w: dict, plan) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
    """Per MoE layer: experts per token, per-token top-k and allowed experts (empty tensor: no limit) of ``plan``
    (one RoutePlan, a tuple of one per layer, or None); empty lists for a dense model or a step without limits."""
    if not w["router"]:
        return [], [], []
    n = len(w["router"])
    if plan is None:  # every step of a request without TierSet limits: the model's own k everywhere
        return [w["moe_k"]] * n, [], []
    plans = plan if isinstance(plan, tuple) else (plan,) * n
    ks = [w["moe_k"] if p is None or p.max_k is None else p.max_k for p in plans]
    top = [_NO_LIMIT if p is None or p.top_k is None else p.top_k for p in plans]
    allowed = [_NO_LIMIT if p is None or p.allowed is None else p.allowed for p in plans]
    return ks, (top if any(t.numel() for t in top) else []), (allowed if any(a.numel() for a in allowed) else [])
