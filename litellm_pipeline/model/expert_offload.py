"""Expert offload: at most ``moe.hot_experts`` experts of each MoE layer in device memory, the rest in host memory,
with the next layer's experts predicted from router scores and prefetched while the current layer runs.

Layout. Every MoE layer keeps all its expert weights in host memory (pinned on CUDA, so copies are asynchronous
DMA) and ``capacity`` device *slots* (``w13 [capacity, 2I, H]``, ``w2 [capacity, H, I]``). An
:class:`ExpertStore` maps expert -> slot, evicts the least recently used expert that the current step does not
need, and counts what happened to every expert a step used:

* **hit** — resident before the layer asked for it (kept from earlier steps);
* **prefetch hit** — brought in by the prediction made one layer earlier (the copy overlapped the previous layer);
* **miss** — loaded when the layer asked for it: the layer's missing experts are all requested at once, then used
  in expert order, so the first copies overlap nothing and the later ones overlap the earlier experts' compute.

Prediction. While layer ``l`` runs, layer ``l+1``'s router is applied to layer ``l``'s MoE input (hidden states
change little from one layer to the next, so this ranks the next layer's experts well): each token's top-k
experts, ranked by the probability mass the batch puts on them, are prefetched into the next store as far as its
free and evictable slots allow (never evicting what the next layer's own last step kept hot beyond capacity). The
first MoE layer of a step is not predicted (its input is the new token's embedding).

Arithmetic. The offloaded block runs the ``packed`` dispatch's arithmetic exactly (same grouping, same order,
the bound layer ops), only reading each expert's weights from its slot, so tokens are identical to running the
model with every expert resident. With more distinct experts in a step than slots, experts are loaded in turn
(an expert the step still needs is never evicted while another is free to go; if all are needed, the one needed
last goes first).

Copies. :class:`SyncCopier` copies at once (CPU devices; offload there saves no memory and exists so the
bookkeeping runs anywhere). :class:`CudaCopier` copies on a side stream: it waits for an event recorded on the
compute stream when the slot was freed (kernels still reading the evicted expert finish first), and the compute
stream waits on the copy's event before the expert is used; no host synchronisation either way. Tests substitute a
copier that defers copies to check that nothing is used before it arrived.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F


@dataclass
class OffloadStats:
    """Counts over every MoE layer since the engine started (or :meth:`ExpertOffload.reset_stats`)."""

    hits: int = 0
    prefetch_hits: int = 0
    misses: int = 0
    prefetched: int = 0  # prefetch copies started
    prefetch_unused: int = 0  # prefetched experts evicted before any step used them
    # host time spent loading and waiting for missed experts: the copies themselves with the CPU copier; on CUDA
    # only the launches and the waits the host sees (the copies are stream-ordered: the bench's step times show them)
    miss_seconds: float = 0.0

    @property
    def used(self) -> int:
        return self.hits + self.prefetch_hits + self.misses

    @property
    def hit_rate(self) -> float:
        """Share of expert uses found on the device (resident or prefetched in time)."""
        return (self.hits + self.prefetch_hits) / self.used if self.used else 1.0

    def as_dict(self) -> dict[str, float]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["hit_rate"] = self.hit_rate
        return d


class SyncCopier:
    """Copies at once on the current stream; ``ready`` is always true."""

    def start(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> Any:
        dst.copy_(src)
        return None

    def wait(self, handle: Any) -> None:
        return None

    def freed(self) -> Any:
        return None


class CudaCopier:
    """Host -> device copies on a side stream, ordered against the compute stream with events."""

    def __init__(self, device: torch.device):
        self.side = torch.cuda.Stream(device=device)

    def freed(self) -> Any:
        """An event on the compute stream: kernels queued so far (readers of an evicted slot) come before it."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream())
        return ev

    def start(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> Any:
        with torch.cuda.stream(self.side):
            if after is not None:
                self.side.wait_event(after)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.side)
        return done

    def wait(self, handle: Any) -> None:
        if handle is not None:
            torch.cuda.current_stream().wait_event(handle)


