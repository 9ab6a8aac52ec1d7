"""``tier`` proposer: MoE self-speculation. The request's own model drafts at a cheaper tier (fewer experts per
token, so fewer expert weights read per token) and the request's tier verifies: no extra weights, no second
tokenizer, no KV of its own (the draft writes its K/V into the slots verification then overwrites)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Sequence

import torch

from litellm_pipeline import registry
from litellm_pipeline.engine.request import Request
from litellm_pipeline.registry import register
from litellm_pipeline.registry.types import AttentionMetadata


@register("proposer", "tier")
class TierProposer:
    """``tier``: the configured tier that drafts (default ``fast``). A request whose own tier costs no more than it
    does not speculate (the draft would cost what verification does)."""


    def __init__(self, rt, tier: str = "fast", router: str = "tierset"):
        if not rt.model_cfg.is_moe:
            raise ValueError("speculative.method=tier needs a Mixture-of-Experts model (a dense model's tiers all "
                             "compute the same thing); use ngram or draft")
        if tier not in rt.tiers:
            raise ValueError(f"speculative.params.tier: {tier!r} is not a configured tier ({', '.join(rt.tiers)})")
        self.rt = rt
        self.tierset = rt.tiers[tier]
        self.draft_price = self.tierset.price  # the drafts' work at list price (CostRecord.speculation_monetary)
        self.router = registry.get("router", router)(rt.model_cfg, rt.device)
        self._row = SimpleNamespace(tierset=self.tierset)  # what the router reads of a request
        self._plans: dict[int, object] = {}

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        """Placeholders of each draft's length: the tokens are drafted by :meth:`fill` over the grown KV."""
        cost = self.tierset.cost
        return [r.token_at(r.num_computed, r.num_computed + 1) * k
                if r.tierset is not None and r.tierset.cost > cost else [] for r, k in zip(reqs, ks)]

    @torch.inference_mode()
    def fill(self, reqs: Sequence[Request]) -> None:
        """Draft every request's tokens greedily at the draft tier, one batched decode forward per position. A
        draft ends before an end-of-sequence or stop token: the row after the draft samples it if the request's
        tier agrees, so verifying it as a draft token would only cost a row."""
        rt = self.rt
        starts = [r.num_computed for r in reqs]
        table = rt.kv.slot_table([r.block_ids for r in reqs], [s + len(r.draft) for r, s in zip(reqs, starts)])
        tokens = [r.token_at(s, s + 1)[0] for r, s in zip(reqs, starts)]
        stops = [rt.eos_token_ids | set(r.params.stop_token_ids) if not r.params.ignore_eos
                 else set(r.params.stop_token_ids) for r in reqs]
        live = list(range(len(reqs)))
        for j in range(max(len(r.draft) for r in reqs)):
            live = [i for i in live if len(reqs[i].draft) > j]
            if not live:
                break
            whole = len(live) == len(reqs)
            slots = table if whole else table[torch.tensor(live)]
            lens = torch.tensor([starts[i] + j + 1 for i in live])
            out = self._forward(torch.tensor([tokens[i] for i in live]), slots, lens, len(live))
            for i, t in zip(live, out):
                draft = reqs[i].draft
                if t in stops[i]:
                    del draft[j:]  # shorter now: the next position leaves it out
                    continue
                draft[j] = t
                tokens[i] = t

    def _forward(self, ids: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, b: int) -> list[int]:
        rt = self.rt
        plan = self._plans.get(b)
        if plan is None:  # the same for every step of b rows
            plan = self._plans[b] = self.router.plan([(self._row, 1)] * b)
        got = rt.model.decode_tokens(ids, slots, lens, rt.kv_caches, plan, logits=True, argmax=True)
        if got is not None and got[1] is not None:
            return got[1].tolist()
        if got is not None:
            return got[0].argmax(-1).tolist()
        dev = rt.device
        rows = torch.arange(b)
        new = slots[rows, lens - 1]
        meta = AttentionMetadata(
            slot_mapping=new.to(dev), positions=(lens - 1).to(dev), prefills=[],
            batch_invariant=rt.deterministic, decode_rows=rows.to(dev), decode_kv_slots=slots.to(dev),
            decode_ctx_lens=lens.to(dev),
        )
        rope = lens.to(dev) if rt.model.dynamic_rope else None
        hidden = rt.model(ids.to(dev), meta, rt.kv_caches, plan, rope)
        return rt.model.compute_logits(hidden).argmax(-1).tolist()
