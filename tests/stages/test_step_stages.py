"""Step-level stages only transform the step context; the engine's postprocess owns the bookkeeping. So
plugin stages that replace or wrap ``sample`` and ``emit`` (or leave ``emit`` out) cannot break
scheduling: requests still advance, finish at their limits and give every block back."""

from __future__ import annotations

import pytest

from litellm_pipeline import LLM, SamplingParams
from litellm_pipeline.engine.request import Emission, Sample
from litellm_pipeline.errors import InternalError
from litellm_pipeline.registry import register
from litellm_pipeline.stages.base import Stage
from litellm_pipeline.stages.emit import Emit

ORDER = "pipeline.order=[admit,select_tier,route,prefill,decode,{rest}]"


@register("stage", "test_constant_sample")
class ConstantSample(Stage):
    """A sampler stage of its own: always the same token, no logprobs."""

    inputs = ("sample_requests",)
    outputs = ("samples",)

    def __init__(self, rt, token: int = 65):
        super().__init__(rt)
        self.token = token

    def __call__(self, ctx) -> None:
        ctx.samples = [Sample(r, self.token, None) for r in ctx.sample_requests]


@register("stage", "test_never_finish_emit")
class NeverFinishEmit(Emit):
    """Wraps the built-in emit but never asks to finish anything."""

    def __call__(self, ctx) -> None:
        super().__call__(ctx)
        ctx.emissions = [Emission(e.request, e.delta_text, None) for e in ctx.emissions]


@register("stage", "test_failing_once")
class FailingOnce(Stage):
    """Raises in the first step it sees (after the forward), then passes everything through."""

    inputs = ("samples",)
    outputs = ("samples",)
    failed = False

    def __call__(self, ctx) -> None:
        if not type(self).failed:
            type(self).failed = True
            raise RuntimeError("plugin stage failed")


@pytest.fixture(scope="module")
def path(hf_checkpoint):
    return str(hf_checkpoint("llama"))


def _stage(name: str, impl: str, params: str = "{}") -> str:
    return f"+pipeline.stages.{name}={{impl: {impl}, params: {params}}}"


def _run_all(llm: LLM, prompts, params):
    reqs = [llm.engine.add_request(p, params) for p in prompts]
    steps = 0
    while llm.engine.has_unfinished():
        llm.engine.step()
        steps += 1
        assert steps < 500, "the engine stopped making progress"
    return reqs


def test_replaced_sample_and_no_emit_still_finish_and_free(path):
    llm = LLM(
        model=path,
        overrides=[_stage("mine", "test_constant_sample", "{token: 66}"), ORDER.format(rest="mine"),
                   "~pipeline.stages.sample", "~pipeline.stages.emit"],
        block_size=4, num_blocks=32,
    )
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    reqs = _run_all(llm, [[1, 2, 3], list(range(3, 20)), [9] * 30], params)
    for r in reqs:
        assert r.output_ids == [66] * 7 and r.finish_reason == "length" and r.finished
        assert r.num_computed == r.num_tokens - 1  # the last token is sampled, never fed back
    assert llm.engine.rt.pool.is_empty() and not llm.engine.requests


def test_engine_stops_on_eos_and_stop_ids_without_an_emit_stage(path):
    llm = LLM(
        model=path,
        overrides=[_stage("mine", "test_constant_sample", "{token: 1}"), ORDER.format(rest="mine"),
                   "~pipeline.stages.sample", "~pipeline.stages.emit"],
    )
    eos = sorted(llm.engine.rt.eos_token_ids)[0]
    assert eos == 1
    (r,) = _run_all(llm, [[5, 6, 7]], SamplingParams(max_tokens=7))
    assert r.output_ids == [1] and r.finish_reason == "stop"
    (r,) = _run_all(llm, [[5, 6, 7]], SamplingParams(max_tokens=7, ignore_eos=True, stop_token_ids=[1]))
    assert r.output_ids == [1] and r.finish_reason == "stop"
    assert llm.engine.rt.pool.is_empty()


