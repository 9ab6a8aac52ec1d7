"""sample: next tokens (and logprobs) for every request that reached the end of its known tokens."""

from __future__ import annotations

import inspect

from litellm_pipeline import registry
from litellm_pipeline.constraints.masking import mask_logits
from litellm_pipeline.engine.request import Sample as SampledToken
from litellm_pipeline.registry import register
from litellm_pipeline.registry.types import SamplingRow
from litellm_pipeline.stages.base import Stage, StepContext


@register("stage", "sample")
class Sample(Stage):
    inputs = ("logits", "sample_requests")
    optional_inputs = ("logits_argmax",)
    outputs = ("samples",)

    def __init__(self, rt, sampler: str = "default", **sampler_params):
        super().__init__(rt)
        self.sampler = registry.get("sampler", sampler)(**sampler_params)
        # samplers that take each row's argmax as computed with the logits (see the Sampler interface)
        self.takes_argmax = "argmax" in inspect.signature(self.sampler.__call__).parameters

    def __call__(self, ctx: StepContext) -> None:
        reqs = ctx.sample_requests
        if not reqs:
            ctx.samples = []
            return
        if any(r.draft for r in reqs):
            self._verify(ctx, reqs)
            return
        rows = [SamplingRow(r.params, r.generator, r.prompt_ids, r.output_ids) for r in reqs]
        argmax = getattr(ctx, "logits_argmax", None)
        constrained = [(i, r.matcher) for i, r in enumerate(reqs) if r.matcher is not None]
        if constrained:
            self._mask(ctx.logits, constrained, reqs)
            # the decode stage's argmax is of the unmasked logits: the sampler finds what it needs itself (the
            # default one only for greedy rows; finding every masked row's again would cost more than the mask)
            argmax = None
        if argmax is not None and self.takes_argmax:
            out = self.sampler(ctx.logits, rows, argmax=argmax)
        else:
            out = self.sampler(ctx.logits, rows)
        ctx.samples = [SampledToken(r, t, lp) for r, t, lp in zip(reqs, out.token_ids, out.logprobs)]

    def _verify(self, ctx: StepContext, reqs) -> None:
        """Speculative decoding's verification: every drafted position is sampled as if it came next (its row
        sees the output up to it, draft tokens included, for penalties), and a request keeps its draft tokens
        while they equal what was sampled, then the first token sampled differently (or the one after a whole
        accepted draft). Each kept token is a sample of the target distribution given the ones before it, so
        the output follows that distribution exactly: for a drafted token ``d`` this is rejection sampling with
        a proposal that puts all its mass on ``d`` (accept with probability ``p(d)``, else draw from ``p``
        without ``d``). Greedy rows keep the draft while it is the argmax."""
        rows, spans = [], []
        for r in reqs:
            draft = r.draft
            spans.append(len(draft) + 1)
            rows.append(SamplingRow(r.params, r.generator, r.prompt_ids, r.output_ids))
            for j in range(1, len(draft) + 1):
                rows.append(SamplingRow(r.params, r.generator, r.prompt_ids, r.output_ids + draft[:j]))
        constrained, at = [], 0
        for r, m in zip(reqs, spans):
            if r.matcher is not None:  # never drafted for (one row)
                constrained.append((at, r.matcher))
            at += m
        if constrained:
            self._mask(ctx.logits, constrained, [r for r, m in zip(reqs, spans) for _ in range(m)])
        out = self.sampler(ctx.logits, rows)
        samples, i = [], 0
        for r, m in zip(reqs, spans):
            draft = r.draft
            for j in range(m):
                t = out.token_ids[i + j]
                samples.append(SampledToken(r, t, out.logprobs[i + j]))
                if j == m - 1 or t != draft[j]:
                    break
            i += m
        ctx.samples = samples

    @staticmethod
    def _mask(logits, constrained, reqs) -> None:
        """Each constrained row's logits masked, in place, to what its constraint allows."""
        dead = mask_logits(logits, constrained)
        if dead:  # the engine retries the step without the others and fails this request with the message
            r = reqs[dead[0]]
            raise ConstraintDeadEnd(
                f"request {r.request_id!r}: its constraint ({r.spec.constraint.kind}) allows no token of this "
                f"model's vocabulary after {len(r.output_ids)} output tokens")


class ConstraintDeadEnd(ValueError):
    """A constrained request reached a point where no token of the vocabulary can continue it."""