class ExpertStore:
    """One MoE layer's experts: all in host memory, ``capacity`` of them in device slots."""

    def __init__(self, w13_host: torch.Tensor, w2_host: torch.Tensor, capacity: int, device: torch.device,
                 copier: Any, stats: OffloadStats):
        num_experts = w13_host.shape[0]
        if not 1 <= capacity <= num_experts:
            raise ValueError(f"capacity must be in 1..{num_experts} (got {capacity})")
        self.w13_host, self.w2_host = w13_host, w2_host
        self.num_experts, self.capacity = num_experts, capacity
        self.w13 = torch.empty((capacity, *w13_host.shape[1:]), dtype=w13_host.dtype, device=device)
        self.w2 = torch.empty((capacity, *w2_host.shape[1:]), dtype=w2_host.dtype, device=device)
        self.copier, self.stats = copier, stats
        self.slot_of: dict[int, int] = {}
        self.free = list(range(capacity - 1, -1, -1))  # pop() takes slot 0 first
        self.lru: OrderedDict[int, None] = OrderedDict()  # resident experts, least recently used first
        self.pending: dict[int, Any] = {}  # expert -> copy handle not waited on yet
        self.predicted: set[int] = set()  # resident by prediction, not used by a step yet

    # -- bookkeeping ------------------------------------------------------------------------------------------
    def resident(self) -> list[int]:
        return sorted(self.slot_of)

    def _take_slot(self, keep: set[int], later: list[int] | None = None) -> int | None:
        """A free slot, else the slot of the least recently used expert outside ``keep``; with every resident
        expert kept, the one ``later`` (a step's remaining experts, in use order) needs last, or None."""
        if self.free:
            return self.free.pop()
        victim = next((e for e in self.lru if e not in keep), None)
        if victim is None and later:
            victim = max((e for e in self.lru), key=later.index)
        if victim is None:
            return None
        self._evict(victim)
        return self.free.pop()

    def _evict(self, e: int) -> None:
        slot = self.slot_of.pop(e)
        self.lru.pop(e)
        handle = self.pending.pop(e, None)
        if handle is not None:
            self.copier.wait(handle)  # its copy must land before the slot is rewritten
        if e in self.predicted:
            self.predicted.discard(e)
            self.stats.prefetch_unused += 1
        self.free.append(slot)

    def _load(self, e: int, slot: int) -> Any:
        after = self.copier.freed()
        self.copier.start(self.w13[slot], self.w13_host[e], after)
        handle = self.copier.start(self.w2[slot], self.w2_host[e], after)  # same stream: done after both
        self.slot_of[e] = slot
        self.lru[e] = None
        return handle

    # -- what the model calls ---------------------------------------------------------------------------------
    def prefetch(self, ranked: Iterable[int], limit: int | None = None) -> int:
        """Start copies for the best-ranked experts that are not resident, into free slots or over least recently
        used experts; stops at ``limit`` experts (default: the capacity). Returns the copies started."""
        ranked = list(ranked)[: self.capacity if limit is None else min(limit, self.capacity)]
        keep = {e for e in ranked if e in self.slot_of}
        started = 0
        for e in ranked:
            if e in self.slot_of:
                continue
            slot = self._take_slot(keep)
            if slot is None:
                break
            self.pending[e] = self._load(e, slot)
            self.predicted.add(e)
            keep.add(e)
            started += 1
        self.stats.prefetched += started
        return started

    def begin_step(self, needed: list[int]) -> None:
        """Count the layer's experts (in use order) and request every missing one that fits now."""
        for e in needed:
            if e in self.predicted:
                self.stats.prefetch_hits += 1
            elif e in self.slot_of:
                self.stats.hits += 1
            else:
                self.stats.misses += 1
        keep = {e for e in needed if e in self.slot_of}
        t0 = time.perf_counter()
        for e in needed:
            if e in self.slot_of:
                continue
            slot = self._take_slot(keep)
            if slot is None:
                break  # every slot holds an expert this step still needs: loaded in turn by ``slot``
            self.pending[e] = self._load(e, slot)
            keep.add(e)
        self.stats.miss_seconds += time.perf_counter() - t0

    def slot(self, e: int, later: list[int]) -> int:
        """The device slot holding expert ``e`` now (loading it if it is still out), marked recently used."""
        if e not in self.slot_of:
            t0 = time.perf_counter()
            s = self._take_slot(set(later), later)
            assert s is not None
            self.copier.wait(self._load(e, s))
            self.stats.miss_seconds += time.perf_counter() - t0
        else:
            handle = self.pending.pop(e, None)
            if handle is not None:
                t0 = time.perf_counter()
                self.copier.wait(handle)
                if e not in self.predicted:
                    self.stats.miss_seconds += time.perf_counter() - t0
        self.predicted.discard(e)
        self.lru.move_to_end(e)
        return self.slot_of[e]

    def weights(self, e: int, later: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.slot(e, later)
        return self.w13[s], self.w2[s]


def predict_experts(x: torch.Tensor, gate: torch.Tensor, k: int, linear: Callable) -> list[int]:
    """Experts ranked by the probability mass the batch's tokens put on them within each token's top-``k`` under
    ``gate`` (the next layer's router): what to prefetch."""
    if x.shape[0] == 0:
        return []
    probs = F.softmax(linear(x, gate), dim=-1, dtype=torch.float32)
    top, idx = probs.topk(min(k, probs.shape[-1]), dim=-1)
    mass = torch.zeros(probs.shape[-1], dtype=torch.float32, device=probs.device).index_add_(
        0, idx.reshape(-1), top.reshape(-1)
    )
    order = torch.argsort(mass, descending=True, stable=True)
    return order[: int((mass > 0).sum())].tolist()


class ExpertOffload:
    """The stores of every MoE layer of a model, the prediction that links them, and the counts."""

    def __init__(self, model: Any, hot_experts: int, prefetch: bool = True, copier: Any = None):
        from litellm_pipeline.model.layers import SparseMoE

        device = model.embed_tokens.device
        self.copier = copier if copier is not None else (CudaCopier(device) if device.type == "cuda" else SyncCopier())
        self.stats_ = OffloadStats()
        self.prefetch = prefetch
        moe = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
        if not moe:
            raise ValueError("moe.hot_experts: the model has no MoE layers")
        num_experts = moe[0].w13.shape[0]
        if not 1 <= hot_experts <= num_experts:
            raise ValueError(f"moe.hot_experts: must be in 1..{num_experts}, the model's experts per layer "
                             f"(got {hot_experts})")
        self.hot_experts = hot_experts
        self.stores = []
        for i, block in enumerate(moe):
            w13, w2 = _to_host(block.w13, device), _to_host(block.w2, device)
            block.w13 = torch.nn.Parameter(w13, requires_grad=False)
            block.w2 = torch.nn.Parameter(w2, requires_grad=False)
            store = ExpertStore(w13, w2, hot_experts, device, self.copier, self.stats_)
            block.offload = store
            block.next_moe = moe[i + 1] if prefetch and i + 1 < len(moe) else None
            self.stores.append(store)
        model.expert_offload = self
        # warm start: the first experts of each layer, so nothing is empty at the first step
        for store in self.stores:
            store.prefetch(range(hot_experts))
            for e in list(store.pending):
                store.copier.wait(store.pending.pop(e))
            store.predicted.clear()
        self.reset_stats()

    def stats(self) -> OffloadStats:
        return self.stats_

    def reset_stats(self) -> None:
        for f in fields(OffloadStats):
            setattr(self.stats_, f.name, f.default)

    def device_bytes(self) -> int:
        return sum(s.w13.numel() * s.w13.element_size() + s.w2.numel() * s.w2.element_size() for s in self.stores)


def _to_host(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host memory for an expert tensor: pinned when the model runs on CUDA (asynchronous copies need it)."""
    t = p.detach().to("cpu")
    return t.pin_memory() if device.type == "cuda" else t


def offloaded_experts(store: ExpertStore, x: torch.Tensor, expert_idx: torch.Tensor, expert_w: torch.Tensor,
                      ops: Any) -> torch.Tensor:
    """The ``packed`` dispatch over an :class:`ExpertStore`: same grouping and order, weights from device slots."""
    from litellm_pipeline.model.moe import packed_experts

    flat = expert_idx.reshape(-1)
    counts = torch.bincount(flat + 1, minlength=store.num_experts + 1).tolist()
    needed = [e for e in range(store.num_experts) if counts[e + 1]]
    store.begin_step(needed)
    later = list(needed)

    def weights(e: int):
        later.remove(e)
        return store.weights(e, [e, *later])

    return packed_experts(x, expert_idx, expert_w, counts, weights, ops)
