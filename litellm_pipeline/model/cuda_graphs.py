"""CUDA graphs for decode steps: the model's forward for a decode-only step, captured once per (batch bucket,
context bucket) and replayed, so a decode step costs one graph launch instead of hundreds of kernel launches.

A decode-only step (every scheduled request adds one token, native routing) is padded to the smallest captured
batch size that holds it (1, 2, 4, 8, 16, 24, 32, 48, 64, ... up to ``engine.max_num_seqs``) and its slot table
to the smallest context bucket that holds its longest sequence (powers of two from 64 up to the model's
``max_model_len``, rounded to whole KV blocks). Inputs are copied into the bucket's static tensors (token ids,
positions, the slot each new K/V goes to, the slot table and context lengths); padding rows compute a token at
position 0 that attends to, and writes its K/V into, one *scratch slot* past the pool's blocks (the hot KV cache
has one spare block for it), so they never touch a request's cache. The replayed graph writes the hidden states
into a static output whose first rows are the step's.

Only steps the captured graph computes exactly as eager are replayed: decode-only, ``route_plan`` None (a MoE
step with per-request tiers runs eagerly), no dynamic RoPE, within the largest buckets. A graph whose capture
fails (some op synchronises with the host, e.g. a MoE dispatch that counts tokens per expert on the host) turns
graphs off for the engine with one warning, and the step runs eagerly: the result never depends on whether a
graph ran beyond the rounding a batch padded to the bucket size may change (as with any batch size change).

The capture backend is a parameter: :class:`CudaGraphBackend` on a GPU; tests on a CPU use a backend that
"replays" by calling the captured function again on the same static tensors, which checks everything but the
capture itself (bucketing, padding, the scratch slot, the copies in and out).
"""

from __future__ import annotations

import bisect
import warnings
from typing import Any, Callable

import torch

from litellm_pipeline.registry.types import AttentionMetadata

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
MIN_CONTEXT_BUCKET = 64


def batch_buckets(max_num_seqs: int) -> list[int]:
    out = [b for b in BATCH_BUCKETS if b < max_num_seqs]
    return [*out, max_num_seqs]


def context_buckets(max_model_len: int, block_size: int) -> list[int]:
    """Slot-table widths: powers of two from 64, each rounded up to whole blocks, the last holding max_model_len."""
    top = -(-max_model_len // block_size) * block_size
    out, n = [], MIN_CONTEXT_BUCKET
    while n < top:
        out.append(-(-n // block_size) * block_size)
        n *= 2
    out.append(top)
    return sorted(set(out))


class CudaGraphBackend:
    """Real CUDA graphs; every graph shares one memory pool (buckets never run at once)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up outside the graph (lazy inits, autotuning)
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph.replay, out


class Bucket:
    """Static inputs and the captured graph of one (batch size, context width)."""

    def __init__(self, batch: int, width: int, scratch: int, device: torch.device):
        self.batch, self.width = batch, width
        self.input_ids = torch.zeros(batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((batch,), scratch, dtype=torch.long, device=device)
        self.kv_slots = torch.full((batch, width), scratch, dtype=torch.long, device=device)
        self.ctx_lens = torch.ones(batch, dtype=torch.long, device=device)
        self.rows = torch.arange(batch, device=device)
        self.replay: Callable[[], None] | None = None
        self.out: torch.Tensor | None = None

    def meta(self) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping, positions=self.positions, prefills=[], decode_rows=self.rows,
            decode_kv_slots=self.kv_slots, decode_ctx_lens=self.ctx_lens,
        )


class DecodeGraphs:
    """Captures and replays the decode forward of ``model`` per bucket; :meth:`run` returns None to decline."""

    def __init__(self, model: Any, kv_caches: list, max_num_seqs: int, max_model_len: int, block_size: int,
                 scratch_slot: int, backend: Any):
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.batches = batch_buckets(max_num_seqs)
        self.widths = context_buckets(max_model_len, block_size)
        self.scratch = scratch_slot
        self.device = kv_caches[0][0].device
        self.buckets: dict[tuple[int, int], Bucket] = {}
        # dynamic RoPE syncs with the host per step; offloaded experts decide on the host which slots to use
        self.enabled = not model.dynamic_rope and getattr(model, "expert_offload", None) is None
        self.replays = 0
        self.error: str | None = None

    def _bucket(self, b: int, width: int) -> tuple[int, int] | None:
        i, j = bisect.bisect_left(self.batches, b), bisect.bisect_left(self.widths, width)
        if i == len(self.batches) or j == len(self.widths):
            return None
        return self.batches[i], self.widths[j]

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata, plan: Any) -> torch.Tensor | None:
        """The hidden states ``[B, H]`` of a decode-only step from a replayed graph, or None (run it eagerly)."""
        if not self.enabled or plan is not None or not meta.decode_only:
            return None
        b = input_ids.shape[0]
        key = self._bucket(b, meta.decode_kv_slots.shape[1])
        if key is None:
            return None
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = Bucket(*key, self.scratch, self.device)
            try:
                bucket.replay, bucket.out = self.backend.capture(self._forward(bucket))
            except Exception as exc:  # e.g. a host sync inside the forward: graphs cannot hold this model
                self.enabled, self.error = False, f"{type(exc).__name__}: {exc}"
                warnings.warn(f"CUDA graphs turned off: capturing a decode step failed ({self.error}); decode "
                              "steps run eagerly", RuntimeWarning, stacklevel=2)
                return None
            self.buckets[key] = bucket
        self._fill(bucket, input_ids, meta)
        bucket.replay()
        self.replays += 1
        return bucket.out[:b]

    def _forward(self, bucket: Bucket) -> Callable[[], torch.Tensor]:
        meta = bucket.meta()

        def fn() -> torch.Tensor:
            meta._decode_masks.clear()  # the mask is recomputed from the static tensors inside the graph
            return self.model(bucket.input_ids, meta, self.kv_caches, None, None)

        return fn

    def _fill(self, bucket: Bucket, input_ids: torch.Tensor, meta: AttentionMetadata) -> None:
        b, width = input_ids.shape[0], meta.decode_kv_slots.shape[1]
        bucket.input_ids[:b].copy_(input_ids)
        bucket.input_ids[b:].zero_()
        bucket.positions[:b].copy_(meta.positions)
        bucket.positions[b:].zero_()
        bucket.slot_mapping[:b].copy_(meta.slot_mapping)
        bucket.slot_mapping[b:].fill_(self.scratch)
        bucket.kv_slots.fill_(self.scratch)
        bucket.kv_slots[:b, :width].copy_(meta.decode_kv_slots)
        bucket.ctx_lens[:b].copy_(meta.decode_ctx_lens)
        bucket.ctx_lens[b:].fill_(1)


def decode_graphs(rt: Any, backend: Any) -> DecodeGraphs:
    """The runner for an engine's runtime: buckets up to its sequence limit and context length, the scratch slots
    in the hot KV cache's spare block (past the pool's ``num_blocks``)."""
    scratch = rt.pool.num_blocks * rt.block_size
    rows = rt.kv_caches[0][0].shape[0]
    if rows <= scratch:
        raise ValueError(f"CUDA graphs need a spare KV block past the pool's {rt.pool.num_blocks} (the cache has "
                         f"{rows // rt.block_size})")
    return DecodeGraphs(rt.model, rt.kv_caches, rt.scheduler.max_num_seqs, rt.max_model_len, rt.block_size,
                        scratch, backend)
