"""phrase_filter: the conformance kit, masking across token boundaries, stop phrases, and config errors."""

from __future__ import annotations

import pytest

plugin = pytest.importorskip(
    "litellm_pipeline_phrase_filter", reason="plugin not installed: pip install -e plugins/phrase_filter"
)

from litellm_pipeline import SamplingParams, registry  # noqa: E402
from litellm_pipeline.errors import ConfigError  # noqa: E402
from litellm_pipeline.testing import check_stage  # noqa: E402
from litellm_pipeline.testing._support import assert_drained, build_llm  # noqa: E402

ORDER = "pipeline.order=[admit,select_tier,route,prefill,decode,sample,filter,emit]"
GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


def filtered(params: str, order: str = ORDER):
    return build_llm([f"+pipeline.stages.filter={{impl: phrase_filter, params: {params}}}", order])


def streamed(llm, prompt: str, params: SamplingParams = GREEDY) -> tuple[list[str], object]:
    """The deltas a stream shows, and the same request's final output."""
    deltas = [d.text for d in llm.stream(prompt, params)]
    return deltas, llm.generate(prompt, params)[0]


@pytest.fixture(scope="module")
def plain():
    return build_llm()


def test_registered_through_its_entry_point():
    assert "phrase_filter" in registry.names("stage")
    assert registry.get("stage", "phrase_filter") is plugin.PhraseFilter


def test_passes_the_conformance_kit():
    got = check_stage(plugin.PhraseFilter, {"redact": ["secret", "ell"], "stop": ["7"]})
    assert got["order"][-3:] == ["sample", "checked", "emit"]  # placed where its input (samples) exists


def test_masks_a_word_spread_over_several_tokens(plain):
    assert plain.generate("copy:secret7=", GREEDY)[0].text == "secret7"  # one token per character
    deltas, out = streamed(filtered("{redact: [secret]}"), "copy:secret7=")
    assert out.text == "".join(deltas) == "******7"
    shown = ""
    for d in deltas:  # no moment of the stream shows a letter of the word
        shown += d
        assert set(shown) <= {"*", "7"}, deltas


def test_masking_keeps_tokens_and_follows_ignore_case(plain):
    want = plain.generate("copy:hello=", GREEDY)[0]
    out = filtered("{redact: [LL], ignore_case: true, mask: '#'}").generate("copy:hello=", GREEDY)[0]
    assert out.text == "he##o" and out.token_ids == want.token_ids and out.finish_reason == want.finish_reason
    assert filtered("{redact: [LL]}").generate("copy:hello=", GREEDY)[0].text == "hello"  # case-sensitive


def test_a_stop_phrase_ends_the_request(plain):
    full = plain.generate("copy:hello=", GREEDY)[0]
    llm = filtered("{stop: [ll]}")
    deltas, out = streamed(llm, "copy:hello=")
    assert out.text == "".join(deltas) == "he" and out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[:4]  # finished at the token that completed the phrase
    assert_drained(llm, "phrase_filter stop")


def test_works_with_the_engines_own_limits_and_stop_strings():
    llm = filtered("{redact: [ll], stop: [zz]}")
    out = llm.generate("copy:hello=", SamplingParams(temperature=0.0, max_tokens=3))[0]
    # the held-back "l" could have started "ll"; the token limit ends the request, so it is shown as it is
    assert out.text == "hel" and out.finish_reason == "length" and len(out.token_ids) == 3
    out = llm.generate("copy:hello=", SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert out.text == "he**" and out.finish_reason == "length"
    out = llm.generate("copy:hello=", SamplingParams(temperature=0.0, max_tokens=20, stop=["o"]))[0]
    assert out.text == "he**" and out.finish_reason == "stop"


@pytest.mark.parametrize("bad, key", [("{redact: secret}", "redact"), ("{stop: ['']}", "stop"),
                                      ("{redact: [a], mask: '**'}", "mask"), ("{stop: [a], ignore_case: 2}", "ignore_case"),
                                      ("{words: [a]}", "words")])
def test_bad_params_are_config_errors(bad, key):
    with pytest.raises(ConfigError, match=r"pipeline\.stages\.filter\.params") as exc:
        filtered(bad)
    assert key in str(exc.value)


def test_after_emit_is_a_graph_error():
    with pytest.raises(ConfigError, match=r"stage 'filter' produces 'text_filters', which stage 'emit' reads before"):
        filtered("{stop: [a]}", "pipeline.order=[admit,select_tier,route,prefill,decode,sample,emit,filter]")


def test_composes_with_a_second_filter_and_the_requests_stop_strings():
    llm = build_llm(["+pipeline.stages.f1={impl: phrase_filter, params: {redact: [ll]}}",
                     "+pipeline.stages.f2={impl: phrase_filter, params: {redact: [h], mask: '#'}}",
                     "pipeline.order=[admit,select_tier,route,prefill,decode,sample,f1,f2,emit]"])
    deltas, out = streamed(llm, "copy:hello=")
    assert out.text == "".join(deltas) == "#e**o"
    # the request's stop string sees the text before the filters: "l" stops it at "he"
    out = llm.generate("copy:hello=", SamplingParams(temperature=0.0, max_tokens=20, stop=["l"]))[0]
    assert out.text == "#e" and out.finish_reason == "stop"
