"""sample: next tokens (and logprobs) for every request that reached the end of its known tokens."""

from __future__ import annotations

import inspect

import torch

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
        without ``d``). Greedy rows keep the draft while it is the argmax.

        A request with a generator (sampling) draws its positions one at a time and stops at the first token that
        differs from the draft: it takes one draw per token it outputs, as without a draft, so a seeded request
        gives the same tokens whatever was drafted (and whether anything was). The others go in one call."""
        rows, batched, spans, starts, one_by_one = [], [], [], [], set()
        at = 0
        for i, r in enumerate(reqs):
            draft = r.draft
            m = len(draft) + 1
            spans.append(m)
            starts.append(at)
            if r.generator is not None and draft:
                one_by_one.add(i)
            else:
                for j in range(m):
                    batched.append(at + j)
                    rows.append(SamplingRow(r.params, r.generator, r.prompt_ids,
                                            r.output_ids + draft[:j] if j else r.output_ids))
            at += m
        constrained = [(starts[i], r.matcher) for i, r in enumerate(reqs) if r.matcher is not None]  # one row each
        if constrained:
            self._mask(ctx.logits, constrained, [r for r, m in zip(reqs, spans) for _ in range(m)])
        got = {}
        if rows:
            logits = ctx.logits if len(batched) == at else ctx.logits[torch.tensor(batched, device=ctx.logits.device)]
            out = self.sampler(logits, rows)
            got = {row: (t, lp) for row, t, lp in zip(batched, out.token_ids, out.logprobs)}
        samples = []
        for i, r in enumerate(reqs):
            draft, first = r.draft, starts[i]
            for j in range(spans[i]):
                if i in one_by_one:
                    seen = r.output_ids + draft[:j] if j else r.output_ids
                    row = SamplingRow(r.params, r.generator, r.prompt_ids, seen)
                    out = self.sampler(ctx.logits[first + j : first + j + 1], [row])
                    t, lp = out.token_ids[0], out.logprobs[0]
                else:
                    t, lp = got[first + j]
                samples.append(SampledToken(r, t, lp))
                if j == spans[i] - 1 or t != draft[j]:
                    break
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
