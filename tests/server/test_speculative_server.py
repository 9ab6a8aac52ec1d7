"""A server with speculative decoding: the official client gets the text it gets without it (plain, streamed,
``n``, logprobs), ``num_speculative_tokens`` in the body turns it off or is refused when bad, and ``/metrics``
counts drafts."""

from __future__ import annotations

import openai
import pytest
from _server_util import start_server, wait_pool_empty

from litellm_pipeline import SamplingParams
from litellm_pipeline.demo import demo_prompts

PROMPTS = [ex.prompt for ex in demo_prompts(0)]


@pytest.fixture(scope="module")
def spec_server():
    live = start_server(["speculative=tier", "speculative.disable_by_batch_size=null", "speculative.adaptive=false",
                         "pipeline.stages.select_tier.params.tier=max"], max_n=4)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def plain():
    from litellm_pipeline import LLM

    return LLM(overrides=["+recipe=serve", "device.threads=1", "pipeline.stages.select_tier.params.tier=max"])


def test_same_text_plain_streamed_n_and_logprobs(spec_server, plain):
    client = spec_server.openai()
    refs = plain.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, logprobs=1))
    drafted = 0
    for prompt, ref in zip(PROMPTS, refs):
        resp = client.completions.create(model="demo", prompt=prompt, max_tokens=12, temperature=0, n=2, logprobs=1)
        assert [c.text for c in resp.choices] == [ref.text, ref.text]
        lp = resp.choices[0].logprobs.token_logprobs
        listed = len(ref.token_ids) - (ref.finish_reason == "stop")  # the end-of-sequence token is not in the text
        assert lp == pytest.approx([d[t] for d, t in zip(ref.logprobs, ref.token_ids)][:listed], abs=1e-4)
        drafted += resp.choices[0].model_extra["cost"]["draft_tokens"]
        chunks = client.completions.create(model="demo", prompt=prompt, max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert drafted > 0
    from prometheus_client.parser import text_string_to_metric_families

    with spec_server.client() as http:
        families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    drafts = families["litellm_pipeline:spec_decode_num_draft_tokens"].samples
    assert drafts and drafts[0].value >= drafted  # every draft of these requests counted (and the streamed ones)
    wait_pool_empty(spec_server.engine)


def test_num_speculative_tokens_in_the_body(spec_server, plain):
    client = spec_server.openai()
    (ref,) = plain.generate(PROMPTS[2], SamplingParams(max_tokens=12, temperature=0))
    off = client.completions.create(model="demo", prompt=PROMPTS[2], max_tokens=12, temperature=0,
                                    extra_body={"num_speculative_tokens": 0})
    assert off.choices[0].text == ref.text and off.choices[0].model_extra["cost"]["draft_tokens"] == 0
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="demo", prompt=PROMPTS[2], max_tokens=4,
                                  extra_body={"num_speculative_tokens": -1})
    assert "num_speculative_tokens" in str(err.value)
    ok = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert ok.choices[0].text  # the server keeps serving
    wait_pool_empty(spec_server.engine)
