"""decode: one token for every generating request, packed with the step's prefill chunks into one forward.

A single forward per step reads the weights once for decodes and prompt chunks alike; this stage owns it
and hands the logits of every request that reaches the end of its known tokens this step to ``sample``: one
row each, and for a request verifying a speculative draft one row per drafted position and one after them.
It only reads request state: advancing computed tokens and committing KV blocks is the engine's
postprocess.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch

from litellm_pipeline import registry
from litellm_pipeline.model.attention_cpu import kernel as cpu_paged_kernel
from litellm_pipeline.model.attention_cpu import kernel_error
from litellm_pipeline.model.cuda_graphs import CudaGraphBackend, decode_graphs
from litellm_pipeline.registry import register
from litellm_pipeline.registry.types import AttentionMetadata
from litellm_pipeline.stages.base import Stage, StepContext

# the most rows a step may have to go through the fused decode kernels as rows (see Decode._fused_rows); the kernels
# refuse what they cannot take themselves (then the step takes the general path)
FUSED_ROWS_MAX = 32


@register("stage", "decode")
class Decode(Stage):
    inputs = ("schedule", "kv_layout", "prefill_batch", "route_plan")
    outputs = ("logits", "sample_requests", "logits_argmax")

    def __init__(self, rt, attention: str = "sdpa", moe_dispatch: str = "packed", layer_ops: str = "torch",
                 layer_ops_params: dict | None = None):
        super().__init__(rt)
        self.batch_invariant = rt.deterministic
        ops_cls = registry.get("layer_ops", layer_ops)
        if layer_ops_params is not None and not isinstance(layer_ops_params, Mapping):
            raise ValueError(f"layer_ops_params must be a mapping of the layer ops' constructor arguments, e.g. "
                             f"{{lm_head: true}} (got {type(layer_ops_params).__name__} {layer_ops_params!r})")
        params = dict(layer_ops_params or {})
        _check_ops_params(layer_ops, ops_cls, params)
        if rt.deterministic:
            _check_invariant(rt, attention, layer_ops, ops_cls)
            ops = ops_cls(deterministic=True, **params)
        else:
            ops = ops_cls(**params)
        rt.model.bind(registry.get("attention", attention), registry.get("moe_dispatch", moe_dispatch), ops,
                      huge_pages=rt.huge_pages)
        # decode-only steps through captured CUDA graphs (device.cuda_graphs on a GPU; see model/cuda_graphs.py)
        self.graphs = decode_graphs(rt, CudaGraphBackend(rt.device)) if rt.cuda_graphs else None
        # whether to hand the sample stage each row's argmax with the logits (the model's fused decode computes
        # it while the logits are in cache): set by the builder where the stage right after this one reads
        # logits_argmax, so no stage between them can have changed the logits
        self.argmax = False

    def __call__(self, ctx: StepContext) -> None:
        rt, pb, kv = self.rt, ctx.prefill_batch, ctx.kv_layout
        dev = rt.device
        decodes = ctx.schedule[len(pb.requests) :]
        ctx.logits_argmax = None
        if decodes and not pb.requests and self.graphs is None and self._decode_only(ctx, decodes):
            return
        if pb.requests and self.graphs is None and self._fused_rows(ctx, len(pb.requests)):
            return
        ids = list(pb.token_ids)
        positions, slots, rope_lens = list(pb.positions), list(pb.slots), list(pb.rope_seq_lens)
        meta_kw = {}
        if decodes:
            for r, _ in decodes:
                ids.append(r.token_at(r.num_computed, r.num_computed + 1)[0])
            lens_t = kv.decode_ctx_lens
            positions.append(lens_t - 1)
            slots.append(kv.decode_new_slots)
            rope_lens.extend(r.num_computed + 1 for r, _ in decodes)
            meta_kw = dict(
                decode_rows=torch.arange(pb.num_tokens, pb.num_tokens + len(decodes), device=dev),
                decode_kv_slots=kv.decode_slots.to(dev),
                decode_ctx_lens=lens_t.to(dev),
            )
        for s in pb.seqs:
            s.kv_slots = s.kv_slots.to(dev)
        meta = AttentionMetadata(
            slot_mapping=_joined(slots).to(dev),
            positions=_joined(positions).to(dev),
            prefills=pb.seqs,
            batch_invariant=self.batch_invariant,
            **meta_kw,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        rope_seq_lens = torch.tensor(rope_lens, device=dev) if rt.model.dynamic_rope else None
        rows, reqs, row = [], [], 0
        for req, n in ctx.schedule:
            row += n
            if req.num_computed + n == req.num_scheduled_tokens:  # catches up: its next token is sampled now
                if req.draft:  # and every drafted position's, to verify the draft
                    rows.extend(range(row - 1 - len(req.draft), row))
                else:
                    rows.append(row - 1)
                reqs.append(req)
        ctx.sample_requests = reqs
        every_row = bool(rows) and len(rows) == len(ids)  # a decode-only step: no gather
        hidden = self.graphs.run(input_ids, meta, ctx.route_plan) if self.graphs is not None else None
        if hidden is None and every_row:  # the model's fused decode path may run the LM head with the layers
            ctx.logits = rt.model(input_ids, meta, rt.kv_caches, ctx.route_plan, rope_seq_lens, logits=True)
            return
        if hidden is None:
            hidden = rt.model(input_ids, meta, rt.kv_caches, ctx.route_plan, rope_seq_lens)
        if every_row:
            ctx.logits = rt.model.compute_logits(hidden)
        else:
            ctx.logits = rt.model.compute_logits(hidden[torch.tensor(rows, device=dev)]) if rows else None

    def _decode_only(self, ctx: StepContext, decodes: list) -> bool:
        """A step of decodes alone straight from its tokens, where the model's fused decode takes it: no
        metadata tensors built (see ``CausalLM.decode_tokens``). False where it does not (then the general path)."""
        rt, kv = self.rt, ctx.kv_layout
        if any(r.num_computed + 1 != r.num_tokens for r, _ in decodes):
            return False  # a prompt's one-token chunk that does not reach its end: not every row samples
        ids = torch.tensor([r.token_at(r.num_computed, r.num_computed + 1)[0] for r, _ in decodes])
        got = rt.model.decode_tokens(ids, kv.decode_slots, kv.decode_ctx_lens, rt.kv_caches, ctx.route_plan,
                                     logits=True, argmax=self.argmax)
        if got is None:
            return False
        ctx.sample_requests = [r for r, _ in decodes]
        ctx.logits, ctx.logits_argmax = got
        return True


    def _fused_rows(self, ctx: StepContext, num_chunks: int) -> bool:
        """A step with multi-token entries (speculative drafts beside decodes, or a prompt chunk alone) through the
        model's fused decode where its kernels take that many rows: each token is a row of its own that attends its
        sequence's context up to its position (the kernel writes every row's K/V before any row attends when rows of
        one sequence follow each other), so a short chunk costs what a decode step of that many rows does, not a
        framework forward.
        False where it does not apply (then the general path). Not in batch-invariant mode: which path an entry
        takes would depend on what shares its step."""
        if self.batch_invariant:
            return False
        rt, kv, sched = self.rt, ctx.kv_layout, ctx.schedule
        if len(sched) > 1 and any(not r.draft for r, _ in sched[:num_chunks]):
            return False  # prompt chunks beside other work: the general path batches them better (measured)
        decodes = sched[num_chunks:]
        if any(r.num_computed + 1 != r.num_tokens for r, _ in decodes):
            return False  # a prompt's one-token chunk that does not reach its end
        ids, lens, parts, rows, reqs = [], [], [], [], []
        at = 0
        for (r, n), slots in zip(sched[:num_chunks], kv.chunk_slots):
            ids += r.token_at(r.num_computed, r.num_computed + n)
            lens += range(r.num_computed + 1, r.num_computed + n + 1)
            parts.append(slots.expand(n, -1))
            at += n
            if r.num_computed + n == r.num_scheduled_tokens:  # catches up: its last row (and a draft's) samples
                rows += range(at - 1 - len(r.draft), at)
                reqs.append(r)
        if len(ids) + len(decodes) > FUSED_ROWS_MAX:
            return False
        if decodes:
            ids += [r.token_at(r.num_computed, r.num_computed + 1)[0] for r, _ in decodes]
            lens += kv.decode_ctx_lens.tolist()
            parts.append(kv.decode_slots)
            rows += range(at, at + len(decodes))
            reqs += [r for r, _ in decodes]
        table = row_table(parts)
        every = len(rows) == len(ids)
        got = rt.model.decode_tokens(torch.tensor(ids), table, torch.tensor(lens), rt.kv_caches, ctx.route_plan,
                                     logits=every)
        if got is None:
            return False
        ctx.sample_requests = reqs
        if every:
            ctx.logits = got[0]
        else:
            ctx.logits = rt.model.compute_logits(got[0][torch.tensor(rows)]) if rows else None
        return True


def row_table(parts: list[torch.Tensor]) -> torch.Tensor:
    """``[rows, Lmax]`` slot table of the fused kernels from blocks of rows of any width (padded with slot 0,
    never read past each row's context length)."""
    if len(parts) == 1:
        return parts[0].contiguous()
    lmax = max(p.shape[1] for p in parts)
    return torch.cat([p if p.shape[1] == lmax else torch.nn.functional.pad(p, (0, lmax - p.shape[1])) for p in parts])


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``, without the copy when there is one part (a decode-only or prefill-only step)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _check_ops_params(layer_ops: str, ops_cls, params: dict) -> None:
    """``layer_ops_params`` must name parameters the layer ops' constructor takes (``deterministic`` is the
    engine's to set)."""
    if "deterministic" in params:
        raise ValueError("pipeline.stages.decode.params.layer_ops_params: 'deterministic' is set by engine.deterministic")
    if not params:
        return
    try:
        inspect.signature(ops_cls).bind(**params)
    except TypeError as exc:
        sig = inspect.signature(ops_cls)
        takes = [n for n in sig.parameters if n != "deterministic"]
        raise ValueError(
            f"pipeline.stages.decode.params.layer_ops_params {sorted(params)}: layer_ops {layer_ops!r} takes "
            f"{takes or 'no parameters'} ({exc})"
        ) from None


def _check_invariant(rt, attention: str, layer_ops: str, ops_cls) -> None:
    """``engine.deterministic`` needs an attention that computes every query row alone and layer ops that take
    ``deterministic=True``; say which part does not, instead of running a batch-dependent engine."""
    if attention != "cpu_paged" or rt.device.type != "cpu":
        raise ValueError(
            f"engine.deterministic: true needs attention 'cpu_paged' on a CPU device (got attention {attention!r} "
            f"on {rt.device.type}): its kernel computes each query row alone, so results do not depend on the batch"
        )
    if cpu_paged_kernel() is None:
        raise ValueError(f"engine.deterministic: true needs the cpu_paged C++ kernel, which is unavailable ({kernel_error()})")
    try:
        inspect.signature(ops_cls).bind(deterministic=True)
    except TypeError:
        raise ValueError(
            f"engine.deterministic: true: layer_ops {layer_ops!r} has no batch-invariant mode (its constructor takes "
            "no 'deterministic' argument)"
        ) from None
