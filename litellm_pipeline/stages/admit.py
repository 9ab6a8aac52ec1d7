"""admit: validate a request against the model and the cache, give it its generator and detokenizer, enqueue."""

from __future__ import annotations

import torch

from litellm_pipeline.engine.scheduler import blocks_for
from litellm_pipeline.registry import register
from litellm_pipeline.stages.base import RequestContext, Stage
from litellm_pipeline.tokenizer import IncrementalDetokenizer


class AdmissionError(ValueError):
    """A request the engine can never run; nothing of it was enqueued."""


@register("stage", "admit")
class Admit(Stage):
    level = "request"
    inputs = ("request",)
    outputs = ("admitted",)

    def __call__(self, ctx: RequestContext) -> None:
        rt, req = self.rt, ctx.request
        n = len(req.prompt_ids)
        if n == 0:
            raise AdmissionError("prompt is empty: it must hold at least one token")
        vocab = rt.model_cfg.vocab_size
        bad = [t for t in req.prompt_ids if not (0 <= t < vocab)]
        if bad:
            raise AdmissionError(f"prompt token ids outside the vocabulary [0, {vocab}): {bad[:8]}")
        if n >= rt.max_model_len:
            raise AdmissionError(
                f"prompt is {n} tokens but the model's context is {rt.max_model_len} tokens "
                "(the prompt must leave room for at least one generated token)"
            )
        total = min(n + req.params.max_tokens, rt.max_model_len)
        need = blocks_for(total, rt.block_size)
        if need > rt.pool.num_blocks:
            raise AdmissionError(
                f"request needs {need} KV blocks ({n} prompt + up to {total - n} output tokens) but the cache "
                f"holds {rt.pool.num_blocks}; raise cache.num_blocks or lower max_tokens"
            )
        p = req.params
        if p.temperature > 0:
            seed = p.seed if p.seed is not None else self._rng_seed()
            req.generator = torch.Generator(device="cpu").manual_seed(seed)
        req.detokenizer = IncrementalDetokenizer(rt.tokenizer, req.prompt_ids, p.skip_special_tokens)
        if p.logprobs is not None:
            req.logprobs = []
        rt.scheduler.add(req)
        ctx.admitted = True

    def _rng_seed(self) -> int:
        # unseeded requests draw from the engine's own generator: a run is reproducible from cfg.seed
        if not hasattr(self, "_rng"):
            self._rng = torch.Generator().manual_seed(self.rt.seed)
        return int(torch.randint(0, 2**62, (1,), generator=self._rng))
