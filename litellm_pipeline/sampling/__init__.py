"""Sampling: what a request asks for (:mod:`.params`, ``SamplingParams``) and how tokens are picked
(:mod:`.samplers`, registry kind ``sampler``). Importing the package stays cheap: the samplers, which need
torch, load only when a pipeline is built."""

from litellm_pipeline.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
