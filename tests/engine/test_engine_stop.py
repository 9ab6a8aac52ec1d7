"""Finish rules: stop strings, stop token ids, max_tokens, the context limit and EOS (config and generation_config)."""

from __future__ import annotations

import json
import shutil

import pytest
from _engine_util import alone, assert_pool_empty, boundary_stop, greedy, printable_stop
from hf_models import random_prompts

from litellm_pipeline import SamplingParams

N = 24


@pytest.mark.parametrize("seed", [61, 62, 63])
def test_stop_string_cuts_text(llama, seed):
    prompt = random_prompts([15], seed=seed)[0]
    first = alone(llama, prompt, greedy(N))
    stop = printable_stop(first.text, len(first.text) // 3)
    cut = first.text.find(stop)
    assert cut > 0
    second = alone(llama, prompt, greedy(N, stop=[stop]))
    assert second.finish_reason == "stop"
    assert second.text == first.text[:cut]
    assert stop not in second.text
    assert len(second.token_ids) < N
    assert second.token_ids == first.token_ids[: len(second.token_ids)]
    # generation stopped at the token that completed the stop string, not later
    upto = llama.tokenizer.decode(first.token_ids[: len(second.token_ids)])
    assert stop in upto and stop not in llama.tokenizer.decode(first.token_ids[: len(second.token_ids) - 1])
    # a stop string that never appears changes nothing
    third = alone(llama, prompt, greedy(N, stop=["\u2603never\u2603"]))
    assert third.token_ids == first.token_ids and third.text == first.text and third.finish_reason == "length"
    assert_pool_empty(llama)


def test_stop_string_across_tokens(llama):
    prompt = random_prompts([15], seed=60)[0]
    first = alone(llama, prompt, greedy(N))
    stop = boundary_stop(llama, prompt, greedy(N))
    out = alone(llama, prompt, greedy(N, stop=[stop]))
    assert out.finish_reason == "stop" and out.text == first.text[: first.text.find(stop)]
    assert out.token_ids == first.token_ids[: len(out.token_ids)] and len(out.token_ids) < N
    assert_pool_empty(llama)


def test_several_stop_strings_earliest_wins(llama):
    prompt = random_prompts([15], seed=64)[0]
    first = alone(llama, prompt, greedy(N))
    early = printable_stop(first.text, len(first.text) // 4, width=2)
    late = printable_stop(first.text, first.text.find(early) + 4, width=2)
    cut = min(first.text.find(early), first.text.find(late))
    out = alone(llama, prompt, greedy(N, stop=[late, early]))
    assert out.finish_reason == "stop" and out.text == first.text[:cut]
    assert_pool_empty(llama)


def test_stop_token_ids(llama):
    prompt = random_prompts([15], seed=65)[0]
    first = alone(llama, prompt, greedy(N))
    stop_id = first.token_ids[4]
    idx = first.token_ids.index(stop_id)
    out = alone(llama, prompt, greedy(N, stop_token_ids=[stop_id]))
    assert out.finish_reason == "stop"
    assert out.token_ids == first.token_ids[: idx + 1] and out.token_ids[-1] == stop_id
    assert_pool_empty(llama)


def test_a_request_ending_on_a_stop_token_shows_its_held_back_bytes(llama):
    """A token that ends mid-character (its bytes held back by the detokenizer) and stops the request: the text
    still ends with what those bytes decode to, as ``decode(token_ids)`` does, whether or not the request also
    has stop strings (which only cut the text where they match)."""
    tok = llama.tokenizer
    for seed in range(70, 90):
        prompt = random_prompts([12], seed=seed)[0]
        ids = alone(llama, prompt, greedy(N)).token_ids
        # the first token after which the text so far ends in an incomplete character, not seen before it
        cut = next((i for i in range(1, N) if tok.decode(ids[: i + 1]).endswith("\ufffd") and ids[i] not in ids[:i]),
                   None)
        if cut is not None:
            break
    assert cut is not None, "no greedy output of these prompts ends a token mid-character"
    want = tok.decode(ids[: cut + 1])
    for stop in ([], ["\u2603never\u2603"]):
        out = alone(llama, prompt, greedy(N, stop_token_ids=[ids[cut]], stop=stop))
        assert out.finish_reason == "stop" and out.token_ids == ids[: cut + 1]
        assert out.text == want, stop
    assert_pool_empty(llama)


def test_max_tokens_and_context_limit(make_llm):
    llm = make_llm("llama", max_model_len=64)
    prompt = random_prompts([40], seed=66)[0]
    for n in (1, 7):
        out = alone(llm, prompt, greedy(n))
        assert out.finish_reason == "length" and len(out.token_ids) == n
    near_end = random_prompts([60], seed=67)[0]
    out = alone(llm, near_end, greedy(20))
    assert out.finish_reason == "length" and len(out.token_ids) == 4  # 60 + 4 = the 64-token context
    assert_pool_empty(llm)


def _first_token(llama, prompt) -> int:
    t = alone(llama, prompt, greedy(4)).token_ids[0]
    assert t not in (0, 1, 2), "pick another prompt: the first token should be an ordinary one"
    return t


def test_eos_from_config_json(make_llm, hf_checkpoint, llama):
    prompt = random_prompts([12], seed=68)[0]
    t = _first_token(llama, prompt)
    llm = make_llm(ckpt=hf_checkpoint("llama", eos_token_id=t))  # same weights, eos_token_id = t
    assert t in llm.engine.rt.eos_token_ids
    out = alone(llm, prompt, SamplingParams(temperature=0, max_tokens=10))
    assert out.finish_reason == "stop" and out.token_ids == [t]
    out = alone(llm, prompt, greedy(10))  # ignore_eos: runs on
    assert out.finish_reason == "length" and len(out.token_ids) == 10
    assert out.token_ids == alone(llama, prompt, greedy(10)).token_ids
    assert_pool_empty(llm)


def test_eos_from_generation_config(make_llm, hf_checkpoint, llama, tmp_path):
    prompt = random_prompts([12], seed=69)[0]
    t = _first_token(llama, prompt)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoint("llama"), ckpt)
    gen_path = ckpt / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = [1, t]
    gen_path.write_text(json.dumps(gen))
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["eos_token_id"] == 1  # only generation_config.json names t
    llm = make_llm(ckpt=ckpt)
    out = alone(llm, prompt, SamplingParams(temperature=0, max_tokens=10))
    assert out.finish_reason == "stop" and out.token_ids == [t]
    # eos in the middle of a batch stops only that request
    other = random_prompts([20], seed=70)[0]
    ref_other = alone(llama, other, greedy(6)).token_ids
    assert t not in ref_other
    outs = llm.generate([other, prompt], SamplingParams(temperature=0, max_tokens=6))
    assert outs[1].token_ids == [t] and outs[1].finish_reason == "stop"
    assert outs[0].token_ids == ref_other and outs[0].finish_reason == "length"
    assert_pool_empty(llm)
