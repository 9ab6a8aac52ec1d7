"""Deterministic routing: stable ties, and a token's experts do not depend on what else is in the batch."""

from __future__ import annotations

import torch

from litellm_pipeline.model.moe import route_tokens
from litellm_pipeline.registry.types import RoutePlan


def test_ties_go_to_the_lower_expert_id():
    logits = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 2.0, 2.0, 2.0], [3.0, 3.0, 3.0, 3.0]])
    idx, w = route_tokens(logits, 2, True, None)
    assert idx.tolist() == [[0, 1], [1, 2], [0, 1]]
    assert torch.allclose(w, torch.full_like(w, 0.5))


def test_a_tokens_experts_are_the_same_alone_and_in_any_batch():
    g = torch.Generator().manual_seed(0)
    mine = torch.randint(-2, 3, (3, 8), generator=g).float()  # small integers: many exact ties
    for k in (1, 2, 4):
        alone_idx, alone_w = route_tokens(mine, 2, True, RoutePlan(max_k=k))
        for seed in range(5):
            gg = torch.Generator().manual_seed(seed)
            others = torch.randint(-2, 3, (6, 8), generator=gg).float()
            pos = seed % 7
            batch = torch.cat([others[:pos], mine, others[pos:]])
            ks = torch.randint(1, 9, (batch.shape[0],), generator=gg)
            ks[pos : pos + 3] = k
            idx, w = route_tokens(batch, 2, True, RoutePlan(top_k=ks, max_k=int(ks.max())))
            rows = slice(pos, pos + 3)
            assert torch.equal(idx[rows, :k], alone_idx[:, :k])
            assert bool((idx[rows, k:] == -1).all())
            assert torch.equal(w[rows, :k], alone_w[:, :k])
