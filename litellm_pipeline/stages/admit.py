"""admit: check that the engine can ever run a request (prompt, vocabulary, context, KV pool), then that its
tenant's quotas allow it now (:mod:`litellm_pipeline.engine.tenants`: rate, tokens, concurrency, queue, spend).

A request-level stage only decides: it may reject (raise :class:`InvalidRequestError`) but it never
enqueues. The engine gives the request its generator and detokenizer and queues it only once every
request-level stage has passed, so a rejection leaves nothing behind. The quota check comes last, so a request
that is wrong in itself is refused (400) without using its tenant's quota; what the quotas take is a hold on the
request that the engine cancels if a later stage rejects it and settles when the request ends.
"""

from __future__ import annotations

from litellm_pipeline.engine.scheduler import blocks_for
from litellm_pipeline.engine.tenants import reserved_tokens
from litellm_pipeline.errors import InvalidRequestError
from litellm_pipeline.registry import register
from litellm_pipeline.stages.base import RequestContext, Stage


@register("stage", "admit")
class Admit(Stage):
    level = "request"
    inputs = ("request",)
    outputs = ("admitted",)

    def __call__(self, ctx: RequestContext) -> None:
        rt, req = self.rt, ctx.request
        n = len(req.prompt_ids)
        if n == 0:
            raise InvalidRequestError("prompt", "is empty: it must hold at least one token")
        vocab = rt.model_cfg.vocab_size
        bad = [t for t in req.prompt_ids if not (0 <= t < vocab)]
        if bad:
            raise InvalidRequestError("prompt", f"token ids outside the vocabulary [0, {vocab}): {bad[:8]}")
        if n >= rt.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"is {n} tokens but the model's context is {rt.max_model_len} tokens "
                "(the prompt must leave room for at least one generated token)",
            )
        total = reserved_tokens(n, req.params.max_tokens, rt.max_model_len)
        need = blocks_for(total, rt.block_size)
        if need > rt.pool.num_blocks:
            raise InvalidRequestError(
                "params.max_tokens",
                f"request needs {need} KV blocks ({n} prompt + up to {total - n} output tokens) but the cache "
                f"holds {rt.pool.num_blocks}; raise cache.num_blocks or lower max_tokens",
            )
        ledger = rt.tenants
        if ledger is not None:
            hold = ledger.reserve(req, total, rt.scheduler.load().waiting)
            if hold is not None:
                req.holds.append(hold)
        ctx.admitted = True
