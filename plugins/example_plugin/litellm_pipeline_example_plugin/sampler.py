"""example_argmax: a sampler registered through the lazy per-kind entry point group ``litellm_pipeline.sampler``.

It picks the argmax of every row whatever the request's temperature / top-k / top-p / seed say (ties:
lowest id; logprobs still honoured) -- the built-in ``greedy`` behaviour, reused by subclassing. A
sampler is any class built as ``cls(**params)`` from ``pipeline.stages.sample.params`` and called as
``sampler(logits [R, V], rows) -> SamplerOutput``. Select it with::

    pipeline.stages.sample.params.sampler=example_argmax
"""

from __future__ import annotations

from typing import Any

from litellm_pipeline.sampling.samplers import GreedySampler


class ArgmaxSampler(GreedySampler):
    """Argmax of every row, ignoring the sampling parameters (only ``logprobs`` is honoured)."""

    # what ``pytest --litellm-conformance`` passes its check: it never draws, so the kit checks no draws
    conformance = {"stochastic": False}

    def __init__(self, **params: Any) -> None:
        if params:
            raise ValueError(f"sampler 'example_argmax' takes no parameters (got {sorted(params)})")
        super().__init__()
