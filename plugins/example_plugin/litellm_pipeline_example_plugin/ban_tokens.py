"""ban_tokens: a step-level logits processor that makes configured token ids impossible to sample.

Place it between ``decode`` (which produces ``logits``) and ``sample`` (which consumes them)::

    +pipeline.stages.ban={impl: ban_tokens, params: {token_ids: [5, 6]}}
    'pipeline.order=[admit,select_tier,route,prefill,decode,ban,sample,emit]'

The banned logits become ``-inf`` for every row, so greedy, temperature, top-k/p and min-p sampling all
skip them, and the logprobs the sampler reports for them are ``-inf``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from litellm_pipeline.stages.base import Stage, StepContext


class BanTokens(Stage):
    level = "step"
    inputs = ("logits", "sample_requests")
    outputs = ("logits",)

    def __init__(self, rt, token_ids: Sequence[int] = ()):
        super().__init__(rt)
        vocab = rt.model_cfg.vocab_size
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
            raise ValueError(f"token_ids: must be a list of token ids (got {token_ids!r})")
        bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token_ids: every id must be an integer in 0..{vocab - 1} (got {bad})")
        ids = sorted(set(token_ids))
        if len(ids) >= vocab:
            raise ValueError(f"token_ids: banning all {vocab} tokens would leave nothing to sample")
        # built once, on the logits' device: the per-step work is one index_fill_, no host sync
        self.token_ids = torch.tensor(ids, dtype=torch.long, device=rt.device)

    def __call__(self, ctx: StepContext) -> None:
        logits = ctx.logits
        if logits is None or self.token_ids.numel() == 0:  # no row is sampled this step
            return
        # out of place: decode's logits may be an inference-mode tensor, which cannot be edited in place
        # outside inference mode (and need not be the only reference to them)
        ctx.logits = logits.index_fill(1, self.token_ids, float("-inf"))
