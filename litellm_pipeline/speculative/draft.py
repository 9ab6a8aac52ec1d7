"""``draft`` proposer: a separate small checkpoint with the same vocabulary drafts greedily.

It keeps its own paged KV cache (its own block pool, as many blocks as the engine's unless ``num_blocks`` says
otherwise) and per request the tokens whose K/V it holds; after verification the positions that match the
request's tokens stay valid, the rest are recomputed. A request it has no room for simply does not draft."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from litellm_pipeline import registry
from litellm_pipeline.engine.block_pool import BlockPool
from litellm_pipeline.engine.request import Request
from litellm_pipeline.engine.runtime import allocate_kv_cache
from litellm_pipeline.model.loader import load_model, load_model_config
from litellm_pipeline.registry import register
from litellm_pipeline.registry.types import AttentionMetadata, SeqAttention
from litellm_pipeline.stages.decode import FUSED_ROWS_MAX, row_table
from litellm_pipeline.text.tokenizer import Tokenizer


@dataclass
class _Seq:
    """The draft model's KV of one request: its blocks and the tokens at the positions they hold."""

    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


@register("proposer", "draft")
class DraftProposer:
    """``model``: the draft checkpoint (``speculative.model``); ``num_blocks``: its KV blocks (None: the engine's)."""


    def __init__(self, rt, model: str | None = None, num_blocks: int | None = None):
        if model is None:
            raise ValueError("speculative.model: the draft proposer needs the path of a checkpoint that shares the "
                             "model's vocabulary (speculative.model=PATH)")
        cfg = load_model_config(model)
        tok = Tokenizer.from_dir(model)
        if cfg.vocab_size != rt.model_cfg.vocab_size or tok.vocab_size != rt.tokenizer.vocab_size:
            raise ValueError(f"speculative.model {model}: its vocabulary ({cfg.vocab_size} ids, tokenizer "
                             f"{tok.vocab_size}) is not the model's ({rt.model_cfg.vocab_size}, "
                             f"{rt.tokenizer.vocab_size})")
        target = rt.model
        attn = target.layers[0].self_attn.attn_fn
        moe = [layer.mlp.dispatch_fn for layer in target.layers if layer.is_moe]
        dispatch = moe[0] if moe else registry.get("moe_dispatch", "fused")
        dtype = target.embed_tokens.dtype
        self.model = load_model(model, dtype=dtype, device=rt.device, cfg=cfg, attn_fn=attn, dispatch_fn=dispatch)
        self.model.rotary.reserve(rt.max_model_len)
        self.model.bind(attn, dispatch, type(target.ops)() if target.ops is not None else None)
        self.bs = rt.block_size
        self.pool = BlockPool(num_blocks or rt.pool.num_blocks)
        self.kv = allocate_kv_cache(cfg, self.pool.num_blocks, self.bs, dtype, rt.device)
        self.device = rt.device
        self.eos = set(rt.eos_token_ids)
        self.deterministic = rt.deterministic
        self._offsets = torch.arange(self.bs)
        self._seqs: dict[int, tuple[Request, _Seq]] = {}

    def release(self, req: Request) -> None:
        got = self._seqs.pop(id(req), None)
        if got is not None:
            self.pool.free(got[1].blocks)

    def _seq(self, req: Request, need: int) -> _Seq | None:
        """The request's draft KV, grown to ``need`` positions (None: no room; it then drafts nothing)."""
        got = self._seqs.get(id(req))
        if got is None or got[0] is not req:
            got = self._seqs[id(req)] = (req, _Seq())
        s = got[1]
        more = -(-need // self.bs) - len(s.blocks)
        if more > 0:
            if not self.pool.can_allocate(more):
                return None
            s.blocks += self.pool.allocate(more)
        return s

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        seqs, feeds = [], []
        for r, k in zip(reqs, ks):
            known = r.num_tokens
            s = self._seq(r, known + k)
            if s is None:
                seqs.append(None)
                continue
            valid = 0  # positions whose K/V were computed for the request's tokens as they are now
            n = min(len(s.tokens), known - 1)
            toks = s.tokens
            while valid < n and toks[valid] == r.token_at(valid, valid + 1)[0]:
                valid += 1
            del toks[valid:]
            new = r.token_at(valid, known)  # what it has not computed, up to the last known token
            toks.extend(new)
            seqs.append(s)
            feeds.append((s, new, valid))
        drafts: dict[int, list[int]] = {}
        # drafting stops at an end-of-sequence or stop token
        stops = {id(s): (self.eos | set(r.params.stop_token_ids)) if not r.params.ignore_eos
                 else set(r.params.stop_token_ids) for r, s in zip(reqs, seqs) if s is not None}
        if feeds:
            firsts = self._run(feeds)
            live = [(s, [t]) for (s, _, _), t in zip(feeds, firsts)]
            for s, d in live:
                drafts[id(s)] = d
            kmax = {id(s): k for s, k in zip(seqs, ks) if s is not None}
            for j in range(1, max(kmax.values())):
                step = [(s, d) for s, d in live if len(d) < kmax[id(s)] and d[-1] not in stops[id(s)]]
                if not step:
                    break
                outs = self._run([(s, [d[-1]], len(s.tokens)) for s, d in step])
                for (s, d), t in zip(step, outs):
                    s.tokens.append(d[-1])
                    d.append(t)
        out = []
        for s in seqs:
            d = drafts.get(id(s), []) if s is not None else []
            # a draft ends before an end-of-sequence or stop token: the row after it samples that token anyway
            cut = next((i for i, t in enumerate(d) if t in stops[id(s)]), len(d)) if d else 0
            out.append(d[:cut])
        return out

    def _slots(self, s: _Seq, n: int) -> torch.Tensor:
        pos = torch.arange(n)
        return torch.tensor(s.blocks, dtype=torch.long)[pos // self.bs] * self.bs + pos % self.bs

    @torch.inference_mode()
    def _run(self, feeds: list[tuple[_Seq, list[int], int]]) -> list[int]:
        """Feed each sequence its new tokens from position ``start``; the argmax after each one's last. More rows
        than the fused kernels take go in pieces of that many (a small model computes them faster so than through
        the general path)."""
        if sum(len(new) for _, new, _ in feeds) <= FUSED_ROWS_MAX:
            return self._rows(feeds)
        out = []
        for s, new, start in feeds:
            while len(new) > FUSED_ROWS_MAX:
                self._rows([(s, new[:FUSED_ROWS_MAX], start)])
                new, start = new[FUSED_ROWS_MAX:], start + FUSED_ROWS_MAX
            out += self._rows([(s, new, start)])
        return out

    def _rows(self, feeds: list[tuple[_Seq, list[int], int]]) -> list[int]:
        ids, lens, parts, slot_rows, last = [], [], [], [], []
        for s, new, start in feeds:
            end = start + len(new)
            slots = self._slots(s, end)
            slot_rows.append(slots)
            ids += new
            lens += range(start + 1, end + 1)
            parts.append(slots.expand(len(new), -1))
            last.append(len(ids) - 1)
        m = self.model
        got = None
        if len(ids) <= FUSED_ROWS_MAX:  # every token a row of the fused decode kernels (see Decode._fused_rows)
            table = row_table(parts)
            got = m.decode_tokens(torch.tensor(ids), table, torch.tensor(lens), self.kv, None,
                                  logits=len(feeds) == len(ids))
        if got is not None:
            hidden_or_logits = got[0]
            if len(feeds) == len(ids):
                return hidden_or_logits.argmax(-1).tolist()
            return m.compute_logits(hidden_or_logits[torch.tensor(last)]).argmax(-1).tolist()
        # the general path: every sequence's new tokens as one chunk
        seqs, slot_map, positions, q = [], [], [], 0
        for (s, new, start), slots in zip(feeds, slot_rows):
            end = start + len(new)
            seqs.append(SeqAttention(q, len(new), end, slots.to(self.device)))
            slot_map.append(slots[start:end])
            positions.append(torch.arange(start, end))
            q += len(new)
        meta = AttentionMetadata(torch.cat(slot_map).to(self.device), torch.cat(positions).to(self.device), seqs,
                                 batch_invariant=self.deterministic)
        hidden = m(torch.tensor(ids, device=self.device), meta, self.kv, None,
                   torch.tensor(lens, device=self.device) if m.dynamic_rope else None)
        logits = m.compute_logits(hidden[torch.tensor(last, device=hidden.device)])
        return logits.argmax(-1).tolist()
