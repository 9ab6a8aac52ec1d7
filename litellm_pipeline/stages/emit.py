"""emit: append sampled tokens, detokenize incrementally, apply stop rules, report deltas, free finished requests."""

from __future__ import annotations

import time

from litellm_pipeline.engine.request import Request, RequestOutput, RequestStatus
from litellm_pipeline.registry import register
from litellm_pipeline.stages.base import Stage, StepContext


def request_output(req: Request, delta_text: str = "", delta_ids: list[int] | None = None) -> RequestOutput:
    return RequestOutput(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_ids,
        text=req.text[: req.emitted_chars] if not req.finished else req.text,
        token_ids=list(req.output_ids),
        delta_text=delta_text,
        delta_token_ids=delta_ids or [],
        finished=req.finished,
        finish_reason=req.finish_reason,
        logprobs=req.logprobs,
        tier=req.tierset.name if req.tierset else None,
        num_cached_tokens=req.num_cached_tokens,
    )


@register("stage", "emit")
class Emit(Stage):
    inputs = ("samples",)
    outputs = ("outputs",)

    def __call__(self, ctx: StepContext) -> None:
        now = time.monotonic()
        for req, token, logprobs in ctx.samples:
            req.output_ids.append(token)
            if req.logprobs is not None:
                req.logprobs.append(logprobs)
            if req.first_token_time is None:
                req.first_token_time = now
            prev_len = len(req.text)
            req.text += req.detokenizer.add(token)
            reason = self._finish_reason(req, token, prev_len)
            if reason is not None:
                if reason == "length" or not req.params.stop:
                    req.text += req.detokenizer.flush()  # a character cut off by the end is still shown
                req.finish_reason = reason
                req.status = RequestStatus.FINISHED
                req.finish_time = now
                self.rt.scheduler.finish(req)
            ctx.outputs.append(self._delta(req))

    def _finish_reason(self, req: Request, token: int, prev_len: int) -> str | None:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.rt.eos_token_ids):
            return "stop"
        if p.stop:
            # only the tail that the new token can have completed needs searching
            start = max(0, prev_len - max(len(s) for s in p.stop) + 1)
            hits = [i for i in (req.text.find(s, start) for s in p.stop) if i >= 0]
            if hits:
                req.text = req.text[: min(hits)]
                return "stop"
        if len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.rt.max_model_len:
            return "length"
        return None

    def _delta(self, req: Request) -> RequestOutput:
        # hold back text that could still become the start of a stop string
        hold = 0 if req.finished or not req.params.stop else max(len(s) for s in req.params.stop) - 1
        upto = max(req.emitted_chars, len(req.text) - hold)
        delta = req.text[req.emitted_chars : upto]
        req.emitted_chars = upto
        ids = req.output_ids[req.emitted_tokens :]
        req.emitted_tokens = len(req.output_ids)
        return request_output(req, delta, ids)
