"""emit: incremental detokenization, stop strings and the text each stream may show now.

For every sampled token the stage extends the request's text, decides whether the request should finish
(stop token, end of sequence, stop string, length) and produces an :class:`Emission`. It only proposes:
appending the token, finishing and freeing are the engine's postprocess, which also enforces the token
limits whatever an emit stage says.

Stages between sample and emit may put :class:`~litellm_pipeline.registry.interfaces.TextFilter` objects in
``ctx.text_filters``: emit runs them on each request's text after its own stop strings and holds back the
characters they may still change.
"""

from __future__ import annotations

from litellm_pipeline.engine.request import Emission, Request
from litellm_pipeline.registry import register
from litellm_pipeline.stages.base import Stage, StepContext


@register("stage", "emit")
class Emit(Stage):
    inputs = ("samples",)
    optional_inputs = ("text_filters",)
    outputs = ("emissions",)

    def __call__(self, ctx: StepContext) -> None:
        rt = self.rt
        filters = getattr(ctx, "text_filters", ())
        filter_hold = max((f.hold for f in filters), default=0)
        out = []
        ahead: dict[int, int] = {}  # a verified draft gives a request several samples: those before this one
        ended: set[int] = set()
        for req, token, _ in ctx.samples:
            key = id(req)
            if key in ended:
                continue  # what a draft holds past the token that ends the request is not shown
            n_ahead = ahead.get(key, 0)
            ahead[key] = n_ahead + 1
            prev_len = len(req.text)
            req.text += req.detokenizer.add(token)
            reason = req.stop_reason(token, rt.eos_token_ids, rt.max_model_len, n_ahead)
            if reason != "stop" and req.params.stop and self._stop_string(req, prev_len):
                reason = "stop"  # the text ends at the stop string: what the detokenizer holds comes after it
            elif reason is not None:
                released = req.detokenizer.flush()  # a character cut off by the end is still shown
                req.text += released
                if released and reason == "stop":  # the held tokens' text: the stop token's (none) comes after it
                    prev_len = len(req.text)
            for f in filters:
                if self._filter(f, req):
                    reason = "stop"
            # where the token's own text starts: after what came out with it from tokens held back before it
            at = min(prev_len + req.detokenizer.last_lead, len(req.text))
            if reason is not None:
                ended.add(key)
            out.append(Emission(req, self._delta(req, reason is not None, filter_hold), reason, at,
                                req.detokenizer.holding))
        ctx.emissions = out

    @staticmethod
    def _filter(f, req: Request) -> bool:
        start = req.emitted_chars
        text, stop = f.filter_text(req, req.text, start)
        if len(text) < start:
            raise ValueError(
                f"text filter {type(f).__name__} cut request {req.request_id!r}'s text to {len(text)} characters, "
                f"but {start} were shown already"
            )
        req.text = text
        return bool(stop)

    @staticmethod
    def _stop_string(req: Request, prev_len: int) -> bool:
        """Cut the text at the first stop string the new token completed, if any."""
        stop = req.params.stop
        # only the tail that the new token can have completed needs searching
        start = max(0, prev_len - max(len(s) for s in stop) + 1)
        hits = [i for i in (req.text.find(s, start) for s in stop) if i >= 0]
        if hits:
            req.text = req.text[: min(hits)]
            return True
        return False

    @staticmethod
    def _delta(req: Request, finishing: bool, filter_hold: int = 0) -> str:
        # hold back text that could still become the start of a stop string, or change under a text filter
        if finishing:
            hold = 0
        else:
            hold = max(filter_hold, max(len(s) for s in req.params.stop) - 1 if req.params.stop else 0)
        upto = max(req.emitted_chars, len(req.text) - hold)
        delta = req.text[req.emitted_chars : upto]
        req.emitted_chars = upto
        return delta
