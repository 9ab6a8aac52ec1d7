"""Speculative decoding: proposers draft tokens, one forward of the request's own model verifies them.

* :class:`Speculator` — the engine's side: which running requests draft how many tokens this step (per request
  ``k``, lowered where drafts keep failing, paused where nothing is accepted), and what verification kept.
* Proposers (registry kind ``proposer``, ``speculative.method``): ``ngram`` (prompt lookup), ``tier``
  (self-speculation: the same MoE model at a cheaper tier) and ``draft`` (a small checkpoint with the same
  vocabulary). A plugin adds one with ``@register("proposer", NAME)``.

Verification is the sample stage's (:meth:`litellm_pipeline.stages.sample.Sample`): a drafted token is kept
while it equals what the target samples at its position, which keeps the output distribution exactly the
target's; the engine's postprocess keeps the KV of the kept tokens only and gives the rest back.
"""

from litellm_pipeline.speculative.speculator import SpeculativeSettings, Speculator

__all__ = ["Speculator", "SpeculativeSettings"]
