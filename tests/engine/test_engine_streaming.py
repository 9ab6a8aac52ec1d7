"""LLM.stream: deltas add up to generate's output; leaving the iterator early aborts the request."""

from __future__ import annotations

import pytest
from _engine_util import alone, assert_pool_empty, boundary_stop, greedy, printable_stop
from hf_models import random_prompts

from litellm_pipeline import SamplingParams


@pytest.mark.parametrize(
    "prompt,params",
    [
        (random_prompts([17], seed=81)[0], greedy(20)),
        ("Hello, streaming world!", greedy(12)),
        (random_prompts([5], seed=82)[0], SamplingParams(temperature=0.9, seed=4, max_tokens=16, ignore_eos=True)),
        (random_prompts([1], seed=83)[0], greedy(8)),
        # a stop string that never matches: text held back as a possible stop prefix comes out at the end
        (random_prompts([17], seed=81)[0], greedy(20, stop=["\u2603 never here"])),
    ],
    ids=["ids", "text", "seeded", "one-token", "unmatched-stop"],
)
def test_stream_matches_generate(llama, prompt, params):
    final = alone(llama, prompt, params)
    deltas = list(llama.stream(prompt, params))
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    assert deltas[-1].finish_reason == final.finish_reason == "length"
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert len(deltas) == params.max_tokens and all(len(d.token_ids) == 1 for d in deltas)  # one per step
    if params.stop:
        assert final.text == alone(llama, prompt, params.model_copy(update={"stop": []})).text
    assert_pool_empty(llama)


def test_stream_with_stop_string_never_shows_it(llama):
    prompt = random_prompts([15], seed=84)[0]
    first = alone(llama, prompt, greedy(24))
    stop = printable_stop(first.text, len(first.text) // 2)
    params = greedy(24, stop=[stop])
    final = alone(llama, prompt, params)
    deltas = list(llama.stream(prompt, params))
    text = "".join(d.text for d in deltas)
    assert text == final.text == first.text[: first.text.find(stop)]
    assert stop not in text and deltas[-1].finish_reason == "stop"
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    assert_pool_empty(llama)


def test_break_out_of_stream_aborts(llama):
    prompt = random_prompts([30], seed=85)[0]
    got = []
    for d in llama.stream(prompt, greedy(40)):
        got.append(d)
        if len(got) == 3:
            break
    # no gc.collect(): the loop drops the generator, which closes it (and aborts the request) at once
    assert_pool_empty(llama)
    assert [t for d in got for t in d.token_ids] == alone(llama, prompt, greedy(3)).token_ids


def test_close_and_exception_abort(llama):
    prompt = random_prompts([30], seed=86)[0]
    it = llama.stream(prompt, greedy(40))
    next(it)
    next(it)
    assert llama.engine.has_unfinished()
    it.close()
    assert_pool_empty(llama)

    with pytest.raises(RuntimeError, match="consumer failed"):
        for i, _ in enumerate(llama.stream(prompt, greedy(40))):
            if i == 2:
                raise RuntimeError("consumer failed")
    assert_pool_empty(llama)


def test_stream_never_started_holds_nothing(llama):
    it = llama.stream(random_prompts([10], seed=87)[0], greedy(5))  # generator body not entered yet
    del it
    assert_pool_empty(llama)


@pytest.mark.parametrize("seed", [88, 89])
def test_stream_holds_back_a_stop_string_prefix(llama, seed):
    """The stop string straddles two tokens: its first character must not be streamed before the second
    token shows whether the stop string completes."""
    prompt = random_prompts([15], seed=seed)[0]
    first = alone(llama, prompt, greedy(24))
    stop = boundary_stop(llama, prompt, greedy(24))
    params = greedy(24, stop=[stop])
    final = alone(llama, prompt, params)
    assert final.finish_reason == "stop" and final.text == first.text[: first.text.find(stop)]
    deltas = list(llama.stream(prompt, params))
    streamed = ""
    for d in deltas:
        streamed += d.text
        assert final.text.startswith(streamed), f"streamed {streamed!r}, which the final text {final.text!r} is not"
    assert streamed == final.text
    assert_pool_empty(llama)