def test_emit_that_never_finishes_cannot_overrun_the_limits(path):
    base = LLM(model=path)
    llm = LLM(model=path, overrides=["pipeline.stages.emit.impl=test_never_finish_emit"], max_model_len=40)
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3], list(range(4, 36))]
    reqs = _run_all(llm, prompts, params)
    assert reqs[0].finish_reason == "length" and len(reqs[0].output_ids) == 9
    assert reqs[1].finish_reason == "length" and reqs[1].num_tokens == 40  # the context, not max_tokens
    assert reqs[0].output_ids == base.generate(prompts[0], params)[0].token_ids
    assert llm.engine.rt.pool.is_empty()


def test_a_step_that_fails_once_is_retried_and_changes_nothing(path):
    """The stage raises after the forward and sampling: nothing had been advanced, the generators and text
    are put back, each request is run again alone, and every output equals an engine's that never failed."""
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.9, seed=4, ignore_eos=True, stop=["zz"])]
    prompts = [[1, 2, 3, 4, 5], list(range(10, 30))]
    ref = LLM(model=path).generate(prompts, params)
    FailingOnce.failed = False
    llm = LLM(model=path, overrides=[_stage("boom", "test_failing_once"),
                                     "pipeline.order=[admit,select_tier,route,prefill,decode,sample,emit,boom]"])
    outs = llm.generate(prompts, params)
    assert FailingOnce.failed
    assert [(o.token_ids, o.text, o.error) for o in outs] == [(o.token_ids, o.text, None) for o in ref]
    assert llm.engine.rt.pool.is_empty()


@register("stage", "test_fail_marked")
class FailMarked(Stage):
    """Raises whenever a request whose prompt starts with token 13 is in the step."""

    inputs = ("samples",)
    outputs = ("samples",)

    def __call__(self, ctx) -> None:
        for req, _ in ctx.schedule:
            if req.prompt_ids[0] == 13:
                raise ValueError(f"marked request {req.request_id}")


def test_a_request_that_always_fails_ends_with_an_error_and_the_batch_goes_on(path):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    good = [[1, 2, 3], list(range(20, 40)), [7, 8]]
    ref = [o.token_ids for o in LLM(model=path).generate(good, params)]
    llm = LLM(model=path, overrides=[_stage("mark", "test_fail_marked"),
                                     "pipeline.order=[admit,select_tier,route,prefill,decode,sample,mark,emit]"])
    outs = llm.generate([good[0], [13, 14, 15], good[1], good[2]], params)
    bad = outs[1]
    assert bad.finish_reason == "error" and bad.token_ids == []
    assert "ValueError: marked request" in bad.error and bad.error_id and bad.error.endswith(f"(error id {bad.error_id})")
    assert [o.token_ids for i, o in enumerate(outs) if i != 1] == ref
    assert all(o.error is None and o.finish_reason == "length" for i, o in enumerate(outs) if i != 1)
    assert llm.engine.rt.pool.is_empty() and not llm.engine.requests
    with pytest.raises(InternalError, match="marked request") as info:
        list(llm.stream([13, 1], params))
    assert info.value.status_code == 500
    assert llm.engine.rt.pool.is_empty()


def test_a_graph_without_samples_is_a_config_error(path):
    from litellm_pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match="no stage produces 'samples'"):
        LLM(model=path, overrides=["pipeline.order=[admit,select_tier,route,prefill,decode]",
                                   "~pipeline.stages.sample", "~pipeline.stages.emit"])


def test_async_stream_of_a_failing_request_raises_and_the_others_finish(path):
    import asyncio

    from litellm_pipeline.engine.async_engine import AsyncEngine, EngineStepError

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ref = LLM(model=path).generate([1, 2, 3], params)[0].token_ids
    llm = LLM(model=path, overrides=[_stage("mark", "test_fail_marked"),
                                     "pipeline.order=[admit,select_tier,route,prefill,decode,sample,mark,emit]"])

    async def consume(aeng, prompt):
        return [o async for o in aeng.generate(prompt, params)]

    async def main():
        async with AsyncEngine(llm.engine) as aeng:
            return await asyncio.gather(consume(aeng, [1, 2, 3]), consume(aeng, [13, 5]), return_exceptions=True)

    good, bad = asyncio.run(asyncio.wait_for(main(), 60))
    assert isinstance(bad, EngineStepError) and bad.status_code == 500 and "marked request" in str(bad)
    assert good[-1].finished and good[-1].token_ids == ref
    assert llm.engine.rt.pool.is_empty()
